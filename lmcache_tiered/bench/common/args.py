"""Reading the benchmarks' command-line values (one owner for each rule, so
the command lines in :mod:`lmcache_tiered.cli` and the runs agree)."""

from __future__ import annotations


def split_list(text: str | None) -> list[str]:
    """A comma-separated option's non-empty parts."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


#: The name a command line gives for a Mooncake pool of the benchmark's own
#: (:mod:`lmcache_tiered.bench.common.stores`), said here, where the command
#: lines can read it without importing Mooncake.
OWN_MOONCAKE = "mooncake"
