"""Issue 19, item 6: a one-process megatron-serve listens on loopback only.

Its HTTP server binds 127.0.0.1 (no ``--host``), its coordinator too, and its torch.distributed
rendezvous store listens nowhere (a world of one keeps it in memory); nothing of the process
listens on another interface. (The supervised replicas' stores are checked in test_item_05.)"""

import sys

import pytest

from tests.readme import needs_a_device_per_rank
from tests.unit_tests.inference.faults.serving_processes import launched_command, listening_addresses
from tests.unit_tests.inference.launched_server import descendants
from tests.unit_tests.inference.test_serve_launchers import trained_checkpoint

LOOPBACK = {"127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory)


def test_a_one_process_server_listens_on_loopback_only(checkpoint):
    needs_a_device_per_rank(1)
    command = [sys.executable, "-m", "megatron.core.inference.server.launcher", "--load", checkpoint, "--port", "0"]
    with launched_command(command) as server:
        port = int(server.wait_for_url().rsplit(":", 1)[1])
        listening = listening_addresses([server.process.pid, *descendants(server.process.pid)])
        assert ("127.0.0.1", port) in listening
        assert {address for address, _ in listening} <= LOOPBACK, listening
