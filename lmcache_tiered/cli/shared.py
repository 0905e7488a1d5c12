"""What the subcommands' command lines share: the workload options of
``bench`` and ``serve-bench`` (what they mean is
:func:`lmcache_tiered.bench.model.scenario.load_requests`), comma lists, the
arguments that name a tier's files (``inspect``, ``fsck``), and how a
benchmark's store is named (``bench --cold-adapter``, ``diskbench --store``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from lmcache_tiered.bench.common import trace
from lmcache_tiered.bench.common.args import OWN_MOONCAKE
from lmcache_tiered.config import SETTINGS, ConfigError


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


def store_arg(option: str) -> Callable[[str], dict[str, Any] | str]:
    """How ``option`` reads a store: the JSON LMCache's ``--l2-adapter``
    takes, checked as ``tiered.cold.adapter`` is, or ``mooncake``, a pool the
    benchmark starts itself (:mod:`lmcache_tiered.bench.common.stores`)."""

    def parse(text: str) -> dict[str, Any] | str:
        if text == OWN_MOONCAKE:
            return text
        try:
            spec: dict[str, Any] = SETTINGS["cold.adapter"].parse(option, text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return spec

    return parse
