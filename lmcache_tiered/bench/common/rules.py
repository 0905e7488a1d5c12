"""What the plugin's own rules did in a bench run, in figures: warm-up's
precision, timeliness, what it held back, wasted and kept off the drives;
read-time admission's shortened lookups and how well it guessed. Read from
the plugin's ``metrics_snapshot()`` (:mod:`lmcache_tiered.metrics`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def warmup_quality(
    metrics: dict[str, Any],
) -> tuple[float | None, float | None, int | None]:
    """(precision, timeliness, held back) of the warm-up, None where there
    was none.

    Precision = promoted-to-hot bytes used / promoted; timeliness = timely /
    (timely + late) demand reads of promoted chunks; held back = planned
    chunks the benefit guard skipped (see
    :class:`lmcache_tiered.metrics.WarmupStats`).
    """
    warmup = metrics.get("warmup") or {}
    demanded = warmup.get("timely", 0) + warmup.get("late", 0)
    timeliness = warmup["timely"] / demanded if demanded else None
    held_back = warmup["held_back"] if warmup.get("plans") else None
    return warmup.get("precision"), timeliness, held_back


def warmup_bytes(warmup: Mapping[str, Any]) -> dict[str, float | None]:
    """GB the warm-up wasted and kept off the drives (None without plans)."""
    planned = bool(warmup.get("plans"))
    return {
        "warmup_wasted_gb": warmup["bytes_wasted"] / 1e9 if planned else None,
        "warmup_kept_off_gb": (warmup["bytes_used"] + warmup["bytes_used_in_place"])
        / 1e9
        if planned
        else None,
    }


def admission(stats: Mapping[str, Any]) -> dict[str, float | None] | None:
    """What read-time admission did (None where it judged nothing)."""
    if not stats.get("lookups_judged"):
        return None
    checked = stats["estimates_checked"]
    return {
        "lookups_judged": stats["lookups_judged"],
        "prefixes_shortened": stats["prefixes_shortened"],
        "tokens_recomputed": stats["tokens_recomputed"],
        "estimates_checked": checked,
        "estimates_good": stats["estimates_within"] / checked if checked else None,
        "estimates_over": stats["estimates_over"] / checked if checked else None,
        "estimates_under": stats["estimates_under"] / checked if checked else None,
    }


def admission_lines(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per variant whose read-time admission judged lookups."""
    return [
        admission_line(name, rule)
        for name, summary in summaries.items()
        if (rule := summary.get("admission")) is not None
    ]


def admission_line(name: str, rule: Mapping[str, Any]) -> str:
    """What read-time admission did in variant ``name`` (:func:`admission`)."""
    line = (
        f"{name}: read-time admission shortened {rule['prefixes_shortened']:.0f} "
        f"of {rule['lookups_judged']:.0f} lookups with hits, "
        f"{rule['tokens_recomputed']:,.0f} stored tokens recomputed; delivery "
        f"estimate within 25 % of the read for "
    )
    if rule["estimates_good"] is None:
        return line + "- of 0 admitted reads"
    return line + (
        f"{100 * rule['estimates_good']:.0f} % of {rule['estimates_checked']:.0f} "
        f"admitted reads ({100 * rule['estimates_over']:.0f} % over, "
        f"{100 * rule['estimates_under']:.0f} % under)"
    )
