"""Datasets and micro-batch iterators for the training loop.

Every rank of the GTP-inclusive data group (``dp_cp_gtp``) reads its own micro-batches: the
global batch of iteration i is samples [i*G, (i+1)*G) (G = global batch size), taken as
consecutive chunks of ``micro_batch_size * data width`` of which data rank r reads the r-th
``micro_batch_size``. Different layouts therefore see the same global batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.datasets import (
    BUILTIN_DATA_PATH,
    build_builtin_corpus,
    build_gpt_datasets,
    build_mock_gpt_datasets,
)


def resolve_data_prefix(args, tokenizer) -> str | None:
    """The indexed-dataset prefix to read; builds the built-in corpus (rank 0 writes, the
    others wait) when --data-path is absent or 'builtin'. None for --mock-data."""
    if args.mock_data:
        return None
    paths = args.data_path or [BUILTIN_DATA_PATH]  # one prefix: checked by validate_args
    if paths[0] != BUILTIN_DATA_PATH:
        return paths[0]
    prefix = None
    if args.data_cache_path:
        prefix = f"{args.data_cache_path}/builtin_{type(tokenizer).__name__}_text_document"
    if dist.get_rank() == 0:
        built = str(build_builtin_corpus(prefix, tokenizer))
    dist.barrier()
    if dist.get_rank() != 0:
        built = str(build_builtin_corpus(prefix, tokenizer))  # cached: only reads the record
    return built


def build_datasets(args, tokenizer, vocab_size: int):
    """Train, valid and test datasets sized for the run."""
    evals = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    num_samples = [
        args.train_iters * args.global_batch_size,
        evals * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]
    prefix = resolve_data_prefix(args, tokenizer)
    if prefix is None:
        return build_mock_gpt_datasets(num_samples, args.seq_length, vocab_size, args.seed)
    return build_gpt_datasets(
        prefix,
        args.split,
        num_samples,
        args.seq_length,
        args.seed,
        eod_id=tokenizer.eod,
        eod_mask_loss=args.eod_mask_loss,
    )


def microbatches(
    dataset, *, start_sample: int, micro_batch_size: int, data_rank: int, data_width: int, device: torch.device
):
    """Endless iterator of this data rank's micro-batches (dicts of [b, s] tensors), starting at
    global sample ``start_sample`` (the consumed-sample count when resuming)."""
    index = start_sample
    while True:
        first = index + data_rank * micro_batch_size
        samples = [dataset[(first + j) % len(dataset)] for j in range(micro_batch_size)]
        yield {key: torch.stack([torch.as_tensor(s[key]) for s in samples]).to(device) for key in samples[0]}
        index += micro_batch_size * data_width
