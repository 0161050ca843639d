"""Global model-parallel state: a thin layer that builds the world's ProcessGroupCollection.

Entry points join the world (:func:`initialize_distributed`) and call
:func:`initialize_model_parallel`; library code takes the collection it returns
(``get_process_group_collection()``) and never reads these globals when a collection was
given to it.
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.core.process_groups import (
    DEFAULT_ORDER,
    ParallelConfigError,
    ProcessGroupCollection,
    RankLayout,
    forget_cached_groups,
)

_LAYOUT: RankLayout | None = None
_COLLECTION: ProcessGroupCollection | None = None


def initialize_distributed(backend: str, timeout_minutes: float = 10.0) -> None:
    """Join torchrun's world (or a world of one without torchrun); a no-op when joined.

    A world of one keeps its rendezvous store in this process: nothing listens on the network."""
    if dist.is_initialized():
        return
    store = None
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        store = dist.HashStore()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(minutes=timeout_minutes)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


def destroy_distributed(timeout_s: float = 60.0) -> None:
    """Leave the world: meet every rank, destroy every group and free its backend, then meet
    once more through the store (for at most ``timeout_s``: a peer may have died) before this
    process exits. A gloo rank that exits while a peer is still closing its groups aborts that
    peer ("terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    dist.barrier()
    store, world_size = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    destroy_model_parallel()
    dist.destroy_process_group()
    gc.collect()  # groups held in reference cycles free their backends (and threads) now
    store.add("megatron/left", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("megatron/left", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.001)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    generalized_tensor_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
    backend: str | None = None,
    timeout=None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ProcessGroupCollection:
    """Create every group of the world's layout on every rank; DP fills the rest.

    The expert groups fold the TP x CP x DP ranks of each pipeline stage into expert-TP
    (``expert_tensor_parallel_size``, default: the TP size) x EP x expert-DP.
    Raises ParallelConfigError (a ValueError) naming the numbers that disagree when the
    world size is not a multiple of the model-parallel product, EP x ETP does not divide
    a stage, a size is < 1, or the order string names an unknown or repeated axis.
    """
    global _LAYOUT, _COLLECTION
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if _COLLECTION is not None:
        raise RuntimeError("model parallel is already initialized: call destroy_model_parallel() first")
    layout = RankLayout.for_world(
        dist.get_world_size(),
        tp=tensor_model_parallel_size,
        gtp=generalized_tensor_parallel_size,
        cp=context_parallel_size,
        pp=pipeline_model_parallel_size,
        order=order,
        ep=expert_model_parallel_size,
        etp=expert_tensor_parallel_size,
    )
    _COLLECTION = ProcessGroupCollection.from_layout(layout, backend=backend, timeout=timeout)
    _LAYOUT = layout
    return _COLLECTION


def model_parallel_is_initialized() -> bool:
    return _COLLECTION is not None


def destroy_model_parallel() -> None:
    """Forget the global layout, collection and cached groups (the groups die with the process
    group)."""
    global _LAYOUT, _COLLECTION
    _LAYOUT = None
    _COLLECTION = None
    forget_cached_groups()


def get_process_group_collection() -> ProcessGroupCollection:
    """The world's collection; raises if :func:`initialize_model_parallel` was not called."""
    if _COLLECTION is None:
        raise RuntimeError("model parallel is not initialized: call initialize_model_parallel() first")
    return _COLLECTION


def get_rank_layout() -> RankLayout:
    get_process_group_collection()
    return _LAYOUT


def resolve_pg_collection(pg_collection: ProcessGroupCollection | None) -> ProcessGroupCollection:
    """The given collection, or the global one when None was given (the only fallback)."""
    return pg_collection if pg_collection is not None else get_process_group_collection()


def _group(name):
    return getattr(get_process_group_collection(), name)


def get_tensor_model_parallel_group():
    return _group("tp")


def get_pipeline_model_parallel_group():
    return _group("pp")


def get_context_parallel_group():
    return _group("cp")


def get_generalized_tensor_parallel_group():
    return _group("gtp")


def get_data_parallel_group(with_context_parallel: bool = False, with_gtp: bool = False):
    if with_gtp:
        return _group("dp_cp_gtp")
    return _group("dp_cp") if with_context_parallel else _group("dp")


def get_expert_model_parallel_group():
    return _group("ep")


def get_expert_tensor_parallel_group():
    return _group("expt_tp")


def get_expert_data_parallel_group():
    return get_process_group_collection().expert_dp_group()


def get_expert_model_parallel_world_size() -> int:
    return get_process_group_collection().size("ep")


def get_expert_model_parallel_rank() -> int:
    return get_process_group_collection().rank("ep")


def get_model_parallel_group():
    return _group("mp")


def get_embedding_group():
    return _group("embd")


def get_position_embedding_group():
    return _group("pos_embd")


def get_tensor_model_parallel_world_size() -> int:
    return get_process_group_collection().size("tp")


def get_tensor_model_parallel_rank() -> int:
    return get_process_group_collection().rank("tp")


def get_pipeline_model_parallel_world_size() -> int:
    return get_process_group_collection().size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return get_process_group_collection().rank("pp")


def get_context_parallel_world_size() -> int:
    return get_process_group_collection().size("cp")


def get_context_parallel_rank() -> int:
    return get_process_group_collection().rank("cp")


def get_generalized_tensor_parallel_world_size() -> int:
    return get_process_group_collection().size("gtp")


def get_generalized_tensor_parallel_rank() -> int:
    return get_process_group_collection().rank("gtp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return get_process_group_collection().size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return get_process_group_collection().rank("dp_cp" if with_context_parallel else "dp")


def is_pipeline_first_stage(pg_collection: ProcessGroupCollection | None = None) -> bool:
    return resolve_pg_collection(pg_collection).rank("pp") == 0


def is_pipeline_last_stage(pg_collection: ProcessGroupCollection | None = None) -> bool:
    pgc = resolve_pg_collection(pg_collection)
    return pgc.rank("pp") == pgc.size("pp") - 1


__all__ = [
    name for name in dir() if name.startswith(("get_", "is_", "initialize", "destroy", "model_parallel", "resolve"))
] + ["ParallelConfigError"]
