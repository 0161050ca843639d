"""What rank 0 prints before the first iteration: the flags that differ from the defaults, the
compatibility notes of Megatron flags, the layout and tokens per step (at once), then the
parameter counts per pipeline stage and the dataset sizes (as soon as they are known)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.model_state import vocab_rows
from megatron.core.process_groups import ProcessGroupCollection


def _print(lines: list[str]) -> None:
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def run_lines(args, pgc: ProcessGroupCollection) -> list[str]:
    """The arguments, notes, layout and batch lines of the summary."""
    lines = ["------------------------ arguments (differing from the defaults) ------------------------"]
    shown = [
        f"  {flag}" if value is True else f"  {flag} {value}" for flag, value in sorted(args.non_default_args.items())
    ]
    lines += shown or ["  (none)"]
    lines += [f"  note: {note}" for note in args.compatibility_notes]
    layout = pgc.layout
    lines.append(
        f"> layout: world {layout.world_size} = TP {layout.tp} x GTP {layout.gtp} x CP {layout.cp} x "
        f"DP {layout.dp} x PP {layout.pp} (order {layout.order}); data-parallel width {args.data_parallel_width}; "
        f"experts EP {layout.ep} x ETP {layout.etp} x expert-DP {layout.expert_dp}"
    )
    tokens = args.global_batch_size * args.seq_length
    lines.append(
        f"> tokens per step: {tokens} = global batch {args.global_batch_size} x sequence {args.seq_length} "
        f"({args.num_microbatches} micro-batches of {args.micro_batch_size} per data rank); "
        f"{args.train_iters} iterations = {args.batch_schedule.samples(args.train_iters)} samples"
    )
    if not args.batch_schedule.is_constant:
        lines.append(f"> global batch schedule: {args.batch_schedule.describe()}")
    if (args.eval_global_batch_size, args.eval_micro_batch_size) != (args.global_batch_size, args.micro_batch_size):
        lines.append(
            f"> evaluation step: global batch {args.eval_global_batch_size} ({args.eval_num_microbatches} "
            f"micro-batches of {args.eval_micro_batch_size} per data rank)"
        )
    return lines


def print_run(args, pgc: ProcessGroupCollection) -> None:
    _print(run_lines(args, pgc))


def parameter_counts_per_stage(model: torch.nn.Module, pgc: ProcessGroupCollection, device) -> list[int]:
    """Parameters of each pipeline stage's model (full sizes: TP and GTP shards counted once,
    vocabulary rows without padding, the output layer tied to the first stage's embedding
    counted there), the same under every layout. Collective."""
    coordinates = pgc.layout.coordinates(dist.get_rank())
    counts = torch.zeros(pgc.layout.pp, dtype=torch.float64, device=device)
    if all(coordinates[axis] == 0 for axis in ("tp", "gtp", "cp", "dp")):
        first_stage = coordinates["pp"] == 0
        true_rows = vocab_rows(model)
        total = 0
        for param in model.parameters():
            if first_stage or not getattr(param, "shared_embedding", False):
                shape = list(getattr(param, "global_shape", param.shape))
                shape[0] = true_rows.get(id(param), shape[0])
                total += math.prod(shape)
        counts[coordinates["pp"]] = total
    dist.all_reduce(counts)
    return [int(c) for c in counts.tolist()]


def model_lines(args, counts: list[int]) -> list[str]:
    stages = ", ".join(f"stage {i}: {_human(c)}" for i, c in enumerate(counts))
    return [f"> parameters: {stages}; total {_human(sum(counts))} ({sum(counts):,})"]


def print_model(args, counts: list[int]) -> None:
    _print(model_lines(args, counts))


def dataset_lines(datasets: dict) -> list[str]:
    lines = ["> datasets:"]
    for name, dataset in datasets.items():
        described = "none" if dataset is None else getattr(dataset, "describe", lambda d=dataset: f"{len(d)} samples")()
        lines.append(f"    {name}: {described}")
    return lines


def print_datasets(datasets: dict) -> None:
    _print(dataset_lines(datasets))
