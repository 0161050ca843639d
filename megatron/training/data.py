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
    Blend,
    build_blended_gpt_datasets,
    build_builtin_corpus,
    build_mock_gpt_datasets,
)


def builtin_corpus_prefix(args, tokenizer) -> str:
    """The built-in corpus's indexed-dataset prefix, built (rank 0 writes, the others wait)
    or found in the cache."""
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
    """Train, valid and test datasets sized for the run: mock data, the built-in corpus (no
    --data-path, or 'builtin'), or the blends of --data-path / --train-data-path etc."""
    evals = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1  # Megatron's sizes
    num_samples = [
        args.batch_schedule.samples(args.train_iters),
        evals * args.eval_iters * args.eval_global_batch_size,
        args.eval_iters * args.eval_global_batch_size,
    ]
    if args.mock_data:
        return build_mock_gpt_datasets(num_samples, args.seq_length, vocab_size, args.seed)
    blends = args.data_blends or {"all": Blend((BUILTIN_DATA_PATH,))}
    if blends.get("all") == Blend((BUILTIN_DATA_PATH,)):
        blends = {"all": Blend((builtin_corpus_prefix(args, tokenizer),))}
    return build_blended_gpt_datasets(
        blends,
        args.split,
        num_samples,
        args.seq_length,
        args.seed,
        eod_id=tokenizer.eod,
        eod_mask_loss=args.eod_mask_loss,
        cache_dir=args.data_cache_path,
    )


def microbatches(
    dataset, *, start_sample: int, micro_batch_size: int, data_rank: int, data_width: int, device: torch.device
):
    """Endless iterator of this data rank's micro-batches (dicts of [b, s] tensors), starting at
    global sample ``start_sample`` (the consumed-sample count when resuming)."""
    device = torch.device(device)

    def to_device(batch: torch.Tensor) -> torch.Tensor:
        if device.type != "cuda":
            return batch.to(device)
        return batch.pin_memory().to(device, non_blocking=True)  # no wait on the GPU's queue

    index = start_sample
    while True:
        first = index + data_rank * micro_batch_size
        samples = [dataset[(first + j) % len(dataset)] for j in range(micro_batch_size)]
        yield {key: to_device(torch.stack([torch.as_tensor(s[key]) for s in samples])) for key in samples[0]}
        index += micro_batch_size * data_width
