"""Rank layout over the parallel axes and the collection of process groups built from it.

World = TP x GTP x CP x DP x PP. An order string names the axes fastest-varying first
(default ``tp-gtp-cp-dp-pp``); a global rank is a mixed-radix number over that order,
offset by ``rank_offset`` for a sub-grid that lives on part of the world. Every rank list
used anywhere comes from :meth:`RankLayout.rank_groups` (dense groups) or
:meth:`RankLayout.expert_rank_groups` (expert groups).

Expert groups are folded as Megatron folds them: the TP x CP x DP ranks of one pipeline
stage (at one GTP coordinate) are renumbered by their mixed-radix index over those axes in
the order string, and that index is split again as expert-TP (fastest), EP, expert-DP. So
EP x ETP x expert-DP spans exactly the ranks of TP x CP x DP, and with EP 1 and ETP = TP
under the default order the expert groups are the dense ``tp`` / ``dp_cp`` / ``mp`` groups.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import torch.distributed as dist

from megatron.core.errors import MegatronConfigError

AXES = ("tp", "gtp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-gtp-cp-dp-pp"

# Collection group name -> the axes its members vary over (embd/pos_embd are special).
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "cp": ("cp",),
    "gtp": ("gtp",),
    "dp": ("dp",),
    "dp_cp": ("dp", "cp"),
    "dp_cp_gtp": ("dp", "cp", "gtp"),
    "tp_cp": ("tp", "cp"),
    "mp": ("tp", "gtp", "pp"),
    "tp_dp_cp": ("tp", "dp", "cp"),
}
# Expert group name -> the expert axes its members vary over.
EXPERT_AXES = ("etp", "ep", "edp")
EXPERT_GROUP_AXES: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("etp",),
    "expt_dp": ("edp",),
    # Where expert gradient norms are summed: every distinct expert shard once.
    "expt_mp": ("etp", "ep", "gtp", "pp"),
}
EXPERT_GROUP_NAMES = tuple(EXPERT_GROUP_AXES)
GROUP_NAMES = tuple(GROUP_AXES) + ("embd", "pos_embd") + EXPERT_GROUP_NAMES
# Axes folded into the expert grid of one pipeline stage.
_STAGE_AXES = ("tp", "cp", "dp")


class ParallelConfigError(MegatronConfigError):
    """A parallel layout that cannot be built; the message names the numbers that disagree."""


class MissingProcessGroupError(MegatronConfigError, LookupError):
    """A process group was asked of a collection that was built without it."""


def parse_order(order: str) -> tuple[str, ...]:
    """Split an order string such as ``tp-gtp-cp-dp-pp`` and check it names every axis once."""
    names = tuple(part.strip() for part in order.split("-"))
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise ParallelConfigError(f"order {order!r} names unknown axis {unknown[0]!r}; known axes: {', '.join(AXES)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ParallelConfigError(f"order {order!r} repeats axis {repeated[0]!r}")
    missing = [a for a in AXES if a not in names]
    if missing:
        raise ParallelConfigError(
            f"order {order!r} lacks axis {missing[0]!r}; it must list each of {', '.join(AXES)} once"
        )
    return names


@dataclass(frozen=True)
class RankLayout:
    """Sizes of the parallel axes, their order, and where the grid starts in the world."""

    tp: int = 1
    gtp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER
    rank_offset: int = 0
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; None means the same as tp (Megatron's default)

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for axis in AXES + ("ep", "etp"):
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ParallelConfigError(f"{axis} size must be an integer >= 1, got {size!r}")
        if self.rank_offset < 0:
            raise ParallelConfigError(f"rank_offset must be >= 0, got {self.rank_offset}")
        parse_order(self.order)
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.etp):
            raise ParallelConfigError(
                f"ep*etp = {self.ep}*{self.etp} = {self.ep * self.etp} does not divide the tp*cp*dp = "
                f"{self.tp}*{self.cp}*{self.dp} = {stage} ranks of a pipeline stage"
            )
        if self.gtp > 1 and (self.ep > 1 or self.etp != self.tp):
            raise ParallelConfigError(
                f"expert parallelism (ep {self.ep}, etp {self.etp}) with gtp {self.gtp} is not supported; "
                "use gtp 1, or ep 1 and etp = tp"
            )

    @classmethod
    def for_world(cls, world_size: int, tp=1, gtp=1, cp=1, pp=1, order=DEFAULT_ORDER, ep=1, etp=None) -> RankLayout:
        """Layout filling ``world_size`` ranks: DP is whatever the other sizes leave."""
        for axis, size in (("tp", tp), ("gtp", gtp), ("cp", cp), ("pp", pp)):
            if not isinstance(size, int) or size < 1:
                raise ParallelConfigError(f"{axis} size must be an integer >= 1, got {size!r}")
        model_size = tp * gtp * cp * pp
        if world_size % model_size:
            raise ParallelConfigError(
                f"world size {world_size} is not a multiple of tp*gtp*cp*pp = {tp}*{gtp}*{cp}*{pp} = {model_size}"
            )
        return cls(tp=tp, gtp=gtp, cp=cp, dp=world_size // model_size, pp=pp, order=order, ep=ep, etp=etp)

    @property
    def expert_dp(self) -> int:
        """Size of the expert data-parallel group: the stage's tp*cp*dp ranks over ep*etp."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def axes(self) -> tuple[str, ...]:
        return parse_order(self.order)

    @property
    def world_size(self) -> int:
        return self.tp * self.gtp * self.cp * self.dp * self.pp

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.world_size)

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Per-axis coordinates of a global rank inside this grid."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is outside this grid (ranks {self.ranks.start}..{self.ranks.stop - 1})")
        local = rank - self.rank_offset
        coords = {}
        for axis in self.axes:
            coords[axis] = local % self.size(axis)
            local //= self.size(axis)
        return coords

    def rank_of(self, coords: dict[str, int]) -> int:
        """Global rank at the given per-axis coordinates (the inverse of :meth:`coordinates`)."""
        rank, stride = 0, 1
        for axis in self.axes:
            rank += coords[axis] * stride
            stride *= self.size(axis)
        return rank + self.rank_offset

    def rank_groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """Rank lists of the groups spanning ``axes`` (e.g. ``"dp-cp"``): one group per
        coordinate of the remaining axes, members ascending."""
        names = tuple(axes.split("-")) if isinstance(axes, str) else tuple(axes)
        for name in names:
            if name not in AXES:
                raise ParallelConfigError(f"unknown axis {name!r}; known axes: {', '.join(AXES)}")
        fixed = [a for a in self.axes if a not in names]
        groups = []
        for fixed_coords in itertools.product(*(range(self.size(a)) for a in fixed)):
            members = []
            for varying in itertools.product(*(range(self.size(a)) for a in names)):
                coords = dict(zip(fixed, fixed_coords, strict=True)) | dict(zip(names, varying, strict=True))
                members.append(self.rank_of(coords))
            groups.append(sorted(members))
        return sorted(groups)

    def expert_coordinates(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank in the expert grid: ``etp``, ``ep``, ``edp`` (the
        stage's tp/cp/dp ranks refolded) plus the unchanged ``gtp`` and ``pp``."""
        coords = self.coordinates(rank)
        stage_index, stride = 0, 1
        for axis in self.axes:
            if axis in _STAGE_AXES:
                stage_index += coords[axis] * stride
                stride *= self.size(axis)
        return {
            "etp": stage_index % self.etp,
            "ep": stage_index // self.etp % self.ep,
            "edp": stage_index // (self.etp * self.ep),
            "gtp": coords["gtp"],
            "pp": coords["pp"],
        }

    def expert_rank_groups(self, axes: Iterable[str]) -> list[list[int]]:
        """Rank lists of the groups spanning the expert-grid ``axes`` (from ``etp``, ``ep``,
        ``edp``, ``gtp``, ``pp``): ranks agreeing on every other expert coordinate."""
        names = tuple(axes)
        for name in names:
            if name not in EXPERT_AXES + ("gtp", "pp"):
                raise ParallelConfigError(f"unknown expert axis {name!r}; known: etp, ep, edp, gtp, pp")
        groups: dict[tuple, list[int]] = {}
        for rank in self.ranks:
            coords = self.expert_coordinates(rank)
            key = tuple(v for k, v in coords.items() if k not in names)
            groups.setdefault(key, []).append(rank)
        return sorted(groups.values())

    def embedding_groups(self, include_last_stage: bool = True) -> list[list[int]]:
        """Per pipeline: first stage (and last stage) ranks, which hold (tied) embeddings."""
        groups = []
        for pipeline in self.rank_groups("pp"):
            ends = [pipeline[self._stage_index(pipeline, 0)]]
            if include_last_stage and self.pp > 1:
                ends.append(pipeline[self._stage_index(pipeline, self.pp - 1)])
            groups.append(sorted(ends))
        return sorted(groups)

    def _stage_index(self, pipeline: list[int], stage: int) -> int:
        return [self.coordinates(r)["pp"] for r in pipeline].index(stage)

    def group_ranks(self, name: str) -> list[list[int]]:
        """Rank lists of the collection group ``name`` (one of :data:`GROUP_NAMES`)."""
        if name == "embd":
            return self.embedding_groups(include_last_stage=True)
        if name == "pos_embd":
            return self.embedding_groups(include_last_stage=False)
        if name in EXPERT_GROUP_AXES:
            return self.expert_rank_groups(EXPERT_GROUP_AXES[name])
        if name not in GROUP_AXES:
            raise MissingProcessGroupError(f"unknown process group {name!r}; known: {', '.join(GROUP_NAMES)}")
        return self.rank_groups(GROUP_AXES[name])


_group_cache: dict[tuple[int, ...], dist.ProcessGroup] = {}
_group_cache_world: list = [None]


def new_group_cached(ranks: list[int], backend: str | None = None, timeout=None) -> dist.ProcessGroup | None:
    """Create (or reuse) the process group over ``ranks``; only members need call.

    Groups are created with local synchronization, so a sub-grid never needs ranks outside
    it. Identical rank lists share one group (the backend names groups by their ranks).
    Returns None on a rank that is not a member.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    if _group_cache_world[0] is not dist.group.WORLD:
        forget_cached_groups()
        _group_cache_world[0] = dist.group.WORLD
    key = tuple(sorted(ranks))
    if dist.get_rank() not in key:
        return None
    if key not in _group_cache:
        if len(key) == dist.get_world_size():
            _group_cache[key] = dist.group.WORLD
        else:
            _group_cache[key] = dist.new_group(
                list(key), backend=backend, timeout=timeout, use_local_synchronization=True
            )
    return _group_cache[key]


def forget_cached_groups() -> None:
    """Drop this module's references to its groups, so that destroying the process groups
    frees their backends (and joins their threads) now rather than at interpreter exit."""
    _group_cache.clear()
    _group_cache_world[0] = None


@dataclass
class ProcessGroupCollection:
    """The named process groups a module, optimizer, checkpoint or context works with.

    Build it for the whole world or a sub-grid with :meth:`from_layout`, or by hand from
    groups the caller made. Reading a group that was not provided raises
    :class:`MissingProcessGroupError` naming it. A collection without ``gtp`` behaves as
    GTP of size 1 (see :meth:`size` / :meth:`rank` / :meth:`dp_cp_gtp_or_dp_cp`), and one
    without ``ep`` as EP of size 1; :meth:`expert_dp_group` / :meth:`expert_mp_group` fall back
    to the dense ``dp_cp`` / ``mp`` groups when the expert ones were not provided.
    """

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    gtp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    dp_cp: dist.ProcessGroup | None = None
    dp_cp_gtp: dist.ProcessGroup | None = None
    tp_cp: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None
    tp_dp_cp: dist.ProcessGroup | None = None
    embd: dist.ProcessGroup | None = None
    pos_embd: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    expt_tp: dist.ProcessGroup | None = None
    expt_dp: dist.ProcessGroup | None = None
    expt_mp: dist.ProcessGroup | None = None
    layout: RankLayout | None = field(default=None, compare=False)

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if value is None and name in GROUP_NAMES:
            raise MissingProcessGroupError(f"process group {name!r} was not provided to this ProcessGroupCollection")
        return value

    def has(self, name: str) -> bool:
        """Whether group ``name`` was provided."""
        return object.__getattribute__(self, name) is not None

    def replace(self, **groups) -> ProcessGroupCollection:
        """A copy with ``groups`` changed (None drops one). ``dataclasses.replace`` cannot copy a
        collection with absent groups: reading them raises."""
        current = {f.name: object.__getattribute__(self, f.name) for f in fields(self)}
        return ProcessGroupCollection(**{**current, **groups})

    def size(self, name: str) -> int:
        """World size of group ``name``; an absent ``gtp`` counts as size 1."""
        if name in ("gtp", "ep") and not self.has(name):
            return 1
        return dist.get_world_size(getattr(self, name))

    def rank(self, name: str) -> int:
        """This rank's index in group ``name``; an absent ``gtp`` counts as rank 0."""
        if name in ("gtp", "ep") and not self.has(name):
            return 0
        return dist.get_rank(getattr(self, name))

    def dp_cp_gtp_or_dp_cp(self) -> dist.ProcessGroup:
        """The GTP-inclusive data group; without GTP it is the plain ``dp_cp`` group."""
        if self.has("dp_cp_gtp"):
            return self.dp_cp_gtp
        if self.size("gtp") == 1:
            return self.dp_cp
        raise MissingProcessGroupError("process group 'dp_cp_gtp' was not provided and gtp size > 1")

    def expert_dp_group(self) -> dist.ProcessGroup:
        """The group expert gradients are reduced over (``expt_dp``; ``dp_cp`` without it)."""
        return self.expt_dp if self.has("expt_dp") else self.dp_cp

    def expert_mp_group(self) -> dist.ProcessGroup:
        """The group expert gradient norms are summed over (``expt_mp``; ``mp`` without it)."""
        return self.expt_mp if self.has("expt_mp") else self.mp

    def provided(self) -> list[str]:
        return [f.name for f in fields(self) if f.name in GROUP_NAMES and self.has(f.name)]

    @classmethod
    def from_layout(cls, layout: RankLayout, backend: str | None = None, timeout=None) -> ProcessGroupCollection:
        """Create every group of ``layout`` that contains this rank.

        Only ranks inside the layout call this (a sub-grid needs nothing of the other
        ranks, nor any global parallel state); they must call it in the same order. ``ep``
        is created only when the layout has EP > 1 (an absent ``ep`` reads as EP 1); the
        other expert groups always are (without expert parallelism they are dense groups
        already made, so they cost nothing).
        """
        if dist.get_world_size() < layout.ranks.stop:
            raise ParallelConfigError(
                f"layout spans ranks {layout.ranks.start}..{layout.ranks.stop - 1} but the world has "
                f"{dist.get_world_size()} ranks"
            )
        me = dist.get_rank()
        if me not in layout.ranks:
            raise ValueError(
                f"rank {me} is not part of the layout on ranks {layout.ranks.start}..{layout.ranks.stop - 1}"
            )
        groups = {}
        for name in GROUP_NAMES:
            if name == "ep" and layout.ep == 1:
                groups[name] = None
                continue
            (mine,) = [g for g in layout.group_ranks(name) if me in g] or [None]
            groups[name] = new_group_cached(mine, backend=backend, timeout=timeout) if mine else None
        return cls(**groups, layout=layout)
