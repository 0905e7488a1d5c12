"""Reading the benchmarks' command-line values (one owner for each rule, so
the command lines in :mod:`lmcache_tiered.cli` and the runs agree)."""

from __future__ import annotations


def split_list(text: str | None) -> list[str]:
    """A comma-separated option's non-empty parts."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]
