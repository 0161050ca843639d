"""The Megatron-style log line and the --metrics-jsonl records."""

import json

import pytest

from megatron.training.metrics import MetricsLogger, SSDShape, training_flops_per_token


def test_log_line_and_jsonl_records(tmp_path):
    lines = []
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(True, str(path), print_fn=lines.append)
    logger.log_training(
        iteration=3,
        train_iters=10,
        consumed_samples=24,
        elapsed_ms=12.5,
        tokens_per_s=100.0,
        tflops=0.25,
        lr=1e-3,
        loss=2.5,
        grad_norm=1.5,
        skipped=1,
        nan=0,
        batch_size=8,
        num_zeros=12,
        params_norm=3.5,
    )
    logger.log_evaluation(iteration=3, loss=2.0)
    logger.close()
    line = lines[0]
    for field in (
        "iteration        3/      10",
        "consumed samples:           24",
        "elapsed time per iteration (ms): 12.5",
        "tokens/s: 100.0",
        "TFLOP/s: 0.2500",
        "learning rate: 1.000000E-03 | global batch size:     8 | lm loss: 2.500000E+00",
        "grad norm: 1.500 | num zeros: 12.0 | params norm: 3.500 | number of skipped iterations:   1",
        "number of skipped iterations:   1",
        "number of nan iterations:   0",
    ):
        assert field in line
    assert "validation loss at iteration 3 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00" in lines[1]
    train, valid = [json.loads(x) for x in path.read_text().splitlines()]
    assert train == {
        "type": "train",
        "iteration": 3,
        "consumed_samples": 24,
        "lm loss": 2.5,
        "lr": 1e-3,
        "grad_norm": 1.5,
        "elapsed_ms_per_iteration": 12.5,
        "tokens_per_s": 100.0,
        "tflops": 0.25,
        "skipped_iterations": 1,
        "nan_iterations": 0,
        "num_zeros_in_grad": 12,
        "params_norm": 3.5,
    }
    assert valid["type"] == "validation" and valid["lm loss"] == 2.0 and abs(valid["lm loss ppl"] - 7.389056) < 1e-6


def test_evaluations_after_training_name_their_set_as_megatron_does(tmp_path):
    lines = []
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(True, str(path), print_fn=lines.append)
    logger.log_evaluation(iteration=300, loss=2.0, final=True)
    logger.log_evaluation(iteration=300, loss=2.25, label="test", final=True)
    logger.close()
    values = " | lm loss value: {} | lm loss PPL: {} |"
    assert [block.splitlines()[1] for block in lines] == [
        " validation loss at iteration 300 on validation set" + values.format("2.000000E+00", "7.389056E+00"),
        " validation loss at iteration 300 on test set" + values.format("2.250000E+00", "9.487736E+00"),
    ]
    assert [json.loads(x)["type"] for x in path.read_text().splitlines()] == ["validation", "test"]


def test_disabled_logger_writes_nothing(tmp_path):
    lines = []
    logger = MetricsLogger(False, str(tmp_path / "m.jsonl"), print_fn=lines.append)
    logger.log_training(
        iteration=1,
        train_iters=1,
        consumed_samples=1,
        elapsed_ms=1,
        tokens_per_s=1,
        tflops=0,
        lr=0,
        loss=1,
        grad_norm=None,
        skipped=0,
        nan=0,
    )
    assert lines == [] and not (tmp_path / "m.jsonl").exists()


def test_flops_per_token_by_hand():
    # 6 per matrix weight, plus 6 * s * h per attention layer
    assert training_flops_per_token(1000, 2, 16, 8) == 6 * 1000 + 6 * 2 * 16 * 8


def _scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_tags_are_megatrons_and_keep_validation_apart(tmp_path):
    logger = MetricsLogger(True, tensorboard_dir=str(tmp_path), print_fn=lambda line: None)
    logger.log_training(
        iteration=5,
        train_iters=10,
        consumed_samples=40,
        elapsed_ms=250.0,
        tokens_per_s=512.0,
        tflops=0.5,
        lr=1e-3,
        loss=2.5,
        grad_norm=1.5,
        skipped=0,
        nan=0,
        loss_scale=4096.0,
        batch_size=8,
        num_zeros=12,
        params_norm=3.5,
    )
    logger.log_evaluation(iteration=5, loss=2.0)
    logger.log_evaluation(iteration=5, loss=2.25, label="test")
    logger.close()
    scalars = _scalars(tmp_path)
    assert scalars["lm loss"] == [(5, 2.5)]
    assert scalars["lm loss validation"] == [(5, 2.0)] and scalars["lm loss test"] == [(5, 2.25)]
    expected = {
        "learning-rate": 1e-3,
        "grad-norm": 1.5,
        "loss-scale": 4096.0,
        "batch-size": 8,
        "throughput": 0.5,
        "tokens-per-second": 512.0,
        "iteration-time": 0.25,
        "num-zeros": 12.0,
        "params-norm": 3.5,
    }
    for tag, value in expected.items():
        assert scalars[tag] == [(5, pytest.approx(value))], tag
    assert scalars["mem-max-rss-bytes"][0][1] > 1e6  # this CPU process's peak resident memory


def test_mamba_scan_flops_by_hand():
    # per layer and token, forward: C B^T (2QNG) and its product with x (2QPH), halved by the
    # causal mask, plus chunk states and their readout (2NPH each); x3 for the backward
    ssd = SSDShape(heads=4, head_dim=8, state_dim=16, groups=2, chunk_size=32)
    forward = (2 * 32 * 16 * 2 + 2 * 32 * 8 * 4) / 2 + 2 * (2 * 16 * 8 * 4)
    assert training_flops_per_token(1000, 1, 64, 8, 3, ssd) == 6 * 1000 + 6 * 64 * 8 + 3 * 3 * forward
    # a sequence shorter than a chunk is one chunk of its own length
    short = (2 * 16 * 16 * 2 + 2 * 16 * 8 * 4) / 2 + 2 * (2 * 16 * 8 * 4)
    assert training_flops_per_token(0, 0, 16, 8, 1, ssd) == 3 * short


def _moe_run_logs(flags, tensorboard_dir):
    """Train a tiny MoE GPT on this rank, recording every training pass's router losses (divided
    by their coefficients) as the routers compute them; returns (log lines, recorded losses)."""
    import contextlib
    import io

    from megatron.core.transformer.moe.router import TopKRouter
    from tests.unit_tests.training.tiny_training import train_tiny

    recorded, forward = [], TopKRouter.forward

    def recording_forward(router, *args, **kwargs):
        out = forward(router, *args, **kwargs)
        if router.training:
            coeffs = {"load_balancing_loss": router.config.moe_aux_loss_coeff, "z_loss": router.config.moe_z_loss_coeff}
            recorded.append({name: loss.item() / coeffs[name] for name, loss in router.aux_losses.items()})
        return out

    TopKRouter.forward = recording_forward
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        train_tiny([*flags, "--tensorboard-dir", str(tensorboard_dir)], world_size=2)
    return stdout.getvalue().splitlines(), recorded


def test_moe_losses_are_logged_averaged_over_layers_micro_batches_and_ranks(tmp_path):
    """Megatron's MoE logging: load_balancing_loss and z_loss (divided by their coefficients)
    averaged over the layers, the micro-batches and iterations of a --log-interval and the data-
    parallel ranks, in the log line and TensorBoard."""
    from tests.unit_tests.dist_harness import run_distributed

    flags = ["--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
    flags += ["--moe-z-loss-coeff", "0.001", "--train-iters", "2", "--log-interval", "2", "--eval-iters", "0"]
    (lines, first), (other_lines, second) = run_distributed(_moe_run_logs, 2, flags, tmp_path)
    assert len(first) == len(second) == 2 * 2 * 2  # layers x micro-batches (8 / (2 x 2)) x iterations
    (line,) = [line for line in lines + other_lines if " iteration " in line]
    scalars = _scalars(tmp_path)
    for name in ("load_balancing_loss", "z_loss"):
        expected = sum(p[name] for p in first + second) / len(first + second)
        value = float(line.split(f" {name}: ")[1].split(" |")[0])
        assert value == pytest.approx(expected, rel=1e-6), (name, line)
        assert scalars[name] == [(2, pytest.approx(expected, rel=1e-6))]
