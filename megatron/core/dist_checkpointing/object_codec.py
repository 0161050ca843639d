"""Pickle-free serialization of checkpoint objects (ShardedObject data, common state).

Layout: ``MCKO`` magic, an 8-byte little-endian header length, a UTF-8 JSON header, then the
raw bytes of every tensor / array. The header holds the value tree, in which every container
and every binary value is a one-key tagged dict, so decoding is exact (tuples stay tuples, int
dict keys stay ints) and never executes anything. Accepted: None, bool, int, float, str, list,
tuple, dict (keys of the scalar types), bytes, torch tensors (dense, any dtype) and numpy arrays
without object dtype.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch

from megatron.core.dist_checkpointing.errors import CheckpointingError, CorruptCheckpointError

MAGIC = b"MCKO"
_HEADER = struct.Struct("<Q")
_SCALARS = (type(None), bool, int, float, str)
ACCEPTED = "None, bool, int, float, str, list, tuple, dict (scalar keys), bytes, torch.Tensor, numpy.ndarray"


class _Encoder:
    def __init__(self):
        self.blobs: list[bytes] = []
        self.specs: list[dict] = []

    def _blob(self, raw: bytes, spec: dict) -> int:
        offset = sum(len(b) for b in self.blobs)
        self.blobs.append(raw)
        self.specs.append(dict(spec, offset=offset, nbytes=len(raw)))
        return len(self.specs) - 1

    def encode(self, value, where: str):
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, (list, tuple)):
            tag = "list" if isinstance(value, list) else "tuple"
            return {tag: [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            items = []
            for k, v in value.items():
                if not isinstance(k, _SCALARS):
                    raise CheckpointingError(
                        f"cannot serialize {where}: dict key {k!r} is a {type(k).__name__}; keys must be None, bool, "
                        "int, float or str"
                    )
                items.append([k, self.encode(v, f"{where}[{k!r}]")])
            return {"dict": items}
        if isinstance(value, (bytes, bytearray)):
            return {"bytes": self._blob(bytes(value), {})}
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized:
                raise CheckpointingError(
                    f"cannot serialize {where}: only dense tensors are accepted, got layout {value.layout}"
                )
            tensor = value.detach().cpu().contiguous()
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
            return {
                "tensor": self._blob(
                    raw, {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
                )
            }
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise CheckpointingError(f"cannot serialize {where}: numpy arrays of object dtype are not accepted")
            array = np.ascontiguousarray(value)
            return {"ndarray": self._blob(array.tobytes(), {"dtype": array.dtype.str, "shape": list(array.shape)})}
        raise CheckpointingError(
            f"cannot serialize {where}: type {type(value).__name__} is not accepted; accepted: {ACCEPTED}"
        )


def encode(value, name: str = "object") -> bytes:
    """Serialize ``value`` (see the module docstring for what is accepted)."""
    encoder = _Encoder()
    tree = encoder.encode(value, name)
    header = json.dumps({"tree": tree, "blobs": encoder.specs}, separators=(",", ":")).encode()
    return MAGIC + _HEADER.pack(len(header)) + header + b"".join(encoder.blobs)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown tensor dtype {name!r} in a serialized object")
    return dtype


def decode(data: bytes, name: str = "object"):
    """Inverse of :func:`encode`; raises CorruptCheckpointError on malformed input."""
    view = memoryview(data)
    if bytes(view[:4]) != MAGIC or len(view) < 4 + _HEADER.size:
        raise CorruptCheckpointError(f"{name} is not a serialized checkpoint object (bad magic)")
    (header_len,) = _HEADER.unpack(view[4 : 4 + _HEADER.size])
    body_start = 4 + _HEADER.size + header_len
    try:
        header = json.loads(bytes(view[4 + _HEADER.size : body_start]))
        tree, specs = header["tree"], header["blobs"]
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"{name} has a malformed header: {err}") from err

    def blob(index):
        spec = specs[index]
        start = body_start + spec["offset"]
        raw = view[start : start + spec["nbytes"]]
        if len(raw) != spec["nbytes"]:
            raise CorruptCheckpointError(f"{name} is truncated: blob {index} needs {spec['nbytes']} bytes")
        return spec, raw

    def build(node):
        if not isinstance(node, dict):
            return node
        ((tag, payload),) = node.items()
        if tag == "list":
            return [build(v) for v in payload]
        if tag == "tuple":
            return tuple(build(v) for v in payload)
        if tag == "dict":
            return {k: build(v) for k, v in payload}
        spec, raw = blob(payload)
        if tag == "bytes":
            return bytes(raw)
        if tag == "tensor":
            dtype = _torch_dtype(spec["dtype"])
            if not len(raw):
                return torch.empty(spec["shape"], dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(spec["shape"])
        if tag == "ndarray":
            dtype = np.dtype(spec["dtype"])
            if dtype.hasobject:
                raise CorruptCheckpointError(f"{name} holds a numpy array of object dtype, which is never loaded")
            return np.frombuffer(bytes(raw), dtype=dtype).reshape(spec["shape"]).copy()
        raise CorruptCheckpointError(f"{name} holds an unknown tag {tag!r}")

    try:
        return build(tree)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as err:
        if isinstance(err, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{name} is malformed: {type(err).__name__}: {err}") from err
