"""Item 9: every connection the server accepts has TCP_NODELAY (no ~40 ms Nagle/delayed-ACK stall
per keep-alive response), whether the server bound its socket or the caller handed it one made
with protocol 0 (uvicorn and asyncio set the option only on sockets made with IPPROTO_TCP).

The server runs in this process, so the test finds the server's end of its own connection
among this process's file descriptors and reads the option there."""

import contextlib
import os
import socket

import pytest

from megatron.core.inference.coordinator import InferenceClient
from megatron.core.inference.server import ServerThread, bind_socket

from ..coordinator.cluster import running_cluster
from ..coordinator.engine_double import HashEngine
from ..server.harness import TOKENIZER


def _caller_made_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # protocol 0, as most callers write it
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def server_end_of(client: socket.socket) -> socket.socket:
    """A duplicate of the accepted socket at the other end of ``client`` (the caller closes it)."""
    wanted = (client.getpeername(), client.getsockname())
    for name in os.listdir("/proc/self/fd"):
        try:
            candidate = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # not a socket (or gone)
        with contextlib.suppress(OSError):
            if candidate.type == socket.SOCK_STREAM and (candidate.getsockname(), candidate.getpeername()) == wanted:
                return candidate
        candidate.close()
    raise AssertionError(f"no accepted socket for the client at {client.getsockname()}")


def _keep_alive_exchange(port: int, count: int) -> socket.socket:
    """``count`` GET /health on one connection (answered, not closed); returns the connection."""
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    for _ in range(count):
        client.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        response = b""
        while not response.endswith(b'{"status":"ok"}'):
            chunk = client.recv(4096)
            assert chunk, "the server closed a keep-alive connection"
            response += chunk
        assert response.startswith(b"HTTP/1.1 200")
    return client


@pytest.mark.parametrize("listener", [bind_socket, _caller_made_socket], ids=["bind_socket", "caller_made"])
def test_accepted_connections_have_tcp_nodelay(listener):
    with running_cluster([HashEngine()]) as coordinator:
        sock = listener()
        with ServerThread(InferenceClient(coordinator.address), sock=sock, tokenizer=TOKENIZER) as server:
            client = _keep_alive_exchange(server.port, count=3)
            with client, server_end_of(client) as accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
