"""Start-up for entry points launched by torchrun: process group, layout, seeds."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fusions import set_fusion_backend
from megatron.core.parallel_state import initialize_distributed
from megatron.core.process_groups import DEFAULT_ORDER, ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_manual_seed


def set_random_seeds(seed: int, pg_collection: ProcessGroupCollection) -> None:
    """Seed Python, numpy and torch; data-parallel ranks share the seed (the data sampler,
    not the RNG, gives them different batches) and pipeline stages differ by an offset. The
    tensor-parallel RNG stream (dropout inside TP-sharded regions) is seeded per TP rank."""
    seed = seed + 100 * pg_collection.rank("pp")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    model_parallel_manual_seed(seed, pg_collection)


# Megatron's --use-tp-pp-dp-mapping: pipeline stages of a replica on neighbouring ranks.
TP_PP_DP_ORDER = "tp-gtp-cp-pp-dp"

# What --deterministic-mode sets unless the environment already does (read by NCCL and cuBLAS
# when they start, so before the process group exists).
DETERMINISTIC_ENV = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def configure_process(args) -> None:
    """What the flags set for the whole process before any process group exists:
    --logging-level, --deterministic-mode and the fused ops that --no-*-fusion flags turn off."""
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)
    if args.deterministic_mode:
        for name, value in DETERMINISTIC_ENV.items():
            os.environ.setdefault(name, value)
        torch.use_deterministic_algorithms(True)
    if args.disabled_fusions:
        set_fusion_backend(disabled_ops=args.disabled_fusions)


def initialize_megatron(args) -> ProcessGroupCollection:
    """Configure the process (:func:`configure_process`), then initialize torch.distributed,
    the world's process groups and the RNGs, from flags."""
    configure_process(args)
    initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    if os.environ.get("OMP_NUM_THREADS") is None and args.distributed_backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    pgc = parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        generalized_tensor_parallel_size=args.generalized_tensor_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        order=TP_PP_DP_ORDER if args.use_tp_pp_dp_mapping else DEFAULT_ORDER,
    )
    set_random_seeds(args.seed, pgc)
    return pgc


def device_for(args) -> torch.device:
    if args.distributed_backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
