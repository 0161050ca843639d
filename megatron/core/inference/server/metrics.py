"""Prometheus metrics of the server, through ``prometheus-client`` (one registry per app).

The HTTP layer counts requests (by endpoint and status, and whether the client left early) and
tokens, and times each request: time to first token, inter-token latency, queue time (until each
choice is handed to the engines) and end-to-end latency. At scrape time the coordinator's stats
add the queue depth, each engine's pending load and its own stats (``megatron_engine_<key>``,
among them ``kv_usage_fraction``), and the prefix-cache hit rate over all engines.
"""

from __future__ import annotations

import re
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

PREFIX = "megatron_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.0, 2.5, 5.0)


def metric_name(name: str) -> str:
    """A valid Prometheus metric name from an arbitrary stats key."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class ServerMetrics:
    """What the HTTP layer measures; :meth:`render` writes it with the coordinator's stats.

    Args:
        kv_block_size: tokens per KV block of the engines, which count prefix-cache hits in
            blocks (for the hit rate in tokens); None: no hit rate.
    """

    def __init__(self, kv_block_size: int | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=registry
        )
        self.requests_by_status_class = Counter(
            PREFIX + "requests_by_status_class",
            "HTTP requests by endpoint and status class.",
            ["endpoint", "status_class"],
            registry=registry,
        )
        self.abandoned = Counter(
            PREFIX + "requests_abandoned",
            "HTTP requests whose client left before the whole response.",
            ["endpoint"],
            registry=registry,
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=registry)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests.", registry=registry
        )
        self.running = Gauge(PREFIX + "requests_running", "HTTP generation requests in progress.", registry=registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive output tokens of a choice.",
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time from a request's arrival until each of its choices was handed to the engines.",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from a request's arrival until its last choice finished (requests served to the end).",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self._coordinator = _CoordinatorCollector(kv_block_size)
        registry.register(self._coordinator)

    def count_request(self, endpoint: str, status: int, *, abandoned: bool = False) -> None:
        """One HTTP request answered ``status``; ``abandoned``: its client left before the whole response."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.requests_by_status_class.labels(endpoint=endpoint, status_class=f"{status // 100}xx").inc()
        if abandoned:
            self.abandoned.labels(endpoint=endpoint).inc()

    def count_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def render(self, coordinator_stats: dict[str, Any] | None) -> bytes:
        """The exposition text, with ``coordinator_stats`` (None: the coordinator did not answer)."""
        self._coordinator.stats = coordinator_stats
        return generate_latest(self.registry)


class _CoordinatorCollector:
    """Gauges read from the coordinator's stats of the current scrape."""

    def __init__(self, kv_block_size: int | None):
        self.kv_block_size = kv_block_size
        self.stats: dict[str, Any] | None = None

    def describe(self) -> list:
        return []  # the engine stats' names are known only at scrape time

    def collect(self):
        if self.stats is None:
            return
        engines = self.stats.get("engines", [])
        queue = self.stats.get("unrouted", 0) + sum(engine["pending"] for engine in engines)
        yield GaugeMetricFamily(PREFIX + "queue_depth", "Requests in flight in the coordinator.", value=queue)
        pending = GaugeMetricFamily(
            PREFIX + "engine_pending_requests", "Requests routed to each engine and not finished.", labels=["engine"]
        )
        for engine in engines:
            pending.add_metric([engine["engine_id"]], engine["pending"])
        yield pending
        families: dict[str, GaugeMetricFamily] = {}
        for engine in engines:
            for key, value in sorted(engine.get("stats", {}).items()):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    name = metric_name("engine_" + key)
                    family = families.get(name) or GaugeMetricFamily(name, f"Engine stat {key!r}.", labels=["engine"])
                    families[name] = family
                    family.add_metric([engine["engine_id"]], float(value))
        yield from families.values()
        hit_rate = self._prefix_cache_hit_rate(engines)
        if hit_rate is not None:
            yield GaugeMetricFamily(
                PREFIX + "prefix_cache_hit_rate",
                "Share of prompt tokens all engines found in their prefix caches instead of computing them.",
                value=hit_rate,
            )

    def _prefix_cache_hit_rate(self, engines: list[dict[str, Any]]) -> float | None:
        if self.kv_block_size is None:
            return None
        stats = [engine.get("stats", {}) for engine in engines]
        cached = self.kv_block_size * sum(s.get("prefix_cache_hits", 0) for s in stats)
        computed = sum(s.get("prefill_tokens_computed", 0) for s in stats)
        return cached / (cached + computed) if cached + computed else 0.0
