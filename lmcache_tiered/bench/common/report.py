"""What a bench run measured, and how it is shown: tables, summary line, the
seed's table over concurrencies, JSON (tables by rich; the picture is
:mod:`lmcache_tiered.bench.common.plot`'s, the progress bars
:mod:`lmcache_tiered.bench.common.progress`'s).

Times are production seconds, which the replay's clock is (it is not sped
up; only bytes are scaled down, see :mod:`lmcache_tiered.bench.model.devices`).
Bytes are the bytes this run really moved. With ``--repeat`` every number is
the median over the runs of a variant.

Per variant (a warm-up policy, or the stock-LMCache baseline):

- ``ttft_p50_s``/``ttft_p90_s``/``ttft_p99_s``: arrival to first token;
  ``queue_p50_s``: arrival to scheduling; ``load_p50_s``: lookup and load of
  the cached prefix (real I/O, on the production clock).
- ``throughput_rps``/``throughput_tps``: requests and generated tokens per
  second over the makespan (first arrival to last finish).
- ``hit_rate.{gpu,hot,warm,cold}``: share of all prompt chunks that were
  served from that tier (gpu: vLLM's GPU prefix cache; the rest were
  computed); ``lookup_hit_rate``: share the
  lookups found (more than served when reads fail).
- ``bytes_read.{hot,warm,cold}``: hot = bytes of chunks LMCache read from its
  CPU tier; warm/cold = everything the plugin's tier read (demand reads,
  warm-up, copies between tiers), or the stock disk backend's reads (with
  ``--loading prefetch``, those of vLLM's own share too).
- ``warmup_precision``/``warmup_timeliness``: share of bytes promoted to hot
  that a request then used; share of demand reads of promoted chunks that
  found them already promoted. Null where there was no warm-up.
- ``warmup_held_back``: planned chunks the benefit guard skipped (a policy
  whose promotions to hot go unused holds itself back). Null where nothing
  was planned.
- ``warmup_wasted_gb``/``warmup_kept_off_gb``: bytes read into hot that
  LMCache dropped unused; bytes promoted to hot (read, or pinned where they
  were) that a retrieve then took, which a drive would otherwise have read
  on the engine's path (production GB are these times ``kv_scale``). Null
  where nothing was planned.
- ``admission``: what read-time admission did (``NAME+admit`` variants;
  null without it): lookups judged and shortened, tokens sent to recompute,
  and the share of admitted prefixes whose delivery estimate came within
  25 % of their delivery, from the lookup to the end of the read
  (``estimates_good``, of ``estimates_checked``), and the shares whose
  estimate was over (too cautious) and under it (``estimates_over``,
  ``estimates_under``).
- ``backend_metrics``: the plugin's own ``metrics_snapshot()``.
- ``lag_max_s``: how far the replay fell behind its modelled GPU at worst
  (the loop woke late, e.g. on a busy machine); ``lag_share``: that as a
  share of the TTFT p50; ``device_overrun_share``: the share of the modelled
  device time by which real I/O ran over it (this machine's disk slower than
  the modelled drives at this F); ``valid``: the lag share at most
  :data:`VALID_SHARE`, the overrun at most :data:`VALID_OVERRUN`. An invalid
  variant measured this machine, not the product: its numbers are not
  compared.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from lmcache_tiered.bench.common import rules

#: Where a prompt chunk can come from: vLLM's GPU prefix cache, then LMCache.
TIERS = ("gpu", "hot", "warm", "cold")
#: Tiers whose bytes are read (the GPU's are reused in place).
READ_TIERS = TIERS[1:]
#: Most lag (share of TTFT p50) a variant may have and still be compared.
VALID_SHARE = 0.05
#: Most device overrun (share of modelled device time). Overrun counts all
#: real time of a tier call past the modelled transfer, its CPU too (charged
#: once, as it should be): the default run gave 4-5 % at both F = 16 and 32
#: with TTFTs within 1 % of each other, so that much is per-call cost, not a
#: disk too slow for the model; a disk that could not keep up gave 59-84 %.
VALID_OVERRUN = 0.10


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
    #: chunks LMCache read per tier (``lmcache server`` reads the GPU's share
    #: too: more than served)
    read: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class RunResult:
    """Everything measured for one variant."""

    name: str
    records: list[RequestRecord]
    #: chunk bytes of one full chunk (to turn chunks read into bytes)
    chunk_bytes: int
    #: bytes read per lower tier as the tiers count them; None: count chunks
    tier_bytes_read: dict[str, int] | None
    #: the plugin's ``metrics_snapshot()`` (empty for the baseline), for the JSON
    backend_metrics: dict[str, Any]
    warmup_precision: float | None
    warmup_timeliness: float | None
    warmup_held_back: int | None
    wall_s: float
    #: most seconds the replay ran behind its GPU clock
    lag_max: float = 0.0
    #: the worst of its devices' overrun shares (:class:`Device`)
    device_overrun: float = 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0-100) of a non-empty list."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ttfts(result: RunResult) -> list[float]:
    """The TTFT of every request."""
    return [r.first_token - r.arrival for r in result.records]


def summarize(result: RunResult) -> dict[str, Any]:
    """The JSON entry ``policies.<name>`` of one variant."""
    records = result.records
    ttft = ttfts(result)
    makespan = max(r.finished for r in records) - min(r.arrival for r in records)
    chunks = sum(r.prompt_chunks for r in records) or 1
    served = {t: sum(r.served.get(t, 0) for r in records) for t in TIERS}
    found = sum(sum(r.found.values()) for r in records)
    read = {t: sum(r.read.get(t, 0) for r in records) for t in READ_TIERS}
    bytes_read = {t: read[t] * result.chunk_bytes for t in READ_TIERS}
    if result.tier_bytes_read is not None:
        bytes_read.update(result.tier_bytes_read)
    return {
        "requests": len(records),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "queue_p50_s": percentile([r.scheduled - r.arrival for r in records], 50),
        "load_p50_s": percentile([r.loaded - r.scheduled for r in records], 50),
        "throughput_rps": len(records) / makespan,
        "throughput_tps": sum(r.output_length for r in records) / makespan,
        "makespan_s": makespan,
        "hit_rate": {t: served[t] / chunks for t in TIERS},
        "lookup_hit_rate": found / chunks,
        "bytes_read": bytes_read,
        "warmup_precision": result.warmup_precision,
        "warmup_timeliness": result.warmup_timeliness,
        "warmup_held_back": result.warmup_held_back,
        **rules.warmup_bytes(result.backend_metrics.get("warmup") or {}),
        "admission": rules.admission(result.backend_metrics.get("admission") or {}),
        "backend_metrics": result.backend_metrics,
        "wall_s": result.wall_s,
        **run_validity(result),
    }


def run_validity(result: RunResult) -> dict[str, Any]:
    """:func:`validity` of one run, from its own lag, TTFTs and overrun."""
    ttft_p50 = percentile(ttfts(result), 50)
    return validity(result.lag_max, ttft_p50, result.device_overrun)


def validity(lag_s: float, ttft_p50_s: float, overrun: float) -> dict[str, Any]:
    """The lag and overrun figures of a run and whether it may be compared."""
    share = lag_s / max(ttft_p50_s, 1e-9)
    return {
        "lag_max_s": lag_s,
        "lag_share": share,
        "device_overrun_share": overrun,
        "valid": share <= VALID_SHARE and overrun <= VALID_OVERRUN,
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
    # a variant is as valid as its worst run
    for key in ("lag_max_s", "lag_share", "device_overrun_share"):
        combined[key] = max(s[key] for s in summaries)
    combined["valid"] = all(s["valid"] for s in summaries)
    if len(summaries) == 1:
        combined["backend_metrics"] = summaries[0]["backend_metrics"]
    else:
        combined["per_run"] = {key: [s[key] for s in summaries] for key in PER_RUN}
        combined["backend_metrics"] = [s["backend_metrics"] for s in summaries]
    return combined


def _median_tree(values: Sequence[Any]) -> Any:
    """The median of each number in a tree of mappings (None: no run had it)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if isinstance(present[0], Mapping):
        return {key: _median_tree([v[key] for v in present]) for key in present[0]}
    return percentile(present, 50)


def _waste_kept(summary: Mapping[str, Any]) -> str:
    wasted, kept = summary.get("warmup_wasted_gb"), summary.get("warmup_kept_off_gb")
    return "-" if wasted is None or kept is None else f"{wasted:.2f}/{kept:.2f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _change(value: float, base: float | None) -> float | None:
    return None if base is None or base == 0 else value / base - 1.0


def delta(value: float, base: float | None) -> str:
    change = _change(value, base)
    return "-" if change is None else f"{100.0 * change:+.0f}%"


def render(table: Table) -> str:
    """A rich table as plain text at its natural width, so a row stays one
    line in a log file or a narrow terminal."""
    console = Console(file=io.StringIO(), width=400, color_system=None)
    console.print(table)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.splitlines())


def numbers_table(*columns: str) -> Table:
    """A table whose first column is left-aligned text, the others numbers."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column(columns[0])
    for column in columns[1:]:
        table.add_column(column, justify="right")
    return table


def table(summaries: Mapping[str, Mapping[str, Any]], reference: str) -> str:
    """One row per variant; changes against ``reference``, none for a
    variant (or against a reference) that is not valid."""
    base = summaries.get(reference)
    usable = base is not None and base["valid"]
    out = numbers_table(
        "variant",
        "TTFT p50",
        "p90",
        "p99",
        "req/s",
        "tok/s",
        "hit gpu/hot/warm/cold",
        "GB read warm/cold",
        "prec",
        "timely",
        "GB waste/kept off",
        "of bound",
        "lag/overrun",
        f"dTTFT50 vs {reference}",
        f"dtok/s vs {reference}",
    )
    for name, s in summaries.items():
        hits = "/".join(f"{100 * s['hit_rate'][t]:.0f}" for t in TIERS) + " %"
        read = "/".join(f"{s['bytes_read'][t] / 1e9:.2f}" for t in ("warm", "cold"))
        if not s["valid"]:
            changes = ["not valid", "not valid"]
        elif not usable or name == reference:
            changes = ["-", "-"]
        else:
            assert base is not None
            changes = [
                delta(s["ttft_p50_s"], base["ttft_p50_s"]),
                delta(s["throughput_tps"], base["throughput_tps"]),
            ]
        share = s.get("bound_share")
        out.add_row(
            name,
            f"{s['ttft_p50_s']:.2f}s",
            f"{s['ttft_p90_s']:.2f}s",
            f"{s['ttft_p99_s']:.2f}s",
            f"{s['throughput_rps']:.2f}",
            f"{s['throughput_tps']:.0f}",
            hits,
            read,
            _fmt(s["warmup_precision"], ".2f"),
            _fmt(s["warmup_timeliness"], ".2f"),
            _waste_kept(s),
            "-" if share is None else f"{100 * share:.0f}%",
            f"{100 * s['lag_share']:.0f}/{100 * s['device_overrun_share']:.0f}%",
            *changes,
        )
    return render(out)


def bound_shares(
    summaries: Mapping[str, Mapping[str, Any]],
    contenders: Sequence[str],
    none: str,
    bound: str,
) -> dict[str, float]:
    """Per contender, the share of the bound's TTFT p50 gain over ``none``
    that it captures (1: as good as the bound; 0: no better than none);
    empty where either did not run validly or the bound gains nothing."""
    low, high = summaries.get(bound), summaries.get(none)
    if low is None or high is None or not (low["valid"] and high["valid"]):
        return {}
    gain = high["ttft_p50_s"] - low["ttft_p50_s"]
    if gain <= 0:
        return {}
    return {
        name: (high["ttft_p50_s"] - summaries[name]["ttft_p50_s"]) / gain
        for name in contenders
        if name in summaries and summaries[name]["valid"]
    }


def summary_line(
    summaries: Mapping[str, Mapping[str, Any]],
    compared: str,
    contenders: Sequence[str],
    reference: str,
    beside: Sequence[str],
) -> str | None:
    """One line: what was compared (``compared``), the best valid contender's
    TTFT p50 and tok/s against ``reference``, the variants of ``beside``
    (the stock backend, the bound) against it too, and what that means.
    None where there is nothing to compare."""
    base = summaries.get(reference)
    ran = [n for n in contenders if n in summaries]
    if base is None or not ran:
        return None
    head = f"summary: {compared}."
    if not base["valid"]:
        return f"{head} Not compared: {reference}'s run is not valid (see below)."
    valid = [n for n in ran if summaries[n]["valid"]]
    if not valid:
        return f"{head} Not compared: no tiered variant's run is valid (see below)."
    best = min(valid, key=lambda name: summaries[name]["ttft_p50_s"])
    s = summaries[best]
    ttft = _change(s["ttft_p50_s"], base["ttft_p50_s"]) or 0.0
    tps = _change(s["throughput_tps"], base["throughput_tps"]) or 0.0
    if ttft < 0 and tps >= 0:
        meaning = f"{best} serves first tokens sooner and at least as many tok/s"
    elif ttft >= 0 and tps <= 0:
        meaning = f"{reference} wins here: {why_it_loses(s, base)}"
    else:
        meaning = "a trade: one number better, the other worse"
    others = "".join(
        f"; {name} {summaries[name]['ttft_p50_s']:.2f}s "
        f"({delta(summaries[name]['ttft_p50_s'], base['ttft_p50_s'])}), "
        f"{summaries[name]['throughput_tps']:.0f} tok/s"
        + ("" if summaries[name]["valid"] else " (not valid)")
        for name in beside
        if name in summaries
    )
    return (
        f"{head} Best tiered variant {best}: TTFT p50 "
        f"{s['ttft_p50_s']:.2f}s vs {base['ttft_p50_s']:.2f}s {reference} "
        f"({100 * ttft:+.0f}%), {s['throughput_tps']:.0f} vs "
        f"{base['throughput_tps']:.0f} tok/s ({100 * tps:+.0f}%){others}: {meaning}."
    )


def why_it_loses(mine: Mapping[str, Any], base: Mapping[str, Any]) -> str:
    """Why a cache did not beat vLLM alone, from what the runs measured."""
    lmcache = sum(mine["hit_rate"][t] for t in READ_TIERS)
    extra = mine["hit_rate"]["gpu"] + lmcache - base["hit_rate"]["gpu"]
    if extra <= 0.01:
        held = 100 * base["hit_rate"]["gpu"]
        return (
            f"vLLM's own GPU cache already held the reuse ({held:.0f}% of prompt "
            "chunks), so LMCache had nothing more to serve"
        )
    return (
        f"LMCache served {100 * lmcache:.0f}% of prompt chunks, but loading them "
        f"(load p50 {mine['load_p50_s']:.2f}s a request) cost more than "
        "recomputing them on the GPU"
    )


#: Numbers compared run by run against the reference by :func:`paired_changes`.
#: (The mean is steadier than the median where the TTFT distribution has a
#: step near it: some requests wait for a slot, others do not.)
PAIRED = {
    "TTFT p50": "ttft_p50_s",
    "TTFT p90": "ttft_p90_s",
    "TTFT mean": "ttft_mean_s",
    "tok/s": "throughput_tps",
}


def run_values(summary: Mapping[str, Any], key: str) -> list[float]:
    """A number of :data:`PER_RUN`, run by run: the repeated variant's
    ``per_run`` list, or the one run's value."""
    per_run = summary.get("per_run")
    return list(per_run[key]) if per_run else [summary[key]]


def paired(
    summary: Mapping[str, Any], base: Mapping[str, Any], key: str
) -> list[float]:
    """The relative change of ``key`` against ``base``, run i against run i
    (interleaved runs share the machine's state)."""
    return [
        value / ref - 1.0
        for value, ref in zip(
            run_values(summary, key), run_values(base, key), strict=False
        )
        if ref
    ]


def paired_changes(
    summaries: Mapping[str, Mapping[str, Any]], reference: str = "none"
) -> dict[str, dict[str, list[float]]]:
    """Per variant and number of :data:`PAIRED`, the relative change against
    ``reference`` run by run (:func:`paired`). Empty without repeats."""
    base = summaries.get(reference)
    if base is None or "per_run" not in base:
        return {}
    return {
        name: {key: paired(s, base, key) for key in PAIRED.values()}
        for name, s in summaries.items()
        if name != reference and "per_run" in s
    }


#: The seed's table's numbers per variant and concurrency, and those of them
#: also given as the change against each reference.
SEED_NUMBERS = {
    "TTFT p50": "ttft_p50_s",
    "p90": "ttft_p90_s",
    "tok/s": "throughput_tps",
}
SEED_CHANGES = {"TTFT p50": "ttft_p50_s", "tok/s": "throughput_tps"}


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, lowest and highest of the runs' ``values``; None for none."""
    if not values:
        return None
    return {
        "median": percentile(list(values), 50),
        "min": min(values),
        "max": max(values),
    }


def spread_text(
    spread: Mapping[str, float] | None,
    show: Callable[[float], str],
    unit: str = "",
    ranged: bool = True,
) -> str:
    """A :func:`spread` as median (lowest..highest), or the median alone
    where not ``ranged`` (one run); "-" for none."""
    if spread is None:
        return "-"
    text = show(spread["median"]) + unit
    if not ranged:
        return text
    return f"{text} ({show(spread['min'])}..{show(spread['max'])})"


def _percent(change: float) -> str:
    return f"{100 * change:+.0f}"


def _seconds(value: float) -> str:
    return f"{value:.2f}"


def _tokens(value: float) -> str:
    return f"{value:.0f}"


def spread_table(changes: Mapping[str, Mapping[str, Sequence[float]]]) -> str:
    """The paired changes as median (lowest..highest) per variant: a change
    whose range spans zero is within the run-to-run noise."""
    out = numbers_table("change vs none, paired runs", *PAIRED)
    for name, by_key in changes.items():
        out.add_row(
            name,
            *(spread_text(spread(by_key[k]), _percent, "%") for k in PAIRED.values()),
        )
    return render(out)


def seed_rows(
    by_concurrency: Mapping[int, Mapping[str, Mapping[str, Any]]],
    references: Sequence[str],
) -> list[dict[str, Any]]:
    """The seed's table as data (the JSON's ``seed_table``): one row per
    variant and concurrency, variants in their first run's order; each of
    :data:`SEED_NUMBERS` as median, min and max over the runs, and each of
    :data:`SEED_CHANGES` as the paired change against each of ``references``
    that ran at that concurrency (None for the reference itself)."""
    names = list(dict.fromkeys(n for s in by_concurrency.values() for n in s))
    rows = []
    for name in names:
        for concurrency, summaries in by_concurrency.items():
            if name not in summaries:
                continue
            s = summaries[name]
            row: dict[str, Any] = {
                "variant": name,
                "concurrency": concurrency,
                "runs": s["runs"],
                "valid": s["valid"],
            }
            for key in SEED_NUMBERS.values():
                row[key] = spread(run_values(s, key))
            row["change_vs"] = {
                ref: None
                if ref == name or ref not in summaries
                else {
                    key: spread(paired(s, summaries[ref], key))
                    for key in SEED_CHANGES.values()
                }
                for ref in references
            }
            rows.append(row)
    return rows


def seed_table(rows: Sequence[Mapping[str, Any]], references: Sequence[str]) -> str:
    """:func:`seed_rows` as text: median (lowest..highest) over the runs."""
    out = numbers_table(
        "variant",
        "concurrency",
        *SEED_NUMBERS,
        *(f"{label} vs {ref}" for ref in references for label in SEED_CHANGES),
    )
    for row in rows:
        ranged = row["runs"] > 1
        cells = [
            spread_text(row[key], show, unit, ranged)
            for key, show, unit in (
                ("ttft_p50_s", _seconds, "s"),
                ("ttft_p90_s", _seconds, "s"),
                ("throughput_tps", _tokens, ""),
            )
        ]
        for ref in references:
            changes = row["change_vs"][ref] or {}
            cells += [
                spread_text(changes.get(key), _percent, "%", ranged)
                if row["valid"]
                else "not valid"
                for key in SEED_CHANGES.values()
            ]
        out.add_row(row["variant"], str(row["concurrency"]), *cells)
    return render(out)


def write_json(path: str, document: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        json.dump(document, out, indent=2, sort_keys=False)
        out.write("\n")
