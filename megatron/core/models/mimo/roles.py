"""Which ranks hold which MIMO module, and each module's own process groups.

A MIMO job places every module (the language model and each modality encoder) on a grid of
ranks described by a :class:`RankLayout`. Grids are either all *colocated* (the same ranks,
each module with its own TP/GTP/DP split) or pairwise *disjoint* (e.g. the encoder on ranks
0-1, the language model on ranks 2-5). Each rank builds the collections of the modules it
holds through :meth:`ProcessGroupCollection.from_layout`; no global parallel state is read
or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron.core.errors import MegatronConfigError
from megatron.core.process_groups import ProcessGroupCollection, RankLayout

LANGUAGE_MODEL = "language_model"


class MimoRolesError(MegatronConfigError):
    """Module grids that cannot form a MIMO job; the message names the modules and ranks."""


def data_index(layout: RankLayout, rank: int) -> int:
    """Index of ``rank``'s data shard among the module's data shards (its rank in the
    GTP-inclusive ``dp_cp_gtp`` group; TP and PP peers share it)."""
    (members,) = [g for g in layout.group_ranks("dp_cp_gtp") if rank in g]
    return members.index(rank)


def data_width(layout: RankLayout) -> int:
    """Number of distinct data shards of a module (|dp_cp_gtp|)."""
    return layout.dp * layout.cp * layout.gtp


def is_model_root(layout: RankLayout, rank: int) -> bool:
    """Whether ``rank`` is the first rank of its model-parallel replica (tp and pp coordinate
    0): the one that speaks for a data shard whose activations all TP peers hold alike."""
    coords = layout.coordinates(rank)
    return coords["tp"] == 0 and coords["pp"] == 0


@dataclass(frozen=True)
class MimoRoles:
    """The grid of every module, keyed by module name (``"language_model"`` and modality
    names such as ``"images"``)."""

    layouts: dict[str, RankLayout]

    def __post_init__(self):
        if LANGUAGE_MODEL not in self.layouts:
            raise MimoRolesError(f"MIMO roles need a {LANGUAGE_MODEL!r} layout; got modules {sorted(self.layouts)}")
        if len(self.layouts) < 2:
            raise MimoRolesError("MIMO roles need at least one modality module besides the language model")
        for name, layout in self.layouts.items():
            if layout.pp != 1 or layout.cp != 1:
                raise MimoRolesError(
                    f"module {name!r}: pipeline and context parallel sizes must be 1 in MIMO layouts, "
                    f"got pp={layout.pp}, cp={layout.cp}"
                )
        ranges = {name: set(layout.ranks) for name, layout in self.layouts.items()}
        names = sorted(ranges)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if ranges[a] != ranges[b] and ranges[a] & ranges[b]:
                    raise MimoRolesError(
                        f"modules {a!r} (ranks {_span(self.layouts[a])}) and {b!r} (ranks {_span(self.layouts[b])}) "
                        "partly overlap; module grids must be identical (colocated) or disjoint"
                    )
        union = set().union(*ranges.values())
        if union != set(range(len(union))):
            raise MimoRolesError(f"module grids must cover ranks 0..N-1 without holes, they cover {sorted(union)}")

    @property
    def world_size(self) -> int:
        return max(layout.ranks.stop for layout in self.layouts.values())

    @property
    def colocated(self) -> bool:
        """Whether every module lives on the same ranks."""
        return len({layout.ranks for layout in self.layouts.values()}) == 1

    @property
    def modality_names(self) -> list[str]:
        return sorted(name for name in self.layouts if name != LANGUAGE_MODEL)

    def holds(self, name: str, rank: int) -> bool:
        """Whether ``rank`` holds module ``name``."""
        return rank in self.layouts[name].ranks

    def modules_on(self, rank: int) -> list[str]:
        """Names of the modules ``rank`` holds, language model first, then modalities sorted."""
        return [name for name in [LANGUAGE_MODEL, *self.modality_names] if self.holds(name, rank)]

    def build_collections(self, backend: str | None = None, timeout=None) -> dict[str, ProcessGroupCollection]:
        """This rank's collection of each module it holds (only members create the groups)."""
        if dist.get_world_size() != self.world_size:
            raise MimoRolesError(
                f"the module grids span {self.world_size} ranks but the world has {dist.get_world_size()}"
            )
        me = dist.get_rank()
        return {
            name: ProcessGroupCollection.from_layout(self.layouts[name], backend=backend, timeout=timeout)
            for name in self.modules_on(me)
        }

    @classmethod
    def build(
        cls, world_size: int, *, language: dict, modalities: dict[str, dict], placement: str = "colocated"
    ) -> MimoRoles:
        """Roles from per-module sizes: ``tp``, ``gtp`` and optionally ``dp`` (by default DP
        fills the module's ranks; when given it must do so exactly).

        ``placement`` is ``"colocated"`` (every module on all ``world_size`` ranks) or
        ``"first-N"`` (the modalities share ranks 0..N-1, the language model the rest).
        """
        if placement == "colocated":
            ranks = {name: (0, world_size) for name in [LANGUAGE_MODEL, *modalities]}
        elif placement.startswith("first-") and placement[len("first-") :].isdigit():
            n = int(placement[len("first-") :])
            if not 0 < n < world_size:
                raise MimoRolesError(f"placement {placement!r} needs 0 < N < world size {world_size}")
            ranks = {name: (0, n) for name in modalities} | {LANGUAGE_MODEL: (n, world_size - n)}
        else:
            raise MimoRolesError(f"placement must be 'colocated' or 'first-N' (e.g. 'first-2'), got {placement!r}")
        sizes = {LANGUAGE_MODEL: language, **modalities}
        layouts = {}
        for name, (offset, count) in ranks.items():
            try:
                grid = RankLayout.for_world(count, tp=sizes[name].get("tp", 1), gtp=sizes[name].get("gtp", 1))
            except ValueError as error:
                raise MimoRolesError(f"module {name!r} on {count} ranks: {error}") from error
            if sizes[name].get("dp", grid.dp) != grid.dp:
                raise MimoRolesError(
                    f"module {name!r}: data-parallel size {sizes[name]['dp']} does not fill its {count} ranks "
                    f"(tp {grid.tp} x gtp {grid.gtp} leaves dp {grid.dp})"
                )
            layouts[name] = RankLayout(tp=grid.tp, gtp=grid.gtp, dp=grid.dp, rank_offset=offset)
        return cls(layouts)


def _span(layout: RankLayout) -> str:
    return f"{layout.ranks.start}..{layout.ranks.stop - 1}"
