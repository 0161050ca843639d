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
* :class:`TorchDistributedTransport` — ``torch.distributed`` send/recv: the puller asks for
  a list of runs (through a shared store), the source packs and sends them (from
  :meth:`~HandoffTransport.serve`, called from its loop), the puller unpacks. The source knows
  its in-flight reads exactly and refuses pulls of transfers it no longer serves.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from megatron.core.errors import MegatronRuntimeError
from megatron.core.inference.handoff.plan import Segment


class TransportError(MegatronRuntimeError):
    """A pull the transport cannot start (bad peer descriptor, run out of bounds, refused)."""


class TransferState(enum.StrEnum):
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

    def serve(self) -> None:  # noqa: B027 - optional hook, a no-op for one-sided transports
        """Source-side progress (called from the source's loop); nothing for one-sided transports."""

    def may_still_read(self, transfer_id: str) -> bool:
        """Source side: whether a peer may still be reading the storage of ``transfer_id``."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook: transports without connections keep it
        """Deregister regions and drop connections."""

    def _check_bounds(self, regions: dict[str, int], segments: Sequence[Segment], side: str) -> None:
        for seg in segments:
            region, offset = (seg.src_region, seg.src_offset) if side == "source" else (seg.dst_region, seg.dst_offset)
            size = regions.get(region)
            if size is None or offset < 0 or offset + seg.nbytes > size:
                raise TransportError(
                    f"{side} run {seg} is outside region {region!r} ({size} bytes); "
                    f"runs must lie inside the registered regions {sorted(regions)}"
                )

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
            "transport": self.name,
            "agent": self.agent_name,
            "metadata": self.agent.get_agent_metadata(),
            "regions": {
                name: [t.data_ptr(), t.numel() * t.element_size(), self._device_id(t), self._mem_type(t)]
                for name, t in self.regions.items()
            },
        }

    def connect(self, peer: dict[str, Any]) -> str:
        """The NIXL name of a peer, loading its metadata the first time."""
        if peer.get("transport") != self.name:
            raise TransportError(f"peer descriptor is for {peer.get('transport')!r}, this transport is {self.name!r}")
        agent = peer["agent"]
        if agent not in self._remote_agents:
            self._remote_agents[agent] = self.agent.add_remote_agent(peer["metadata"])
        return self._remote_agents[agent]

    def post_pull(self, transfer_id: str, peer: dict[str, Any], segments: Sequence[Segment]) -> PullHandle:
        if not segments:
            raise TransportError(f"pull {transfer_id!r} has no runs")
        remote_name = self.connect(peer)
        remote = {name: entry for name, entry in peer["regions"].items()}
        self._check_bounds({n: e[1] for n, e in remote.items()}, segments, "source")
        local = {n: t.numel() * t.element_size() for n, t in self.regions.items()}
        self._check_bounds(local, segments, "destination")
        mem_types = (
            {remote[s.src_region][3] for s in segments},
            {self._mem_type(self.regions[s.dst_region]) for s in segments},
        )
        if len(mem_types[0]) != 1 or len(mem_types[1]) != 1:
            raise TransportError("one pull must read one memory type and write one memory type")
        local_descs = self.agent.get_xfer_descs(
            [
                (
                    self.regions[s.dst_region].data_ptr() + s.dst_offset,
                    s.nbytes,
                    self._device_id(self.regions[s.dst_region]),
                )
                for s in segments
            ],
            mem_types[1].pop(),
        )
        remote_descs = self.agent.get_xfer_descs(
            [(remote[s.src_region][0] + s.src_offset, s.nbytes, remote[s.src_region][2]) for s in segments],
            mem_types[0].pop(),
        )
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


_TAG_STATUS, _TAG_PAYLOAD = 7103, 7104


def shared_store(group: dist.ProcessGroup | None = None, host: str = "127.0.0.1") -> dist.Store:
    """A key-value store every rank of ``group`` reaches (collective): rank 0 of the group
    hosts a TCPStore on a free port and shares the port."""
    is_host = dist.get_rank(group) == 0
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if is_host else None
    box = [store.port if is_host else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if store is None:
        store = dist.TCPStore(host, box[0], is_master=False, wait_for_workers=False)
    return dist.PrefixStore("handoff/", store)


class TorchDistributedTransport(HandoffTransport):
    """Pulls over ``torch.distributed`` point-to-point (see module doc).

    Pull requests and completions travel through ``store`` (whose ``check`` never blocks,
    unlike a gloo receive); the bytes travel as one send per pull from source to puller.
    The puller posts its receives before asking, so the source's sends complete at once.

    Args:
        store: a store shared by both sides (see :func:`shared_store`).
        group: process group holding both sides (default: the world).
        clients: on a source, the ranks (global) that may pull from it.

    Pulls of transfer ids that :attr:`is_servable` rejects are refused (the pull fails).
    """

    name = "torch.distributed"

    def __init__(self, store: dist.Store, group: dist.ProcessGroup | None = None, clients: Sequence[int] = ()):
        super().__init__()
        self.store = store
        self.group = group
        self._next_pull = {int(client): 0 for client in clients}  # source side: next sequence per client
        self._sequence = 0  # puller side

    @property
    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def export(self) -> dict[str, Any]:
        return {
            "transport": self.name,
            "rank": dist.get_rank(),
            "regions": {n: t.numel() * t.element_size() for n, t in self.regions.items()},
        }

    def post_pull(self, transfer_id: str, peer: dict[str, Any], segments: Sequence[Segment]) -> PullHandle:
        if peer.get("transport") != self.name:
            raise TransportError(f"peer descriptor is for {peer.get('transport')!r}, this transport is {self.name!r}")
        if not segments:
            raise TransportError(f"pull {transfer_id!r} has no runs")
        self._check_bounds(peer["regions"], segments, "source")
        self._check_bounds({n: t.numel() * t.element_size() for n, t in self.regions.items()}, segments, "destination")
        source, device, me = int(peer["rank"]), self._device, dist.get_rank()
        nbytes = sum(s.nbytes for s in segments)
        status = torch.zeros(1, dtype=torch.int64, device=device)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        works = [
            dist.irecv(status, source, self.group, tag=_TAG_STATUS),
            dist.irecv(payload, source, self.group, tag=_TAG_PAYLOAD),
        ]
        key = f"{source}/{me}/{self._sequence}"
        self._sequence += 1
        self.store.set(
            f"pull/{key}",
            msgpack.packb({"id": transfer_id, "runs": [[s.src_region, s.src_offset, s.nbytes] for s in segments]}),
        )
        self.num_posted += 1
        return PullHandle(transfer_id, nbytes, len(segments), (works, status, payload, list(segments), f"done/{key}"))

    def poll(self, handle: PullHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        works, status, payload, segments, done_key = handle.impl
        if not self.store.check([done_key]):
            return TransferState.PENDING
        for work in works:
            work.wait()
        self.store.delete_key(done_key)
        if int(status.item()) != 0:
            return self._count(handle._end(TransferState.FAILED, "the source refused the pull (no live pin)"))
        position = 0
        for seg in segments:
            _byte_view(self.regions[seg.dst_region])[seg.dst_offset : seg.dst_offset + seg.nbytes].copy_(
                payload[position : position + seg.nbytes]
            )
            position += seg.nbytes
        return self._count(handle._end(TransferState.DONE))

    def release(self, handle: PullHandle) -> None:
        if handle.state is TransferState.PENDING:
            raise TransportError(f"pull {handle.transfer_id!r} is still pending; poll it until it ends")
        handle.impl = None

    def serve(self) -> None:
        """Answer every pull that was asked for (returns at once when none was)."""
        me, device = dist.get_rank(), self._device
        for client, sequence in self._next_pull.items():
            key = f"{me}/{client}/{sequence}"
            while self.store.check([f"pull/{key}"]):
                request = msgpack.unpackb(self.store.get(f"pull/{key}"))
                self.store.delete_key(f"pull/{key}")
                runs = request["runs"]
                ok = self.is_servable(request["id"]) and all(
                    region in self.regions
                    and 0 <= offset
                    and offset + n <= self.regions[region].numel() * self.regions[region].element_size()
                    for region, offset, n in runs
                )
                if ok:
                    payload = torch.cat([_byte_view(self.regions[r])[offset : offset + n] for r, offset, n in runs])
                else:
                    payload = torch.zeros(sum(n for _, _, n in runs), dtype=torch.uint8, device=device)
                status = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
                for work in (
                    dist.isend(status, client, self.group, tag=_TAG_STATUS),
                    dist.isend(payload, client, self.group, tag=_TAG_PAYLOAD),
                ):
                    work.wait()  # the puller posted its receives before asking
                self.store.set(f"done/{key}", b"1")
                sequence += 1
                self._next_pull[client] = sequence
                key = f"{me}/{client}/{sequence}"

    def may_still_read(self, transfer_id: str) -> bool:
        """Pulls are answered whole inside :meth:`serve`; once it returns none is in flight,
        and later ones of a released pin are refused."""
        self.serve()
        return False
