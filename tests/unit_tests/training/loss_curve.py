"""The loss curve of a training run, read from its ``--metrics-jsonl`` file (the one place a
run records its losses; with ``--log-interval 1`` each record is one iteration's loss)."""

import json


def losses_by_iteration(jsonl_path) -> dict[int, float]:
    """``{iteration: "lm loss"}`` of every training record of the file."""
    with open(jsonl_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["lm loss"] for r in records if r["type"] == "train"}


def loss_curve(jsonl_path) -> list[float]:
    """The training losses in iteration order."""
    losses = losses_by_iteration(jsonl_path)
    return [losses[iteration] for iteration in sorted(losses)]
