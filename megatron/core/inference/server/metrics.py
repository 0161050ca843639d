"""Prometheus text-format metrics of the server (no client library needed).

Counters and a time-to-first-token histogram are kept here; queue depth, pending load and
the engines' own stats (KV usage...) are read from the coordinator at scrape time.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "megatron_"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items()) + "}"


def metric_name(name: str) -> str:
    """A valid Prometheus metric name from an arbitrary stats key."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class ServerMetrics:
    """What the HTTP layer counts; :meth:`render` writes it with the coordinator's stats."""

    def __init__(self):
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.abandoned: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS_S) + 1)
        self.ttft_sum_s = 0.0

    def count_request(self, endpoint: str, status: int, *, abandoned: bool = False) -> None:
        """One HTTP request answered ``status``; ``abandoned``: its client left before the whole response."""
        self.requests[(endpoint, status)] += 1
        if abandoned:
            self.abandoned[endpoint] += 1

    def count_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generated

    def observe_ttft(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(TTFT_BUCKETS_S) if seconds <= bound), len(TTFT_BUCKETS_S))
        self.ttft_counts[index] += 1
        self.ttft_sum_s += seconds

    def render(self, coordinator_stats: dict[str, Any] | None) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str) -> str:
            full = PREFIX + name
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"])
            return full

        name = family("requests_total", "counter", "HTTP requests by endpoint and status code.")
        by_class: dict[tuple[str, str], int] = defaultdict(int)
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(f"{name}{_labels(endpoint=endpoint, status=str(status))} {count}")
            by_class[(endpoint, f"{status // 100}xx")] += count
        name = family("requests_by_status_class_total", "counter", "HTTP requests by endpoint and status class.")
        for (endpoint, status_class), count in sorted(by_class.items()):
            lines.append(f"{name}{_labels(endpoint=endpoint, status_class=status_class)} {count}")
        name = family(
            "requests_abandoned_total", "counter", "HTTP requests whose client left before the whole response."
        )
        for endpoint, count in sorted(self.abandoned.items()):
            lines.append(f"{name}{_labels(endpoint=endpoint)} {count}")
        lines.append(
            f"{family('prompt_tokens_total', 'counter', 'Prompt tokens of finished requests.')} {self.prompt_tokens}"
        )
        lines.append(
            f"{family('generation_tokens_total', 'counter', 'Generated tokens of finished requests.')} "
            f"{self.generation_tokens}"
        )
        lines.append(f"{family('requests_running', 'gauge', 'HTTP generation requests in progress.')} {self.running}")
        name = family("time_to_first_token_seconds", "histogram", "Time from request arrival to its first token.")
        cumulative = 0
        for bound, count in zip((*map(str, TTFT_BUCKETS_S), "+Inf"), self.ttft_counts, strict=True):
            cumulative += count
            lines.append(f"{name}_bucket{_labels(le=bound)} {cumulative}")
        lines.append(f"{name}_sum {self.ttft_sum_s}")
        lines.append(f"{name}_count {cumulative}")
        if coordinator_stats is not None:
            self._render_coordinator(coordinator_stats, lines, family)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _render_coordinator(stats: dict[str, Any], lines: list[str], family) -> None:
        engines = stats.get("engines", [])
        queue = stats.get("unrouted", 0) + sum(engine["pending"] for engine in engines)
        lines.append(f"{family('queue_depth', 'gauge', 'Requests in flight in the coordinator.')} {queue}")
        name = family("engine_pending_requests", "gauge", "Requests routed to each engine and not finished.")
        for engine in engines:
            lines.append(f"{name}{_labels(engine=engine['engine_id'])} {engine['pending']}")
        by_key: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for engine in engines:
            for key, value in engine.get("stats", {}).items():
                if isinstance(value, (int, float)):
                    by_key[key].append((engine["engine_id"], float(value)))
        for key, values in sorted(by_key.items()):
            name = metric_name("engine_" + key)
            lines.extend([f"# HELP {name} Engine stat {key!r}.", f"# TYPE {name} gauge"])
            lines.extend(f"{name}{_labels(engine=engine_id)} {value}" for engine_id, value in values)
