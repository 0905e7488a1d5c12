"""Counters per tier and per warm-up policy: a Python snapshot and Prometheus.

The counters live where the work happens (:class:`TierStats` in each tier,
:class:`WarmupStats` in the promoter); this module only reads them, so there
is one source of truth. Prometheus names carry the ``lmcache_tiered_`` prefix.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (
    REGISTRY,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

#: Upper bounds (seconds) of the read-latency histogram buckets.
LATENCY_BOUNDS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass
class LatencyHistogram:
    """Cumulative-on-export histogram of read latencies (seconds)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self.total_s += seconds


@dataclass
class WarmupStats:
    """What a warm-up policy asked for and what it bought."""

    plans: int = 0
    keys_planned: int = 0
    bytes_promoted_hot: int = 0
    bytes_promoted_warm: int = 0
    #: promoted-to-hot bytes that a lookup then used (before eviction)
    bytes_used: int = 0
    #: demand lookups that found a promoted chunk already in the hot tier
    timely: int = 0
    #: demand reads of a chunk whose promotion was still queued or running
    late: int = 0
    #: plan keys dropped: past their deadline, or already where they should be
    cancelled: int = 0

    @property
    def precision(self) -> float | None:
        """Share of bytes promoted to hot that were used; None before any."""
        if not self.bytes_promoted_hot:
            return None
        return self.bytes_used / self.bytes_promoted_hot


_TIER_COUNTERS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "puts",
    "puts_dropped",
    "corrupt",
    "evictions",
    "io_errors",
)
_WARMUP_COUNTERS = (
    "plans",
    "keys_planned",
    "bytes_promoted_hot",
    "bytes_promoted_warm",
    "bytes_used",
    "timely",
    "late",
    "cancelled",
)


class TieredCollector(Collector):
    """Exposes a backend's :func:`snapshot` to Prometheus at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        for name in _TIER_COUNTERS:
            family = CounterMetricFamily(
                f"lmcache_tiered_tier_{name}", f"{name} per tier", labels=["tier"]
            )
            for tier, stats in snap["tiers"].items():
                family.add_metric([tier], stats[name])
            yield family
        used = GaugeMetricFamily(
            "lmcache_tiered_tier_used_bytes", "disk bytes held", labels=["tier"]
        )
        latency = HistogramMetricFamily(
            "lmcache_tiered_tier_read_seconds", "chunk read latency", labels=["tier"]
        )
        for tier, stats in snap["tiers"].items():
            used.add_metric([tier], stats["used_bytes"])
            counts, running = stats["read_latency"]["counts"], 0
            buckets = []
            for bound, count in zip(
                (*LATENCY_BOUNDS_S, float("inf")), counts, strict=True
            ):
                running += count
                buckets.append((str(bound), running))
            latency.add_metric([tier], buckets, stats["read_latency"]["total_s"])
        yield used
        yield latency
        warmup = snap["warmup"]
        for name in _WARMUP_COUNTERS:
            family = CounterMetricFamily(
                f"lmcache_tiered_warmup_{name}", f"warm-up {name}", labels=["policy"]
            )
            family.add_metric([warmup["policy"]], warmup[name])
            yield family

    def register(self) -> None:
        REGISTRY.register(self)

    def unregister(self) -> None:
        REGISTRY.unregister(self)
