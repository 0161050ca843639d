"""Everything a checkpoint holds, read back whole (every tensor, every object cell, the common
state), for tests that compare two checkpoints or a checkpoint with another reader."""

from __future__ import annotations

import itertools

import torch

from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, load, read_metadata


def everything_in(checkpoint_dir: str) -> dict:
    """``{"tensors": {key: tensor}, "objects": {(key, cell): value}, "common": {...}}``."""
    metadata = read_metadata(checkpoint_dir)
    request = {
        f"t{i}": ShardedTensor(
            key, None, getattr(torch, t.dtype), t.global_shape, t.global_shape, (0,) * len(t.global_shape), None
        )
        for i, (key, t) in enumerate(sorted(metadata.tensors.items()))
    }
    cells = [(key, cell, grid.global_shape) for key, grid in sorted(metadata.objects.items()) for cell in grid.cells]
    request |= {f"o{i}": ShardedObject(key, None, shape, cell) for i, (key, cell, shape) in enumerate(cells)}
    loaded = load(request, checkpoint_dir)
    tensors = {request[name].key: value for name, value in loaded.items() if name in request and name[0] == "t"}
    objects = {
        (request[name].key, request[name].global_offset): value
        for name, value in loaded.items()
        if name in request and name[0] == "o"
    }
    common = {name: value for name, value in loaded.items() if name not in request}
    return {"tensors": tensors, "objects": objects, "common": common}


def assert_same_contents(a: dict, b: dict) -> None:
    """Bit-identical tensors, equal objects (tensors inside compared exactly) and common state."""
    assert a["tensors"].keys() == b["tensors"].keys()
    for key in a["tensors"]:
        assert torch.equal(a["tensors"][key], b["tensors"][key]), f"tensor {key} differs"
    assert a["objects"].keys() == b["objects"].keys()
    for key in a["objects"]:
        _assert_same_value(a["objects"][key], b["objects"][key], str(key))
    _assert_same_value(a["common"], b["common"], "common state")


def _assert_same_value(x, y, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f"{where} differs"
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), f"{where}: keys differ"
        for k in x:
            _assert_same_value(x[k], y[k], f"{where}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y), f"{where}: lengths differ"
        for i, (u, v) in enumerate(itertools.zip_longest(x, y)):
            _assert_same_value(u, v, f"{where}[{i}]")
    elif hasattr(x, "shape") and hasattr(x, "dtype"):  # numpy arrays
        assert x.dtype == y.dtype and (x == y).all(), f"{where} differs"
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"
