"""What the subcommands' command lines share: the workload options of
``bench`` and ``serve-bench`` (what they mean is
:func:`lmcache_tiered.bench.model.scenario.load_requests`), comma lists, and the
arguments that name a tier's files (``inspect``, ``fsck``)."""

from __future__ import annotations

import argparse

from lmcache_tiered.bench.common import trace


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


def add_tier_arguments(parser: argparse.ArgumentParser, nargs: str) -> None:
    """A tier's directories (``nargs`` of them: ``+``, or ``*`` where another
    option can name them) and ``--owner``."""
    parser.add_argument(
        "paths",
        nargs=nargs,
        help="the tier's directories, in tiered.<tier>.paths order",
    )
    parser.add_argument("--owner", help="only this owner's files (e.g. kv-w0)")
