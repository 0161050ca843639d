"""A tiny training run through the real loop (``pretrain``), for tests that compare runs:
layouts, resumption, optimizer state. One list of the flags they share and one entry point."""

from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

# Model width, batch, learning rate and data of a tiny run on mock data (gloo, CPU); each test
# adds its layers, iterations, schedule, dropout and layout. Megatron's defaults are dropout
# 0.1 and 100 evaluation batches at the end: a test that compares losses pins its own.
TINY_RUN = [
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--mock-data",
    "--vocab-size",
    "64",
    "--attention-dropout",
    "0.0",
    "--distributed-backend",
    "gloo",
]
# What a run whose loss curve is compared with another layout's adds: no dropout, a short warmup and
# clipping. Each test still says how many evaluation batches end the run (Megatron's 100 of the
# validation and of the test split cost more than a tiny run's training).
CURVE_RUN = ["--hidden-dropout", "0.0", "--lr-warmup-iters", "2", "--clip-grad", "1.0"]


def tiny_args(flags: list[str], family: str = "gpt", world_size: int = 1):
    """The parsed arguments of ``TINY_RUN + flags``."""
    return parse_args(TINY_RUN + flags, model_family=family, world_size=world_size)


def train_tiny(flags: list[str], family: str = "gpt", world_size: int = 1, metrics_jsonl=None) -> tuple[int, int]:
    """Train ``TINY_RUN + flags`` on this rank (from ``run_distributed``); with ``metrics_jsonl``
    every iteration's loss is recorded there. Returns the final iteration and consumed samples."""
    metrics = ["--log-interval", "1", "--metrics-jsonl", str(metrics_jsonl)] if metrics_jsonl else []
    state = pretrain(tiny_args(flags + metrics, family, world_size))
    return state.iteration, state.consumed_samples
