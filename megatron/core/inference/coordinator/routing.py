"""Routing state of the coordinator: which engine serves which request, and each engine's load.

Invariants (checked by :meth:`LoadRouter.check_invariants`):

* every routed request has exactly one entry, removed exactly once (by :meth:`finish`
  on its terminal reply, or by :meth:`deregister` when its engine leaves);
* an engine's pending load equals the number of entries routed to it, so it goes up once
  per request and down once per terminal reply.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from megatron.core.errors import MegatronConfigError
from megatron.core.inference.errors import DuplicateRequestIdError


class RoutingError(MegatronConfigError):
    """Router settings out of range (the message names them)."""


@dataclass
class EngineLoad:
    """What the router knows about one engine replica."""

    engine_id: str
    order: int
    pending: int = 0
    # Chained hashes of prompt-prefix blocks routed here, oldest first (bounded LRU).
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    stats: dict = field(default_factory=dict)
    draining: bool = False  # stopping: serves what it has, gets nothing new


@dataclass(frozen=True)
class Route:
    """Where one request went and who asked for it."""

    client: Hashable
    engine: Hashable


def prefix_block_hashes(prompt_tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of a prompt (each covers its whole prefix)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(prompt_tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(prompt_tokens[start : start + block_size])))
        hashes.append(previous)
    return hashes


class LoadRouter:
    """Least-pending-load routing with optional prefix-aware scoring.

    Args:
        prefix_weight: 0 turns prefix awareness off. Otherwise an engine's score is its
            pending load minus ``prefix_weight`` times the number of leading prompt blocks it
            has recently been sent; the lowest score wins (then the lowest load, then the
            engine registered first).
        prefix_block_size: tokens per hashed prompt block.
        max_prefixes_per_engine: bound of each engine's remembered block hashes.
    """

    def __init__(self, prefix_weight: float = 0.0, prefix_block_size: int = 16, max_prefixes_per_engine: int = 4096):
        if prefix_weight < 0 or prefix_block_size < 1 or max_prefixes_per_engine < 1:
            raise RoutingError(
                "prefix_weight must be >= 0, prefix_block_size >= 1 and max_prefixes_per_engine >= 1; got "
                f"{prefix_weight}, {prefix_block_size}, {max_prefixes_per_engine}"
            )
        self.prefix_weight = prefix_weight
        self.prefix_block_size = prefix_block_size
        self.max_prefixes_per_engine = max_prefixes_per_engine
        self.engines: dict[Hashable, EngineLoad] = {}
        self.routes: dict[str, Route] = {}
        self._order = itertools.count()

    def register(self, engine: Hashable, engine_id: str) -> None:
        """Add an engine replica (registering again keeps its state)."""
        if engine not in self.engines:
            self.engines[engine] = EngineLoad(engine_id, next(self._order))

    def deregister(self, engine: Hashable) -> list[tuple[str, Route]]:
        """Remove an engine; returns the requests still routed to it (their entries are removed)."""
        if self.engines.pop(engine, None) is None:
            return []
        orphans = [(rid, route) for rid, route in self.routes.items() if route.engine == engine]
        for rid, _ in orphans:
            del self.routes[rid]
        return orphans

    def drain(self, engine: Hashable) -> None:
        """Route nothing new to ``engine`` (it is stopping); what it serves stays routed to it."""
        self.engines[engine].draining = True

    @property
    def live_engines(self) -> list[Hashable]:
        """The registered engines that take new requests (not draining), in registration order."""
        return [engine for engine, load in self.engines.items() if not load.draining]

    def route(self, request_id: str, client: Hashable, prompt_tokens: Sequence[int]) -> Hashable | None:
        """Pick the engine of a new request among the live ones and count its load; None when
        no engine takes new requests."""
        if request_id in self.routes:
            raise DuplicateRequestIdError(request_id=request_id)
        candidates = self.live_engines
        if not candidates:
            return None
        blocks = prefix_block_hashes(prompt_tokens, self.prefix_block_size) if self.prefix_weight else []
        engine = min(candidates, key=lambda e: self._score(self.engines[e], blocks))
        load = self.engines[engine]
        load.pending += 1
        self.routes[request_id] = Route(client, engine)
        for block in blocks:
            load.prefixes[block] = None
            load.prefixes.move_to_end(block)
        while len(load.prefixes) > self.max_prefixes_per_engine:
            load.prefixes.popitem(last=False)
        return engine

    def _score(self, load: EngineLoad, blocks: list[int]) -> tuple[float, int, int]:
        matched = 0
        for block in blocks:
            if block not in load.prefixes:
                break
            matched += 1
        return (load.pending - self.prefix_weight * matched, load.pending, load.order)

    def finish(self, request_id: str) -> Route | None:
        """A terminal reply arrived: remove the entry and its load; None if the id is not in flight."""
        route = self.routes.pop(request_id, None)
        if route is not None and route.engine in self.engines:
            self.engines[route.engine].pending -= 1
        return route

    def lookup(self, request_id: str) -> Route | None:
        return self.routes.get(request_id)

    def check_invariants(self) -> None:
        """Raise AssertionError when loads and entries disagree (used by tests and debug runs)."""
        counts = {engine: 0 for engine in self.engines}
        for route in self.routes.values():
            assert route.engine in counts, f"route to unregistered engine {route.engine!r}"
            counts[route.engine] += 1
        for engine, load in self.engines.items():
            assert load.pending == counts[engine], (
                f"engine {load.engine_id} pending={load.pending} but {counts[engine]} routed requests"
            )
