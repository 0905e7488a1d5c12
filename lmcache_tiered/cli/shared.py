"""What the command lines of ``bench`` and ``serve-bench`` share: the
workload options (what they mean is
:func:`lmcache_tiered.bench.scenario.load_requests`) and comma lists."""

from __future__ import annotations

import argparse

from lmcache_tiered.bench import trace


def add_workload_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """The options :func:`load_requests` reads (bench and serve-bench)."""
    load = parser.add_argument_group("workload")
    load.add_argument(
        "--trace",
        metavar="FILE",
        help="Mooncake JSON-lines trace (default: the built-in generator)",
    )
    load.add_argument(
        "--workload",
        choices=list(trace.WORKLOADS),
        default=default,
        help=f"built-in workload when no --trace is given (default: {default})",
    )
    load.add_argument(
        "--limit", type=int, metavar="N", help="replay only the first N requests"
    )
    load.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply arrival and think times; < 1 is more load (default: 1)",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="generator and token seed (default: 0)"
    )


def split_list(text: str | None) -> list[str]:
    """A comma-separated option's non-empty parts."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]
