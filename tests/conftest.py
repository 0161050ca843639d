"""Suite-wide settings: single-threaded ranks, Triton's interpreter without CUDA, the GPU marker,
and the skip policy.

The only acceptable reason to skip a test is a missing GPU ("needs ... GPU" / "needs
CUDA"); any other skip fails the run, so a package the test extra installs can never
silently turn a test into a skip.
"""

import importlib.util
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run under Triton's interpreter on CPU tensors. triton.language's
# own helpers (tl.zeros, tl.sum, ...) are decorated when triton is first imported, by whichever
# module imports it (transformers' NemotronH does), so the switch is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpret_dot_row_by_row() -> None:
    """Make the interpreter's ``tl.dot`` compute each output row on its own, as the GPU does.

    The interpreter multiplies a tile with numpy's BLAS, whose GEMM kernels on some CPUs (AVX2
    OpenBLAS, for one) round a row differently by its position in the tile, where an MMA on the
    GPU computes every output element by the same reduction wherever its row lies. The kernels'
    row-invariance tests check the kernels' structure (no split by row count), so the emulation
    must not add a row dependence of its own: one product per row gives every row the same bits
    wherever it sits.
    """
    from triton.runtime import interpreter

    tile_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def row_of(handle, i):
            return interpreter.TensorHandle(handle.data[..., i : i + 1, :], handle.dtype)

        rows = [
            tile_dot(self, row_of(a, i), b, row_of(d, i), input_precision, max_num_imprecise_acc)
            for i in range(a.data.shape[-2])
        ]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows], axis=-2), rows[0].dtype)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _interpret_dot_row_by_row()

ALLOWED_SKIP_MARKERS = ("needs a GPU", "GPUs", "needs CUDA")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(n): needs n CUDA GPUs; skipped with 'needs n GPUs' elsewhere")


def pytest_collection_modifyitems(config, items):
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else 1
        if available < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPUs (found {available})"))


_bad_skips: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(marker in reason for marker in ALLOWED_SKIP_MARKERS):
            _bad_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _bad_skips and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _bad_skips:
        terminalreporter.section("skips that are not allowed (only a missing GPU may skip a test)")
        for line in _bad_skips:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _no_process_group_left_in_the_pytest_process():
    """Forked ranks inherit the pytest process: a process group left initialized here makes
    later forks hang when they tear it down; under torchrun, it would turn the next single-process
    test into a multi-rank one. Tests must create groups only inside ranks (run_distributed)."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        pytest.fail(
            "this test left torch.distributed initialized in the pytest process; run it through run_distributed"
        )
