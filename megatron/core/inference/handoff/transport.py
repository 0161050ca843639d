"""Moving KV blocks and Mamba state between engines: one interface, two implementations.

The decode side *pulls*: :meth:`HandoffTransport.post_pull` starts reading a list of
:class:`~megatron.core.inference.handoff.plan.Segment` runs from a peer's registered regions
into this side's registered regions and returns a :class:`PullHandle`; :meth:`~HandoffTransport.poll`
reports ``pending``, ``done`` or ``failed``; :meth:`~HandoffTransport.release` frees the handle
once it is not pending. A side first :meth:`~HandoffTransport.register` s its cache tensors
(``kv``, ``conv``, ``ssm``) and :meth:`~HandoffTransport.export` s a msgpack-able descriptor
that peers put in their handoff records.

* :class:`NixlTransport` — NIXL one-sided READs (UCX backend; CPU memory, or GPU memory when
  the regions live on a GPU). The source does nothing per transfer, so it cannot know whether
  a read is in flight: :meth:`~HandoffTransport.may_still_read` is always True there.
* :class:`TorchDistributedTransport` — ``torch.distributed`` send/recv: the puller sends the
  list of runs, the source packs and sends them (from :meth:`~HandoffTransport.serve`, called
  from its loop), the puller unpacks. The source knows its in-flight reads exactly and refuses
  pulls of transfers it no longer serves.
"""

from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgpack
import torch
import torch.distributed as dist

from megatron.core.inference.handoff.plan import Segment


class TransportError(ValueError):
    """A pull the transport cannot start (bad peer descriptor, run out of bounds, refused)."""


class TransferState(str, enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class PullHandle:
    """One posted pull. ``nbytes`` / ``num_descriptors`` are counted from the runs given to
    the transport; ``seconds`` is set when it ends."""

    transfer_id: str
    nbytes: int
    num_descriptors: int
    impl: Any
    state: TransferState = TransferState.PENDING
    error: str | None = None
    posted_at: float = field(default_factory=time.perf_counter)
    seconds: float | None = None

    def _end(self, state: TransferState, error: str | None = None) -> TransferState:
        if self.state is TransferState.PENDING:
            self.state, self.error = state, error
            self.seconds = time.perf_counter() - self.posted_at
        return self.state


class HandoffTransport(abc.ABC):
    """See module doc. ``name`` appears in error messages."""

    name = "transport"

    def __init__(self):
        self.regions: dict[str, torch.Tensor] = {}
        self.num_posted = 0
        self.num_done = 0
        self.num_failed = 0
        # Source side: whether a transfer id is still served (set by the prefill side, so that
        # pulls of released or abandoned pins are refused where the transport can refuse).
        self.is_servable: Callable[[str], bool] = lambda transfer_id: True

    def register(self, regions: dict[str, torch.Tensor]) -> None:
        """Make contiguous cache tensors readable (source) and writable (puller)."""
        for region, tensor in regions.items():
            if not tensor.is_contiguous():
                raise TransportError(f"region {region!r} must be a contiguous tensor")
            self.regions[region] = tensor

    @abc.abstractmethod
    def export(self) -> dict[str, Any]:
        """A msgpack-able descriptor that lets a peer pull from this side's regions."""

    @abc.abstractmethod
    def post_pull(self, transfer_id: str, peer: dict[str, Any], segments: Sequence[Segment]) -> PullHandle:
        """Start reading ``segments`` from ``peer``; raises :class:`TransportError` when it
        cannot start (then nothing was, or will be, written)."""

    @abc.abstractmethod
    def poll(self, handle: PullHandle) -> TransferState:
        """Progress and report a pull."""

    @abc.abstractmethod
    def release(self, handle: PullHandle) -> None:
        """Free a pull that is no longer pending."""

    def serve(self) -> None:
        """Source-side progress (called from the source's loop); nothing for one-sided transports."""

    def may_still_read(self, transfer_id: str) -> bool:
        """Source side: whether a peer may still be reading the storage of ``transfer_id``."""
        return True

    def close(self) -> None:
        """Deregister regions and drop connections."""

    def _check_bounds(self, regions: dict[str, int], segments: Sequence[Segment], side: str) -> None:
        for seg in segments:
            region, offset = (seg.src_region, seg.src_offset) if side == "source" else (seg.dst_region, seg.dst_offset)
            size = regions.get(region)
            if size is None or offset < 0 or offset + seg.nbytes > size:
                raise TransportError(f"{side} run {seg} is outside region {region!r} ({size} bytes); "
                                     f"runs must lie inside the registered regions {sorted(regions)}")

    def _count(self, state: TransferState) -> TransferState:
        self.num_done += state is TransferState.DONE
        self.num_failed += state is TransferState.FAILED
        return state


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class NixlTransport(HandoffTransport):
    """NIXL READs over UCX (see module doc). On CPU hosts without an RDMA device, set
    ``UCX_NET_DEVICES=lo`` in the environment before creating it."""

    name = "nixl"

    def __init__(self, agent_name: str, backends: Sequence[str] = ("UCX",)):
        super().__init__()
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent_name = agent_name
        self.agent = nixl_agent(agent_name, nixl_agent_config(backends=list(backends)))
        self._registrations = []
        self._remote_agents: dict[str, str] = {}

    @staticmethod
    def _device_id(tensor: torch.Tensor) -> int:
        return max(tensor.get_device(), 0)

    @staticmethod
    def _mem_type(tensor: torch.Tensor) -> str:
        return "VRAM" if tensor.is_cuda else "DRAM"

    def register(self, regions: dict[str, torch.Tensor]) -> None:
        super().register(regions)
        for tensor in regions.values():
            self._registrations.append(self.agent.register_memory(tensor))

    def export(self) -> dict[str, Any]:
        return {
            "transport": self.name, "agent": self.agent_name, "metadata": self.agent.get_agent_metadata(),
            "regions": {name: [t.data_ptr(), t.numel() * t.element_size(), self._device_id(t), self._mem_type(t)]
                        for name, t in self.regions.items()},
        }

    def _remote(self, peer: dict[str, Any]) -> str:
        if peer.get("transport") != self.name:
            raise TransportError(f"peer descriptor is for {peer.get('transport')!r}, this transport is {self.name!r}")
        agent = peer["agent"]
        if agent not in self._remote_agents:
            self._remote_agents[agent] = self.agent.add_remote_agent(peer["metadata"])
        return self._remote_agents[agent]

    def post_pull(self, transfer_id: str, peer: dict[str, Any], segments: Sequence[Segment]) -> PullHandle:
        if not segments:
            raise TransportError(f"pull {transfer_id!r} has no runs")
        remote_name = self._remote(peer)
        remote = {name: entry for name, entry in peer["regions"].items()}
        self._check_bounds({n: e[1] for n, e in remote.items()}, segments, "source")
        local = {n: t.numel() * t.element_size() for n, t in self.regions.items()}
        self._check_bounds(local, segments, "destination")
        mem_types = {remote[s.src_region][3] for s in segments}, {self._mem_type(self.regions[s.dst_region])
                                                                  for s in segments}
        if len(mem_types[0]) != 1 or len(mem_types[1]) != 1:
            raise TransportError("one pull must read one memory type and write one memory type")
        local_descs = self.agent.get_xfer_descs(
            [(self.regions[s.dst_region].data_ptr() + s.dst_offset, s.nbytes,
              self._device_id(self.regions[s.dst_region])) for s in segments], mem_types[1].pop())
        remote_descs = self.agent.get_xfer_descs(
            [(remote[s.src_region][0] + s.src_offset, s.nbytes, remote[s.src_region][2]) for s in segments],
            mem_types[0].pop())
        try:
            xfer = self.agent.initialize_xfer("READ", local_descs, remote_descs, remote_name)
        except Exception as exc:  # NIXL raises its own binding error types
            raise TransportError(f"NIXL refused the transfer: {exc}") from exc
        status = self.agent.transfer(xfer)
        if status == "ERR":
            self.agent.release_xfer_handle(xfer)
            raise TransportError("NIXL failed to post the transfer")
        self.num_posted += 1
        return PullHandle(transfer_id, sum(s.nbytes for s in segments), len(segments), xfer)

    def poll(self, handle: PullHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        status = self.agent.check_xfer_state(handle.impl)
        if status == "DONE":
            return self._count(handle._end(TransferState.DONE))
        if status == "ERR":
            return self._count(handle._end(TransferState.FAILED, "NIXL reported the transfer failed"))
        return TransferState.PENDING

    def release(self, handle: PullHandle) -> None:
        if handle.impl is not None:
            self.agent.release_xfer_handle(handle.impl)
            handle.impl = None

    def close(self) -> None:
        for registration in self._registrations:
            self.agent.deregister_memory(registration)
        self._registrations.clear()
        for agent in self._remote_agents.values():
            self.agent.remove_remote_agent(agent)
        self._remote_agents.clear()


_TAG_SIZE, _TAG_REQUEST, _TAG_STATUS, _TAG_PAYLOAD = 7101, 7102, 7103, 7104


class TorchDistributedTransport(HandoffTransport):
    """Pulls over ``torch.distributed`` point-to-point (see module doc).

    Args:
        group: process group holding both sides (default: the world).
        clients: on a source, the ranks (global) that may pull from it.

    Pulls of transfer ids that :attr:`is_servable` rejects are refused (the pull fails).
    """

    name = "torch.distributed"

    def __init__(self, group: dist.ProcessGroup | None = None, clients: Sequence[int] = ()):
        super().__init__()
        self.group = group
        self.clients = list(clients)
        self._size_recvs: dict[int, tuple[torch.Tensor, Any]] = {}
        self._sends: list[tuple[str, list]] = []

    @property
    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def export(self) -> dict[str, Any]:
        return {"transport": self.name, "rank": dist.get_rank(),
                "regions": {n: t.numel() * t.element_size() for n, t in self.regions.items()}}

    def post_pull(self, transfer_id: str, peer: dict[str, Any], segments: Sequence[Segment]) -> PullHandle:
        if peer.get("transport") != self.name:
            raise TransportError(f"peer descriptor is for {peer.get('transport')!r}, this transport is {self.name!r}")
        if not segments:
            raise TransportError(f"pull {transfer_id!r} has no runs")
        self._check_bounds(peer["regions"], segments, "source")
        self._check_bounds({n: t.numel() * t.element_size() for n, t in self.regions.items()}, segments,
                           "destination")
        source, device = int(peer["rank"]), self._device
        request = msgpack.packb({"id": transfer_id, "runs": [[s.src_region, s.src_offset, s.nbytes] for s in segments]})
        body = torch.frombuffer(bytearray(request), dtype=torch.uint8).to(device)
        nbytes = sum(s.nbytes for s in segments)
        status = torch.zeros(1, dtype=torch.int64, device=device)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        size = torch.tensor([body.numel()], dtype=torch.int64, device=device)
        works = [
            dist.isend(size, source, self.group, tag=_TAG_SIZE),
            dist.isend(body, source, self.group, tag=_TAG_REQUEST),
            dist.irecv(status, source, self.group, tag=_TAG_STATUS),
            dist.irecv(payload, source, self.group, tag=_TAG_PAYLOAD),
        ]
        self.num_posted += 1
        # The sent tensors stay referenced by the handle until it is released.
        return PullHandle(transfer_id, nbytes, len(segments), (works, status, payload, list(segments), size, body))

    def poll(self, handle: PullHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        works, status, payload, segments = handle.impl[:4]
        if not all(work.is_completed() for work in works):
            return TransferState.PENDING
        if int(status.item()) != 0:
            return self._count(handle._end(TransferState.FAILED, "the source refused the pull (no live pin)"))
        position = 0
        for seg in segments:
            _byte_view(self.regions[seg.dst_region])[seg.dst_offset:seg.dst_offset + seg.nbytes].copy_(
                payload[position:position + seg.nbytes])
            position += seg.nbytes
        return self._count(handle._end(TransferState.DONE))

    def release(self, handle: PullHandle) -> None:
        if handle.state is TransferState.PENDING:
            raise TransportError(f"pull {handle.transfer_id!r} is still pending; poll it until it ends")
        handle.impl = None

    def serve(self) -> None:
        """Answer the pulls that arrived (non-blocking when none did)."""
        device = self._device
        self._sends = [(tid, works) for tid, works in self._sends if not all(w.is_completed() for w in works[:2])]
        for client in self.clients:
            if client not in self._size_recvs:
                size = torch.zeros(1, dtype=torch.int64, device=device)
                self._size_recvs[client] = (size, dist.irecv(size, client, self.group, tag=_TAG_SIZE))
            size, work = self._size_recvs[client]
            if not work.is_completed():
                continue
            del self._size_recvs[client]
            body = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
            dist.recv(body, client, self.group, tag=_TAG_REQUEST)
            request = msgpack.unpackb(body.cpu().numpy().tobytes())
            runs = request["runs"]
            ok = self.is_servable(request["id"]) and all(
                region in self.regions and 0 <= offset and offset + n <= self.regions[region].numel()
                * self.regions[region].element_size() for region, offset, n in runs)
            total = sum(n for _, _, n in runs)
            if ok:
                payload = torch.cat([_byte_view(self.regions[region])[offset:offset + n] for region, offset, n in runs])
            else:
                payload = torch.zeros(total, dtype=torch.uint8, device=device)
            status = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
            works = [dist.isend(status, client, self.group, tag=_TAG_STATUS),
                     dist.isend(payload, client, self.group, tag=_TAG_PAYLOAD)]
            self._sends.append((request["id"], works + [status, payload]))

    def may_still_read(self, transfer_id: str) -> bool:
        self.serve()
        return any(tid == transfer_id for tid, _ in self._sends)
