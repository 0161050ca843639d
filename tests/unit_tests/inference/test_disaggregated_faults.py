"""``examples/inference/disaggregated.py`` fails at once with one line naming the cause, never
hangs: where NIXL does not import it stops before starting anything (exit 2), and when an engine
process dies (here: the prefill engine cannot load a checkpoint whose weights were corrupted on
disk) it ends the other one and exits 1, naming the process. ``NixlTransport`` itself raises the
typed error where NIXL does not import."""

import shutil
import subprocess
import sys

import pytest

from megatron.core.inference.handoff import NixlTransport, NixlUnavailableError
from tests.readme import ROOT, command_env, subprocess_env
from tests.unit_tests.inference.test_serve_launchers import trained_checkpoint

DISAGGREGATED = str(ROOT / "examples" / "inference" / "disaggregated.py")
HIDDEN = "nixl is hidden by this test"
NIXL_MISSING = (
    f"error: the NIXL transport needs the nixl package, which does not import here ({HIDDEN}); install it "
    "(pip install nixl) or use TorchDistributedTransport"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory)


def _run(checkpoint: str, env: dict) -> subprocess.CompletedProcess:
    flags = ["--load", checkpoint, "--prompts", "Hello", "--num-tokens-to-generate", "2"]
    return subprocess.run([sys.executable, DISAGGREGATED, *flags], env=env, capture_output=True, text=True, timeout=180)


def test_nixl_transport_where_nixl_does_not_import_raises_the_typed_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # `import nixl...` now raises ImportError
    with pytest.raises(NixlUnavailableError, match=r"needs the nixl package, which does not import here"):
        NixlTransport("agent")


def test_without_nixl_the_example_stops_before_starting_anything(checkpoint, tmp_path):
    hidden = tmp_path / "hide" / "nixl"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(f"raise ImportError({HIDDEN!r})\n")
    done = _run(checkpoint, subprocess_env(PYTHONPATH=f"{hidden.parent}:{ROOT}", PYTHONUNBUFFERED="1"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == NIXL_MISSING
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_an_engine_process_that_dies_fails_the_run_at_once_naming_it(checkpoint, tmp_path):
    broken = tmp_path / "broken_ckpt"
    shutil.copytree(checkpoint, broken)
    (weights,) = broken.glob("iter_*/*.distcp")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)  # the second half of the weights zeroed
    weights.write_bytes(bytes(data))
    done = _run(str(broken), command_env())
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == "error: the prefill engine process exited with code 1 before it was ready; its error is above"
    assert "CorruptCheckpointError" in done.stderr  # the prefill process's own error, above the line
