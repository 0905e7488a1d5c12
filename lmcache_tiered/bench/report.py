"""What a bench run measured, and how it is shown: table, JSON, plot, progress.

Times in summaries are production seconds: the replay's GPU-clock times
multiplied by the clock factor (see :mod:`lmcache_tiered.bench.profiles`).
Bytes are the bytes this run really moved. With ``--repeat`` every number is
the median over the runs of a variant.

Per variant (a warm-up policy, or the stock-LMCache baseline):

- ``ttft_p50_s``/``ttft_p90_s``/``ttft_p99_s``: arrival to first token;
  ``queue_p50_s``: arrival to scheduling; ``load_p50_s``: lookup and load of
  the cached prefix (real I/O, on the production clock).
- ``throughput_rps``/``throughput_tps``: requests and generated tokens per
  second over the makespan (first arrival to last finish).
- ``hit_rate.{hot,warm,cold}``: share of all prompt chunks that were served
  from that tier (the rest were computed); ``lookup_hit_rate``: share the
  lookups found (more than served when reads fail).
- ``bytes_read.{hot,warm,cold}``: hot = bytes of chunks served from LMCache's
  CPU tier; warm/cold = everything the plugin's tier read (demand reads,
  warm-up, copies between tiers), or the stock disk backend's demand reads.
- ``warmup_precision``/``warmup_timeliness``: share of bytes promoted to hot
  that a request then used; share of demand reads of promoted chunks that
  found them already promoted. Null where there was no warm-up.
- ``backend_metrics``: the plugin's own ``metrics_snapshot()``.
- ``lag_max_s``: how far the replay fell behind its modelled GPU at worst
  (real work slower than modelled, e.g. on a busy machine).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

TIERS = ("hot", "warm", "cold")


@dataclass(slots=True)
class RequestRecord:
    """One request's life on the replay's GPU clock (seconds since the start)."""

    arrival: float
    #: taken from the queue (then looked up)
    scheduled: float
    #: its cached prefix loaded (retrieve done)
    loaded: float
    first_token: float
    finished: float
    input_length: int
    output_length: int
    prompt_chunks: int
    #: prompt chunks the lookup found, per tier (``TIERS``)
    found: dict[str, int] = field(default_factory=dict)
    #: of those, the chunks then loaded (a read can fail, e.g. for memory)
    served: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class RunResult:
    """Everything measured for one variant."""

    name: str
    records: list[RequestRecord]
    #: chunk bytes of one full chunk (to turn served chunks into bytes)
    chunk_bytes: int
    #: bytes read per lower tier as the tiers count them; None: count chunks
    tier_bytes_read: dict[str, int] | None
    #: the plugin's ``metrics_snapshot()`` (empty for the baseline), for the JSON
    backend_metrics: dict[str, Any]
    warmup_precision: float | None
    warmup_timeliness: float | None
    wall_s: float
    #: most wall seconds the replay ran behind its GPU clock
    lag_max: float = 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0-100) of a non-empty list."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ttfts(result: RunResult, clock: float) -> list[float]:
    """Production-second TTFT of every request."""
    return [(r.first_token - r.arrival) * clock for r in result.records]


def _p50(values: Sequence[float], clock: float) -> float:
    return percentile(values, 50) * clock


def summarize(result: RunResult, clock: float) -> dict[str, Any]:
    """The JSON entry ``policies.<name>`` of one variant."""
    records = result.records
    ttft = ttfts(result, clock)
    span = max(r.finished for r in records) - min(r.arrival for r in records)
    makespan = span * clock
    chunks = sum(r.prompt_chunks for r in records) or 1
    served = {t: sum(r.served.get(t, 0) for r in records) for t in TIERS}
    found = sum(sum(r.found.values()) for r in records)
    bytes_read = {t: served[t] * result.chunk_bytes for t in TIERS}
    if result.tier_bytes_read is not None:
        bytes_read.update(result.tier_bytes_read)
    return {
        "requests": len(records),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "queue_p50_s": _p50([r.scheduled - r.arrival for r in records], clock),
        "load_p50_s": _p50([r.loaded - r.scheduled for r in records], clock),
        "throughput_rps": len(records) / makespan,
        "throughput_tps": sum(r.output_length for r in records) / makespan,
        "makespan_s": makespan,
        "hit_rate": {t: served[t] / chunks for t in TIERS},
        "lookup_hit_rate": found / chunks,
        "bytes_read": bytes_read,
        "warmup_precision": result.warmup_precision,
        "warmup_timeliness": result.warmup_timeliness,
        "backend_metrics": result.backend_metrics,
        "wall_s": result.wall_s,
        "lag_max_s": result.lag_max * clock,
    }


#: Numbers also listed run by run in a repeated variant's entry (the spread).
PER_RUN = (
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_mean_s",
    "throughput_rps",
    "throughput_tps",
)


def combine(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One entry from repeated runs: the median of every number (None where
    no run had one); with several runs, the headline numbers of each run
    (``per_run``) and each run's backend metrics as a list."""
    combined = _median_tree(
        [{k: v for k, v in s.items() if k != "backend_metrics"} for s in summaries]
    )
    combined["runs"] = len(summaries)
    if len(summaries) == 1:
        combined["backend_metrics"] = summaries[0]["backend_metrics"]
    else:
        combined["per_run"] = {key: [s[key] for s in summaries] for key in PER_RUN}
        combined["backend_metrics"] = [s["backend_metrics"] for s in summaries]
    return combined


def _median_tree(values: Sequence[Any]) -> Any:
    if isinstance(values[0], Mapping):
        return {key: _median_tree([v[key] for v in values]) for key in values[0]}
    numbers = [v for v in values if v is not None]
    return percentile(numbers, 50) if numbers else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _delta(value: float, base: float | None) -> str:
    if base is None or base == 0:
        return "-"
    return f"{100.0 * (value / base - 1.0):+.0f}%"


def table(summaries: Mapping[str, Mapping[str, Any]], reference: str = "none") -> str:
    """Fixed-width text table, one row per variant; deltas against ``reference``."""
    base = summaries.get(reference)
    base_ttft = None if base is None else base["ttft_p50_s"]
    base_tps = None if base is None else base["throughput_tps"]
    header = (
        f"{'variant':<20} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'req/s':>7} "
        f"{'tok/s':>7} {'hit hot/warm/cold':>18} {'GB read warm/cold':>18} "
        f"{'prec':>5} {'timely':>6} {'dTTFT50':>8} {'dtok/s':>7}"
    )
    rows = [header, "-" * len(header)]
    for name, s in summaries.items():
        hits = "/".join(f"{100 * s['hit_rate'][t]:.0f}" for t in TIERS) + " %"
        read = "/".join(f"{s['bytes_read'][t] / 1e9:.2f}" for t in ("warm", "cold"))
        rows.append(
            f"{name:<20} {s['ttft_p50_s']:>8.2f}s {s['ttft_p90_s']:>7.2f}s "
            f"{s['ttft_p99_s']:>7.2f}s {s['throughput_rps']:>7.2f} "
            f"{s['throughput_tps']:>7.0f} {hits:>18} {read:>18} "
            f"{_fmt(s['warmup_precision'], '.2f'):>5} "
            f"{_fmt(s['warmup_timeliness'], '.2f'):>6} "
            f"{_delta(s['ttft_p50_s'], base_ttft):>8} "
            f"{_delta(s['throughput_tps'], base_tps):>7}"
        )
    return "\n".join(rows)


#: Numbers compared run by run against the reference by :func:`paired_changes`.
#: (The mean is steadier than the median where the TTFT distribution has a
#: step near it: some requests wait for a slot, others do not.)
PAIRED = {
    "TTFT p50": "ttft_p50_s",
    "TTFT p90": "ttft_p90_s",
    "TTFT mean": "ttft_mean_s",
    "tok/s": "throughput_tps",
}


def paired_changes(
    summaries: Mapping[str, Mapping[str, Any]], reference: str = "none"
) -> dict[str, dict[str, list[float]]]:
    """Per variant and number of :data:`PAIRED`, the relative change against
    ``reference`` run by run (run i of each against run i of the reference:
    interleaved runs share the machine's state). Empty without repeats."""
    base = summaries.get(reference)
    if base is None or "per_run" not in base:
        return {}
    changes: dict[str, dict[str, list[float]]] = {}
    for name, s in summaries.items():
        if name == reference or "per_run" not in s:
            continue
        changes[name] = {
            key: [
                value / ref - 1.0
                for value, ref in zip(
                    s["per_run"][key], base["per_run"][key], strict=False
                )
                if ref
            ]
            for key in PAIRED.values()
        }
    return changes


def spread_table(changes: Mapping[str, Mapping[str, Sequence[float]]]) -> str:
    """The paired changes as median (lowest..highest) per variant: a change
    whose range spans zero is within the run-to-run noise."""

    def cell(values: Sequence[float]) -> str:
        if not values:
            return "-"
        median = percentile(list(values), 50)
        return (
            f"{100 * median:+.0f}% ({100 * min(values):+.0f}..{100 * max(values):+.0f})"
        )

    header = f"{'change vs none, paired runs':<28}" + "".join(
        f"{label:>20}" for label in PAIRED
    )
    rows = [header, "-" * len(header)]
    for name, by_key in changes.items():
        rows.append(
            f"{name:<28}" + "".join(f"{cell(by_key[k]):>20}" for k in PAIRED.values())
        )
    return "\n".join(rows)


def write_json(path: str, document: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        json.dump(document, out, indent=2, sort_keys=False)
        out.write("\n")


def plot_available() -> bool:
    """Whether matplotlib (the optional ``plot`` extra) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(
    path: str,
    runs: Mapping[str, Sequence[RunResult]],
    summaries: Mapping[str, Mapping[str, Any]],
    clock: float,
) -> None:
    """TTFT CDF per variant, all its runs pooled (left), and token throughput
    bars (right) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, results in runs.items():
        values = sorted(t for result in results for t in ttfts(result, clock))
        shares = [(i + 1) / len(values) for i in range(len(values))]
        cdf.step(values, shares, where="post", label=name)
    cdf.set_xlabel("TTFT (s, production-equivalent)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT CDF")
    cdf.grid(alpha=0.3)
    cdf.legend()
    names = list(summaries)
    bars.bar(names, [summaries[n]["throughput_tps"] for n in names])
    bars.set_ylabel("generated tokens / s")
    bars.set_title("Throughput")
    bars.tick_params(axis="x", labelrotation=30)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


class Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second
    on a terminal; elsewhere (a log file) only its final state is written."""

    WIDTH = 30

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.started = time.monotonic()
        self._drawn = 0.0
        if self.live:
            self._draw()

    def advance(self, count: int = 1) -> None:
        self.done += count
        if self.live and time.monotonic() - self._drawn >= 0.1:
            self._draw()

    def _draw(self) -> None:
        self._drawn = time.monotonic()
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(
            f"\r{self.label:<28} [{bar}] {self.done}/{self.total} "
            f"{self._drawn - self.started:5.1f}s"
        )
        self.stream.flush()

    def close(self, note: str = "") -> None:
        self._draw()
        self.stream.write(f" {note}\n")
        self.stream.flush()
