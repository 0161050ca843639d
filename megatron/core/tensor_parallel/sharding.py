"""How a parallel layer's parameters are cut from their full tensors, and glued back.

Every parameter built by the parallel layers carries these attributes, the single source of
sharding truth for initialization, DDP, grad clipping, optimizers and checkpointing:

``tensor_model_parallel`` (bool), ``partition_dim`` (0/1, -1 when not TP-sharded),
``partition_sizes`` (global packed part sizes along ``partition_dim`` or None),
``gtp_sharded`` (bool: dim 0 of the TP-local tensor is sharded over ``gtp``, only when G > 1),
``gtp_rows`` (true unpadded TP-local rows), ``global_shape`` (true unpadded full shape),
``sequence_parallel`` (bool: gradient needs a TP all-reduce under sequence parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.tensor_parallel import gtp as gtp_ops
from megatron.core.tensor_parallel.collectives import all_gather_along_dim
from megatron.core.tensor_parallel.utils import TensorParallelError, divide, pack_tp_slice, unpack_tp_gathered

PARALLEL_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_sizes",
    "gtp_sharded",
    "gtp_rows",
    "global_shape",
    "sequence_parallel",
)


def set_parallel_attributes(
    param: torch.Tensor,
    *,
    tensor_model_parallel: bool,
    partition_dim: int,
    global_shape: Sequence[int],
    partition_sizes: Sequence[int] | None = None,
    gtp_sharded: bool = False,
    gtp_rows: int | None = None,
    sequence_parallel: bool = False,
) -> None:
    """Attach the sharding attributes (see module docstring) to ``param``."""
    param.tensor_model_parallel = tensor_model_parallel
    param.partition_dim = partition_dim if tensor_model_parallel else -1
    param.partition_sizes = list(partition_sizes) if partition_sizes else None
    param.gtp_sharded = gtp_sharded
    param.gtp_rows = gtp_rows if gtp_rows is not None else param.shape[0]
    param.global_shape = tuple(global_shape)
    param.sequence_parallel = sequence_parallel


def tp_local_shape(global_shape: Sequence[int], partition_dim: int, tp_size: int) -> tuple[int, ...]:
    """Shape of one TP rank's slice of a tensor split on ``partition_dim`` (-1: not split)."""
    shape = list(global_shape)
    if partition_dim >= 0:
        shape[partition_dim] = divide(
            shape[partition_dim], tp_size, f"dimension {partition_dim} of shape {tuple(global_shape)}"
        )
    return tuple(shape)


def create_parallel_parameter(
    config,
    global_shape: Sequence[int],
    init_method: Callable[[torch.Tensor], object] | None,
    pg_collection,
    *,
    partition_dim: int,
    partition_sizes: Sequence[int] | None = None,
    gtp_shard: bool = False,
    sequence_parallel: bool = False,
) -> torch.nn.Parameter:
    """Build this rank's slice of a parameter of ``global_shape`` and tag it.

    With ``config.layout_invariant_init`` the full master tensor is built on CPU in fp32 with the
    current CPU RNG (see ``init_rng_scope``), ``init_method`` fills it in place, and this rank keeps
    its TP slice (packed parts split separately) and then, when ``gtp_shard`` and G > 1, its GTP
    rows. Without it only the TP-local tensor is built and initialized. ``init_method=None``
    means zeros (biases); ``config.perform_initialization=False`` skips initialization (zeros).
    """
    tp_size, tp_rank = pg_collection.size("tp"), pg_collection.rank("tp")
    gtp_size, gtp_rank = pg_collection.size("gtp"), pg_collection.rank("gtp")
    do_init = init_method is not None and config.perform_initialization
    if do_init and config.layout_invariant_init:
        master = torch.empty(tuple(global_shape), dtype=torch.float32)
        init_method(master)
        local = (
            pack_tp_slice(master, partition_dim, partition_sizes, tp_rank, tp_size) if partition_dim >= 0 else master
        )
    else:
        if partition_sizes and partition_dim >= 0:
            for size in partition_sizes:
                divide(size, tp_size, "packed partition size")
        local = torch.zeros(tp_local_shape(global_shape, partition_dim, tp_size), dtype=torch.float32)
        if do_init:
            init_method(local)
    rows = local.shape[0]
    sharded = gtp_shard and gtp_size > 1
    if sharded:
        local = gtp_ops.shard_weight(local, gtp_size, gtp_rank)
    param = torch.nn.Parameter(local.to(config.params_dtype).contiguous())
    set_parallel_attributes(
        param,
        tensor_model_parallel=partition_dim >= 0,
        partition_dim=partition_dim,
        global_shape=global_shape,
        partition_sizes=partition_sizes,
        gtp_sharded=sharded,
        gtp_rows=rows,
        sequence_parallel=sequence_parallel,
    )
    return param


def gather_full_tensor(local: torch.Tensor, param: torch.Tensor, pg_collection) -> torch.Tensor:
    """Reassemble the full tensor of which ``local`` is this rank's piece, laid out like ``param``
    (``param``'s attributes say how it is sharded): gather GTP rows and strip the padding, then
    gather TP along ``partition_dim`` and undo the packing of parts. A collective over gtp and tp."""
    full = local.detach()
    if getattr(param, "gtp_sharded", False):
        full = all_gather_along_dim(full, 0, pg_collection.gtp)[: param.gtp_rows]
    if getattr(param, "tensor_model_parallel", False) and pg_collection.size("tp") > 1:
        dim = param.partition_dim
        full = all_gather_along_dim(full, dim, pg_collection.tp)
        full = unpack_tp_gathered(full, dim, param.partition_sizes, pg_collection.size("tp"))
    if tuple(full.shape) != tuple(getattr(param, "global_shape", full.shape)):
        raise TensorParallelError(
            f"gathered shape {tuple(full.shape)} differs from the parameter's global_shape {param.global_shape}"
        )
    return full


def gather_full_parameter(param: torch.Tensor, pg_collection=None) -> torch.Tensor:
    """The full (unsharded, unpadded, unpacked) value of a parallel parameter."""
    return gather_full_tensor(param, param, resolve_pg_collection(pg_collection))


def gather_full_grad(param: torch.Tensor, pg_collection=None) -> torch.Tensor:
    """The full gradient of a parallel parameter (``main_grad`` when DDP keeps one, else ``grad``)."""
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    if grad is None:
        raise TensorParallelError("parameter has no gradient (neither main_grad nor grad is set)")
    return gather_full_tensor(grad, param, resolve_pg_collection(pg_collection))
