"""Counters per tier and per warm-up policy: a Python snapshot and Prometheus.

The counter classes are defined here and updated where the work happens (a
:class:`TierStats` in each tier, a :class:`WarmupStats` in the promoter); the
exported series are derived from their fields, so there is one source of
truth. Prometheus names carry the ``lmcache_tiered_`` prefix.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
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


@dataclass(slots=True)
class TierStats:
    """Counters of one tier, read by metrics and benchmarks."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    puts_dropped: int = 0
    corrupt: int = 0
    #: records refused for want of a valid MAC under the fleet secret
    #: (forged, or written without the secret)
    unsigned: int = 0
    evictions: int = 0
    io_errors: int = 0
    #: times the tier went degraded (see lmcache_tiered.storage.tier)
    degradations: int = 0
    read_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass
class AdmissionStats:
    """What the rule did, and how well it guessed."""

    #: lookups with hits that the rule judged
    lookups_judged: int = 0
    #: of those, answered with a shorter prefix than was stored
    prefixes_shortened: int = 0
    #: stored chunks left for vLLM to recompute, and their tokens
    chunks_recomputed: int = 0
    tokens_recomputed: int = 0
    #: admitted prefixes whose delivery was then timed (from the lookup to the
    #: end of the read that took them; not those on a tier never measured),
    #: and whose estimate came within 25 % of it (the rule's GOOD_ESTIMATE),
    #: over it (too cautious: recomputes what would have been in time) or
    #: under it (too bold: vLLM waited past the recompute)
    estimates_checked: int = 0
    estimates_within: int = 0
    estimates_over: int = 0
    estimates_under: int = 0


@dataclass
class WarmupStats:
    """What a warm-up policy asked for and what it bought."""

    plans: int = 0
    keys_planned: int = 0
    bytes_promoted_hot: int = 0
    bytes_promoted_warm: int = 0
    #: promoted-to-hot bytes that a retrieve then took (before eviction)
    bytes_used: int = 0
    #: promoted chunks a retrieve (LMCache's, or the plugin's read of hot)
    #: then took from the hot tier
    timely: int = 0
    #: demand reads of a chunk whose promotion was still queued or running
    late: int = 0
    #: promotions to hot that left the CPU tier before any retrieve took them
    wasted: int = 0
    #: plan keys dropped: past their deadline, or already where they should be
    cancelled: int = 0
    #: plan keys skipped while the benefit guard held the policy back
    held_back: int = 0
    #: bytes of the promotions to hot counted in ``wasted``
    bytes_wasted: int = 0
    #: promotions to hot a lookup found and no retrieve took: vLLM's GPU
    #: prefix cache served those chunks (neither used nor wasted)
    gpu_served: int = 0
    #: planned chunks not promoted to hot: vLLM's GPU prefix cache serves them
    gpu_skipped: int = 0
    #: chunks already in LMCache's CPU tier pinned there for a plan
    pinned_in_place: int = 0
    #: bytes of those that a retrieve then took (not in ``bytes_used``,
    #: which counts what the promoter read)
    bytes_used_in_place: int = 0
    #: copies to warm a demand read then took from warm, and their bytes
    warm_used: int = 0
    bytes_used_warm: int = 0
    #: copies to warm evicted, or not read by their plan's deadline, and
    #: their bytes
    warm_wasted: int = 0
    bytes_wasted_warm: int = 0

    @property
    def precision(self) -> float | None:
        """Share of bytes promoted to hot that were used; None before any."""
        if not self.bytes_promoted_hot:
            return None
        return self.bytes_used / self.bytes_promoted_hot

    @property
    def precision_warm(self) -> float | None:
        """Share of the settled copies to warm (used or wasted), in bytes,
        that a demand read took; None before any settled."""
        settled = self.bytes_used_warm + self.bytes_wasted_warm
        return self.bytes_used_warm / settled if settled else None


def _counters(stats: type) -> tuple[str, ...]:
    """The integer fields of a stats dataclass: each one a Prometheus counter."""
    return tuple(f.name for f in fields(stats) if f.type in (int, "int"))


_TIER_COUNTERS = _counters(TierStats)
_ADMISSION_COUNTERS = _counters(AdmissionStats)
_WARMUP_COUNTERS = _counters(WarmupStats)


class TieredCollector(Collector):
    """Exposes every live backend's snapshot to Prometheus at scrape time.

    One collector per process (Prometheus refuses duplicate series); each
    backend adds itself with :func:`add_source` under a unique ``instance``
    label, so several backends in one process (benchmarks, tests) coexist.
    """

    def __init__(self) -> None:
        self._sources: dict[str, Callable[[], dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._serial = itertools.count()
        REGISTRY.register(self)

    def add_source(self, name: str, snapshot: Callable[[], dict[str, Any]]) -> str:
        """Start exporting ``snapshot()``; returns the instance label used."""
        with self._lock:
            label = (
                name if name not in self._sources else f"{name}-{next(self._serial)}"
            )
            self._sources[label] = snapshot
            return label

    def remove_source(self, label: str) -> None:
        with self._lock:
            self._sources.pop(label, None)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            sources = list(self._sources.items())
        snaps = [(label, snapshot()) for label, snapshot in sources]
        tier_labels = ["instance", "tier"]
        for name in _TIER_COUNTERS:
            family = CounterMetricFamily(
                f"lmcache_tiered_tier_{name}", f"{name} per tier", labels=tier_labels
            )
            for label, snap in snaps:
                for tier, stats in snap["tiers"].items():
                    family.add_metric([label, tier], stats[name])
            yield family
        used = GaugeMetricFamily(
            "lmcache_tiered_tier_used_bytes", "disk bytes held", labels=tier_labels
        )
        degraded = GaugeMetricFamily(
            "lmcache_tiered_tier_degraded",
            "1 while the tier is degraded (its I/O failing: skipped, probed)",
            labels=tier_labels,
        )
        refused = GaugeMetricFamily(
            "lmcache_tiered_tier_writes_refused",
            "1 while the tier refuses writes but serves reads (a full store)",
            labels=tier_labels,
        )
        latency = HistogramMetricFamily(
            "lmcache_tiered_tier_read_seconds", "chunk read latency", labels=tier_labels
        )
        for label, snap in snaps:
            for tier, stats in snap["tiers"].items():
                used.add_metric([label, tier], stats["used_bytes"])
                degraded.add_metric([label, tier], float(stats["degraded"] is not None))
                refusing = float(stats["writes_refused"] is not None)
                refused.add_metric([label, tier], refusing)
                histogram = stats["read_latency"]
                counts = itertools.accumulate(histogram["counts"])
                bounds = (*LATENCY_BOUNDS_S, float("inf"))
                buckets = [(str(b), c) for b, c in zip(bounds, counts, strict=True)]
                latency.add_metric([label, tier], buckets, histogram["total_s"])
        yield used
        yield degraded
        yield refused
        yield latency
        from_hot = CounterMetricFamily(
            "lmcache_tiered_reads_from_hot",
            "chunks demand reads took from LMCache's CPU tier, not disk",
            labels=["instance"],
        )
        for label, snap in snaps:
            from_hot.add_metric([label], snap["reads_from_hot"])
        yield from_hot
        for name in _WARMUP_COUNTERS:
            family = CounterMetricFamily(
                f"lmcache_tiered_warmup_{name}",
                f"warm-up {name}",
                labels=["instance", "policy"],
            )
            for label, snap in snaps:
                family.add_metric(
                    [label, snap["warmup"]["policy"]], snap["warmup"][name]
                )
            yield family
        for name in _ADMISSION_COUNTERS:
            family = CounterMetricFamily(
                f"lmcache_tiered_admission_{name}",
                f"read-time admission: {name}",
                labels=["instance"],
            )
            for label, snap in snaps:
                family.add_metric([label], snap["admission"][name])
            yield family


_collector: TieredCollector | None = None
_collector_lock = threading.Lock()


def collector() -> TieredCollector:
    """The process's collector, registered with Prometheus on first use."""
    global _collector
    with _collector_lock:
        if _collector is None:
            _collector = TieredCollector()
        return _collector
