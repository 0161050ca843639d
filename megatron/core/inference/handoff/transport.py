"""Moving KV blocks and Mamba state between engines: one interface, two implementations.

The decode side *pulls*: :meth:`HandoffTransport.post_pull` starts reading a list of
:class:`~megatron.core.inference.handoff.plan.Segment` runs from a peer's registered regions
into this side's registered regions and returns a :class:`PullHandle`; :meth:`~HandoffTransport.poll`
reports ``pending``, ``done`` or ``failed`` (a transfer whose peer disconnected has ended:
``failed``); :meth:`~HandoffTransport.release` frees the handle once no write of it can land
(:meth:`~HandoffTransport.may_still_write`). A side first :meth:`~HandoffTransport.register` s
its cache tensors (``kv``, ``conv``, ``ssm``), optionally with each region's *unit* (the bytes
of one KV block, of one Mamba slot row: every run of a handoff is a whole number of them), and
:meth:`~HandoffTransport.export` s a msgpack-able descriptor that peers put in their handoff
records.

Every failure of a transport call, the backend's own exceptions included, is raised as a
:class:`TransportError` (the backend's exception is its ``__cause__``); :class:`PeerGoneError`
when the peer disconnected or died.

* :class:`NixlTransport` — NIXL one-sided READs (UCX backend; CPU memory, or GPU memory when
  the regions live on a GPU). With units on both sides, the descriptor lists (one descriptor per
  unit of every region) are prepared once for this side and once per peer registration, and a
  pull only picks indices from them (NIXL merges adjacent ones back into one descriptor per run).
  A pending read may write the puller's storage at any time. The
  source does nothing per transfer, so it knows no read exactly: it can only tell that every
  peer expected to read from it (:meth:`~HandoffTransport.expect_readers`) is gone, by probing
  each with a tiny read of its own (see :meth:`NixlTransport.may_still_read`). Where the
  ``nixl`` package does not import, creating one raises :class:`NixlUnavailableError`
  (:func:`require_nixl` asks the same before anything starts).
* :class:`TorchDistributedTransport` — ``torch.distributed`` send/recv: the puller asks for
  a list of runs (through a shared store), the source packs and sends them (from
  :meth:`~HandoffTransport.serve`, called from its loop), the puller unpacks inside
  :meth:`~HandoffTransport.poll` (so a pending pull never writes the puller's regions). The
  source knows its in-flight reads exactly and refuses pulls of transfers it no longer serves.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from megatron.core.errors import MegatronConfigError, MegatronRuntimeError
from megatron.core.inference.handoff.plan import Segment

logger = logging.getLogger(__name__)


class TransportError(MegatronRuntimeError):
    """A transport call that failed: a pull it cannot start (bad peer descriptor, run out of
    bounds, refused) or a fault of the backend or the peer (the backend's exception, e.g. one
    of NIXL's, is the ``__cause__``)."""


class PeerGoneError(TransportError):
    """The peer disconnected or died: no transfer with it can run any more."""


class NixlUnavailableError(MegatronConfigError):
    """The NIXL transport was asked for where the ``nixl`` package does not import."""


def require_nixl() -> None:
    """Raise :class:`NixlUnavailableError` unless NIXL's Python API imports here."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        raise NixlUnavailableError(
            f"the NIXL transport needs the nixl package, which does not import here ({exc}); install it "
            "(pip install nixl) or use TorchDistributedTransport"
        ) from exc


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
        self.units: dict[str, int] = {}
        self.num_posted = 0
        self.num_done = 0
        self.num_failed = 0
        self.num_released = 0
        # Source side: whether a transfer id is still served (set by the prefill side, so that
        # pulls of released or abandoned pins are refused where the transport can refuse).
        self.is_servable: Callable[[str], bool] = lambda transfer_id: True

    def register(self, regions: dict[str, torch.Tensor], units: dict[str, int] | None = None) -> None:
        """Make contiguous cache tensors readable (source) and writable (puller). ``units``: per
        region, the bytes every run into or out of it is a whole number of (e.g. one KV block),
        which a transport may prepare its descriptors at; each must divide its region's size."""
        units = units or {}
        for region, tensor in regions.items():
            if not tensor.is_contiguous():
                raise TransportError(f"region {region!r} must be a contiguous tensor")
            unit, nbytes = units.get(region), tensor.numel() * tensor.element_size()
            if unit is not None and (not isinstance(unit, int) or unit <= 0 or nbytes % unit):
                raise TransportError(
                    f"unit {unit!r} of region {region!r} must be a positive divisor of its {nbytes} bytes"
                )
        for region, tensor in regions.items():
            self.regions[region] = tensor
            self.units.pop(region, None)
            if region in units:
                self.units[region] = units[region]

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
        """Free a pull that :meth:`may_still_write` no more (raises :class:`TransportError`
        for one that may)."""

    def may_still_write(self, handle: PullHandle) -> bool:
        """Puller side: whether the pull may still write this side's regions (while it is
        pending, unless the transport writes only inside :meth:`poll`)."""
        return handle.state is TransferState.PENDING

    def check_peer(self, peer: dict[str, Any]) -> None:
        """Raise :class:`TransportError` unless ``peer`` is a well-formed descriptor of this
        transport (what :meth:`export` gives on the peer)."""
        if not isinstance(peer, dict) or peer.get("transport") != self.name:
            found = peer.get("transport") if isinstance(peer, dict) else type(peer).__name__
            raise TransportError(f"peer descriptor is for {found!r}, this transport is {self.name!r}")

    @property
    def num_open(self) -> int:
        """Posted pulls not released yet (a pending one counts)."""
        return self.num_posted - self.num_released

    def serve(self) -> None:  # noqa: B027 - optional hook, a no-op for one-sided transports
        """Source-side progress (called from the source's loop); nothing for one-sided transports."""

    def expect_readers(self, peers: Sequence[dict[str, Any]]) -> None:  # noqa: B027 - optional hook
        """Source side: the descriptors of the peers that may pull from this side (used by
        :meth:`may_still_read` where the transport cannot see reads)."""

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


def _nixl_error_types() -> tuple[tuple[type[Exception], ...], type[Exception]]:
    """NIXL's own exception classes (plain ``Exception`` subclasses of its bindings) and the
    one it raises for a disconnected peer."""
    from nixl import _bindings

    types = tuple(v for v in vars(_bindings).values() if isinstance(v, type) and issubclass(v, Exception))
    return types, _bindings.nixlRemoteDisconnectError


class _Region(NamedTuple):
    """A registered region as NIXL addresses it (also the wire form of a descriptor's region)."""

    address: int
    nbytes: int
    device: int
    mem_type: str


@dataclass
class _PreparedList:
    """A NIXL descriptor list prepared for one side: one descriptor per unit of each of its
    regions, region ``r``'s first at index ``bases[r]``. ``key`` is what it was prepared from
    (the peer's metadata and regions, or this side's regions): another key means prepare again."""

    key: Any
    handle: Any
    bases: dict[str, int]
    units: dict[str, int]

    def indices(self, segments: Sequence[Segment], side: str) -> np.ndarray:
        """The indices of the units that ``segments`` cover on ``side`` (``source`` or ``destination``)."""
        runs = []
        for seg in segments:
            region, offset = (seg.src_region, seg.src_offset) if side == "source" else (seg.dst_region, seg.dst_offset)
            first = self.bases[region] + offset // self.units[region]
            runs.append(np.arange(first, first + seg.nbytes // self.units[region], dtype=np.int32))
        return np.concatenate(runs)


def _unit_descriptors(regions: dict[str, _Region], units: dict[str, int]) -> tuple[np.ndarray, dict[str, int], str]:
    """``(address, bytes, device)`` rows of every unit of the regions that have one, each region's
    first row, and their memory type; raises ``ValueError`` for regions of several memory types."""
    named = [name for name in sorted(regions) if name in units]
    if len({regions[name].mem_type for name in named}) != 1:
        raise ValueError("prepared lists need the regions with units to share one memory type")
    rows, bases, count = [], {}, 0
    for name in named:
        region, unit = regions[name], units[name]
        num = region.nbytes // unit
        block = np.empty((num, 3), dtype=np.int64)
        block[:, 0] = region.address + unit * np.arange(num, dtype=np.int64)
        block[:, 1], block[:, 2] = unit, region.device
        rows.append(block)
        bases[name], count = count, count + num
    return np.concatenate(rows), bases, regions[named[0]].mem_type


@dataclass
class _Reader:
    """What a source knows of a peer that may read from it: gone for good once a probe found
    it disconnected; ``probe`` is the probe read in flight."""

    peer: dict[str, Any]
    gone: bool = False
    answered: bool = False
    probe: Any = None
    probed_at: float = float("-inf")


class NixlTransport(HandoffTransport):
    """NIXL READs over UCX (see module doc). On CPU hosts without an RDMA device, set
    ``UCX_NET_DEVICES=lo`` in the environment before creating it.

    Args:
        agent_name: this side's NIXL agent name (unique among the peers).
        backends: NIXL backends to create.
        probe_interval_s: how often a source probes an expected reader that answered.
    """

    name = "nixl"

    def __init__(self, agent_name: str, backends: Sequence[str] = ("UCX",), *, probe_interval_s: float = 1.0):
        super().__init__()
        require_nixl()
        from nixl._api import nixl_agent, nixl_agent_config

        self._errors, self._disconnected = _nixl_error_types()
        self.agent_name = agent_name
        self.probe_interval_s = probe_interval_s
        with self._call("creating the agent"):
            self.agent = nixl_agent(agent_name, nixl_agent_config(backends=list(backends)))
        self._registrations = []
        self._local: dict[str, _Region] = {}  # this side's regions, resolved once at registration
        self._remote_agents: dict[str, tuple[bytes, str]] = {}  # agent -> (metadata loaded, NIXL name)
        self._local_list: _PreparedList | None = None
        self._peer_lists: dict[str, _PreparedList] = {}
        self._retired_lists: list[Any] = []  # replaced lists: pulls posted from them may still run
        # How many times this side's / each peer agent's descriptor list was prepared.
        self.local_preparations = 0
        self.peer_preparations: collections.Counter[str] = collections.Counter()
        self.num_prepared_pulls = 0
        self._readers: dict[str, _Reader] = {}
        self._probe_buffer: torch.Tensor | None = None

    @contextlib.contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """Raise NIXL's exceptions as :class:`TransportError` (:class:`PeerGoneError` for a
        disconnected peer), the original as the cause."""
        try:
            yield
        except self._errors as exc:
            kind = PeerGoneError if isinstance(exc, self._disconnected) else TransportError
            raise kind(f"NIXL failed {what}: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _device_id(tensor: torch.Tensor) -> int:
        return max(tensor.get_device(), 0)

    @staticmethod
    def _mem_type(tensor: torch.Tensor) -> str:
        return "VRAM" if tensor.is_cuda else "DRAM"

    def register(self, regions: dict[str, torch.Tensor], units: dict[str, int] | None = None) -> None:
        super().register(regions, units)
        for name, tensor in regions.items():
            with self._call("registering memory"):
                self._registrations.append(self.agent.register_memory(tensor))
            self._local[name] = _Region(
                tensor.data_ptr(),
                tensor.numel() * tensor.element_size(),
                self._device_id(tensor),
                self._mem_type(tensor),
            )

    def export(self) -> dict[str, Any]:
        with self._call("exporting its metadata"):
            metadata = self.agent.get_agent_metadata()
        return {
            "transport": self.name,
            "agent": self.agent_name,
            "metadata": metadata,
            "regions": {name: list(region) for name, region in self._local.items()},
            "units": dict(self.units),
        }

    def check_peer(self, peer: dict[str, Any]) -> None:
        super().check_peer(peer)
        regions = peer.get("regions")
        well_formed = (
            isinstance(peer.get("agent"), str)
            and isinstance(peer.get("metadata"), bytes)
            and isinstance(regions, dict)
            and all(
                isinstance(entry, list | tuple)
                and len(entry) == 4
                and all(isinstance(v, int) and v >= 0 for v in entry[:3])
                and entry[3] in ("DRAM", "VRAM")
                for entry in regions.values()
            )
        )
        units = peer.get("units", {})
        if well_formed:
            well_formed = isinstance(units, dict) and all(
                name in regions and isinstance(unit, int) and unit > 0 and regions[name][1] % unit == 0
                for name, unit in units.items()
            )
        if not well_formed:
            raise TransportError(
                "a NIXL peer descriptor needs agent (str), metadata (bytes), regions "
                "{name: [address, bytes, device, 'DRAM' or 'VRAM']} and optionally units {region: divisor of its bytes}"
            )

    def connect(self, peer: dict[str, Any]) -> str:
        """The NIXL name of a peer, loading its metadata the first time and again whenever it
        changed (the peer registered memory since)."""
        self.check_peer(peer)
        agent, metadata = peer["agent"], peer["metadata"]
        loaded = self._remote_agents.get(agent)
        if loaded is None or loaded[0] != metadata:
            with self._call(f"loading the metadata of agent {agent!r}"):
                self._remote_agents[agent] = (metadata, self.agent.add_remote_agent(metadata))
        return self._remote_agents[agent][1]

    def _prepare(self, agent: str, regions: dict[str, _Region], units: dict[str, int], key) -> _PreparedList:
        rows, bases, mem_type = _unit_descriptors(regions, units)
        with self._call("preparing a descriptor list"):
            handle = self.agent.prep_xfer_dlist(agent, rows, mem_type)
        return _PreparedList(key, handle, bases, {name: units[name] for name in bases})

    def _retire(self, prepared: _PreparedList | None) -> None:
        if prepared is not None:
            self._retired_lists.append(prepared.handle)

    def _local_prepared(self) -> _PreparedList:
        key = (tuple(sorted(self._local.items())), tuple(sorted(self.units.items())))
        if self._local_list is None or self._local_list.key != key:
            self._retire(self._local_list)
            self._local_list = self._prepare("NIXL_INIT_AGENT", self._local, self.units, key)
            self.local_preparations += 1
        return self._local_list

    def _peer_prepared(self, peer: dict[str, Any]) -> _PreparedList:
        """The peer's prepared list, prepared again when its registration (metadata, regions or
        units) differs from the one it was prepared for."""
        remote_name = self.connect(peer)
        regions = {name: _Region(*entry) for name, entry in peer["regions"].items()}
        key = (peer["metadata"], tuple(sorted(regions.items())), tuple(sorted(peer["units"].items())))
        prepared = self._peer_lists.get(peer["agent"])
        if prepared is None or prepared.key != key:
            self._retire(prepared)
            prepared = self._peer_lists[peer["agent"]] = self._prepare(remote_name, regions, peer["units"], key)
            self.peer_preparations[peer["agent"]] += 1
        return prepared

    def _preparable(self, peer: dict[str, Any], segments: Sequence[Segment]) -> bool:
        """Whether every run is a whole number of units of equal size on both sides (regions
        of one memory type on each side)."""
        remote_units = peer.get("units", {})
        for seg in segments:
            unit = self.units.get(seg.dst_region)
            if unit is None or remote_units.get(seg.src_region) != unit:
                return False
            if seg.src_offset % unit or seg.dst_offset % unit or seg.nbytes % unit:
                return False
        return all(
            len({regions[name].mem_type for name in units}) == 1
            for regions, units in (
                (self._local, self.units),
                ({n: _Region(*e) for n, e in peer["regions"].items()}, remote_units),
            )
        )

    def _post_prepared(self, peer: dict[str, Any], segments: Sequence[Segment]) -> Any:
        """Create and post one READ from the prepared lists (see :meth:`_post_read`)."""
        local, remote = self._local_prepared(), self._peer_prepared(peer)
        with self._call("creating the transfer"):
            xfer = self.agent.make_prepped_xfer(
                "READ",
                local.handle,
                local.indices(segments, "destination"),
                remote.handle,
                remote.indices(segments, "source"),
            )
        self._start(xfer)
        self.num_prepared_pulls += 1
        return xfer

    def _start(self, xfer) -> None:
        """Post a created transfer; one that could not be posted is released here (nothing of
        it will write)."""
        try:
            with self._call("posting the transfer"):
                status = self.agent.transfer(xfer)
            if status == "ERR":
                raise TransportError("NIXL failed to post the transfer")
        except TransportError:
            self._release_quietly(xfer)
            raise

    def _post_read(self, peer: dict[str, Any], local: list[tuple], remote: list[tuple], mem_types) -> Any:
        """Create and post one READ (``(address, bytes, device)`` lists); the NIXL handle.
        A transfer that could not be posted is released here: nothing of it will write."""
        remote_name = self.connect(peer)
        with self._call("describing the transfer"):
            local_descs = self.agent.get_xfer_descs(local, mem_types[1])
            remote_descs = self.agent.get_xfer_descs(remote, mem_types[0])
        with self._call("creating the transfer"):
            xfer = self.agent.initialize_xfer("READ", local_descs, remote_descs, remote_name)
        self._start(xfer)
        return xfer

    def _release_quietly(self, xfer) -> None:
        try:
            with self._call("releasing a transfer"):
                self.agent.release_xfer_handle(xfer)
        except TransportError as exc:  # NIXL keeps it on its own leak list; nothing more to do
            logger.warning("%s", exc)

    def post_pull(self, transfer_id: str, peer: dict[str, Any], segments: Sequence[Segment]) -> PullHandle:
        if not segments:
            raise TransportError(f"pull {transfer_id!r} has no runs")
        self.check_peer(peer)
        remote, local = {n: _Region(*entry) for n, entry in peer["regions"].items()}, self._local
        self._check_bounds({n: r.nbytes for n, r in remote.items()}, segments, "source")
        self._check_bounds({n: r.nbytes for n, r in local.items()}, segments, "destination")
        mem_types = (
            {remote[s.src_region].mem_type for s in segments},
            {local[s.dst_region].mem_type for s in segments},
        )
        if len(mem_types[0]) != 1 or len(mem_types[1]) != 1:
            raise TransportError("one pull must read one memory type and write one memory type")
        if self._preparable(peer, segments):
            xfer = self._post_prepared(peer, segments)
        else:
            xfer = self._post_read(
                peer,
                [(local[s.dst_region].address + s.dst_offset, s.nbytes, local[s.dst_region].device) for s in segments],
                [
                    (remote[s.src_region].address + s.src_offset, s.nbytes, remote[s.src_region].device)
                    for s in segments
                ],
                (mem_types[0].pop(), mem_types[1].pop()),
            )
        self.num_posted += 1
        return PullHandle(transfer_id, sum(s.nbytes for s in segments), len(segments), xfer)

    def _state(self, xfer) -> TransferState:
        """The state of a NIXL transfer. Raises :class:`PeerGoneError` when its peer
        disconnected (the transfer has ended) and :class:`TransportError` when NIXL cannot tell
        (the transfer may still run)."""
        with self._call("checking a transfer"):
            status = self.agent.check_xfer_state(xfer)
        return {"DONE": TransferState.DONE, "ERR": TransferState.FAILED}.get(status, TransferState.PENDING)

    def poll(self, handle: PullHandle) -> TransferState:
        if handle.state is not TransferState.PENDING:
            return handle.state
        try:
            state = self._state(handle.impl)
        except PeerGoneError as exc:
            return self._count(handle._end(TransferState.FAILED, str(exc)))
        if state is TransferState.FAILED:
            return self._count(handle._end(state, "NIXL reported the transfer failed"))
        return self._count(handle._end(state)) if state is TransferState.DONE else state

    def release(self, handle: PullHandle) -> None:
        if self.may_still_write(handle):
            raise TransportError(f"pull {handle.transfer_id!r} is still pending; poll it until it ends")
        if handle.impl is not None:
            xfer, handle.impl = handle.impl, None
            self.num_released += 1
            with self._call("releasing a transfer"):
                self.agent.release_xfer_handle(xfer)

    # ---- source side: is any expected reader still there? -----------------------------------
    def expect_readers(self, peers: Sequence[dict[str, Any]]) -> None:
        for peer in peers:
            self.check_peer(peer)
            self._readers.setdefault(peer["agent"], _Reader(peer))

    def may_still_read(self, transfer_id: str) -> bool:
        """False once every expected reader is gone (a probe read of 8 bytes of its first region
        found it disconnected); True while any may be alive, or when no reader is expected (a
        one-sided read leaves no trace here). Probes are posted and polled without waiting, at
        most every ``probe_interval_s`` per reader."""
        if not self._readers:
            return True
        for reader in self._readers.values():
            self._probe(reader)
        return not all(reader.gone for reader in self._readers.values())

    def reader_status(self) -> dict[str, str]:
        """Each expected reader's agent name: ``gone`` (a probe found it disconnected),
        ``answered`` (a probe read completed) or ``unknown``."""
        return {
            agent: "gone" if r.gone else "answered" if r.answered else "unknown" for agent, r in self._readers.items()
        }

    def _probe(self, reader: _Reader) -> None:
        if reader.gone:
            return
        try:
            if reader.probe is not None:
                state = self._state(reader.probe)
                if state is TransferState.PENDING:
                    return
                probe, reader.probe = reader.probe, None
                self._release_quietly(probe)  # answered (or failed without a disconnect: ask again later)
                reader.answered = reader.answered or state is TransferState.DONE
            elif time.monotonic() - reader.probed_at >= self.probe_interval_s:
                reader.probed_at = time.monotonic()
                reader.probe = self._post_probe(reader.peer)
        except PeerGoneError:
            if reader.probe is not None:
                self._release_quietly(reader.probe)
            reader.gone, reader.probe = True, None
        except TransportError as exc:  # cannot tell: the reader stays possibly alive
            logger.warning("probing reader %s: %s", reader.peer["agent"], exc)

    def _post_probe(self, peer: dict[str, Any]):
        address, _, device, mem_type = next(iter(peer["regions"].values()))
        if self._probe_buffer is None:
            self._probe_buffer = torch.zeros(8, dtype=torch.uint8)
            with self._call("registering memory"):
                self._registrations.append(self.agent.register_memory(self._probe_buffer))
        local = [(self._probe_buffer.data_ptr(), 8, 0)]
        return self._post_read(peer, local, [(address, 8, device)], (mem_type, "DRAM"))

    def close(self) -> None:
        with self._call("closing"):
            lists = [p.handle for p in (self._local_list, *self._peer_lists.values()) if p is not None]
            for handle in lists + self._retired_lists:
                self.agent.release_dlist_handle(handle)
            self._local_list, self._peer_lists, self._retired_lists = None, {}, []
            for registration in self._registrations:
                self.agent.deregister_memory(registration)
            self._registrations.clear()
            for _, agent in self._remote_agents.values():
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


@contextlib.contextmanager
def _torch_errors(what: str) -> Iterator[None]:
    """Raise the ``RuntimeError`` s of torch.distributed and its stores as :class:`TransportError`."""
    try:
        yield
    except TransportError:
        raise
    except RuntimeError as exc:
        raise TransportError(f"torch.distributed failed {what}: {type(exc).__name__}: {exc}") from exc


class TorchDistributedTransport(HandoffTransport):
    """Pulls over ``torch.distributed`` point-to-point (see module doc).

    Pull requests and completions travel through ``store`` (whose ``check`` never blocks,
    unlike a gloo receive); the bytes travel as one send per pull from source to puller.
    The puller posts its receives before asking, so the source's sends complete at once.
    The bytes reach the puller's regions only inside :meth:`poll`: a pending pull may be
    released at any time (its posted receives are kept until they complete).

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
        self._abandoned_works: list = []  # receives of released pending pulls (their buffers stay alive)

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

    def check_peer(self, peer: dict[str, Any]) -> None:
        super().check_peer(peer)
        regions = peer.get("regions")
        if not (
            isinstance(peer.get("rank"), int)
            and isinstance(regions, dict)
            and all(isinstance(size, int) and size >= 0 for size in regions.values())
        ):
            raise TransportError("a torch.distributed peer descriptor needs rank (int) and regions {name: bytes}")

    def post_pull(self, transfer_id: str, peer: dict[str, Any], segments: Sequence[Segment]) -> PullHandle:
        self.check_peer(peer)
        if not segments:
            raise TransportError(f"pull {transfer_id!r} has no runs")
        self._check_bounds(peer["regions"], segments, "source")
        self._check_bounds({n: t.numel() * t.element_size() for n, t in self.regions.items()}, segments, "destination")
        source, device, me = int(peer["rank"]), self._device, dist.get_rank()
        nbytes = sum(s.nbytes for s in segments)
        status = torch.zeros(1, dtype=torch.int64, device=device)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
        key = f"{source}/{me}/{self._sequence}"
        with _torch_errors("posting a pull"):
            works = [
                dist.irecv(status, source, self.group, tag=_TAG_STATUS),
                dist.irecv(payload, source, self.group, tag=_TAG_PAYLOAD),
            ]
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
        try:
            with _torch_errors("checking a pull"):
                if not self.store.check([done_key]):
                    return TransferState.PENDING
                for work in works:
                    work.wait()
                self.store.delete_key(done_key)
        except TransportError as exc:  # nothing reaches the regions outside this call: it ended
            return self._count(handle._end(TransferState.FAILED, str(exc)))
        if int(status.item()) != 0:
            return self._count(handle._end(TransferState.FAILED, "the source refused the pull (no live pin)"))
        position = 0
        for seg in segments:
            _byte_view(self.regions[seg.dst_region])[seg.dst_offset : seg.dst_offset + seg.nbytes].copy_(
                payload[position : position + seg.nbytes]
            )
            position += seg.nbytes
        return self._count(handle._end(TransferState.DONE))

    def may_still_write(self, handle: PullHandle) -> bool:
        return False

    def release(self, handle: PullHandle) -> None:
        if handle.impl is not None:
            if handle.state is TransferState.PENDING:
                self._abandoned_works = [w for w in self._abandoned_works if not w.is_completed()]
                self._abandoned_works += handle.impl[0]
            handle.impl = None
            self.num_released += 1

    def serve(self) -> None:
        """Answer every pull that was asked for (returns at once when none was). A fault of a
        puller or of the store is logged: the source has nothing to undo."""
        try:
            with _torch_errors("serving pulls"):
                self._serve()
        except TransportError as exc:
            logger.warning("%s", exc)

    def _serve(self) -> None:
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
