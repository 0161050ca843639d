"""Shared ``main`` of the pretraining entry points: parse, validate, train, report."""

from __future__ import annotations

import sys

from megatron.training.arguments import ArgumentError, parse_args


def run(model_family: str, argv: list[str] | None = None) -> int:
    """Parse flags (failing fast, before any process group, on a bad combination) and train
    a ``model_family`` model; returns the exit status."""
    try:
        args = parse_args(argv, model_family=model_family)
    except ArgumentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from megatron.core.parallel_state import destroy_distributed
    from megatron.training.result_validation import ResultValidationExit
    from megatron.training.training import pretrain

    try:
        pretrain(args)
    except ResultValidationExit as stop:  # every rank stops together, with Megatron's exit code
        print(f"error: {stop}", file=sys.stderr, flush=True)
        destroy_distributed()
        return stop.exit_code
    destroy_distributed()
    return 0
