"""``lmcache-tiered soak``: the plugin under load for hours, faults injected
on a schedule, and a pass/fail line at the end.

A worker process (:mod:`lmcache_tiered.soak.worker`) runs the plugin in a
real LMCache engine and checks every byte it is served. On its schedule the
soak kills the worker with SIGKILL and starts a new one on the same
directories (every acknowledged chunk must then be served exact), stops,
kills or fills the cold store (a redis-server or a Mooncake pool of its own,
written through) and brings it back, and has the worker damage a record on
disk (a miss, never wrong bytes). It samples the worker's RSS, open files
and threads, and draws them with the faults (:mod:`lmcache_tiered.soak.report`).

    lmcache-tiered soak --duration 72h --faults kill=1h,store=20m,damage=5m

With ``--mp`` the process under test is ``lmcache server`` with
``TieredL2Adapter``, driven through LMCache's multi-process client
(:mod:`lmcache_tiered.soak.mp_client`); the faults and the verdict are the same.

May touch: the directories it is given (``--dir``, ``--warm``), removed at
the end unless given; the redis-server it starts; the report files it is told.
"""

from __future__ import annotations

import argparse
import re

SUMMARY = "run the plugin for hours under faults; pass/fail at the end"
RUN = "lmcache_tiered.soak.command:run"
#: Fault kinds and the schedule a run gets unless told (period of each).
FAULT_KINDS = ("kill", "store", "damage")
DEFAULT_FAULTS = "kill=10m,store=7m,damage=2m"
_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str, what: str) -> float:
    """Seconds in ``90s``, ``10m``, ``72h`` or a bare number of seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{what}: {text!r} is not a duration (like 90s, 10m, 72h)"
        )
    return float(match[1]) * _UNITS[match[2] or "s"]


def parse_faults(text: str) -> dict[str, float]:
    """``kill=10m,store=7m`` -> period of each fault kind; ``none`` for none."""
    if text.strip() == "none":
        return {}
    periods = {}
    for item in text.split(","):
        kind, _, period = item.partition("=")
        if kind.strip() not in FAULT_KINDS or not period:
            raise argparse.ArgumentTypeError(
                f"--faults: {item!r}: expected KIND=PERIOD with KIND one of "
                f"{', '.join(FAULT_KINDS)} (e.g. {DEFAULT_FAULTS}), or none"
            )
        periods[kind.strip()] = parse_duration(period, f"--faults {kind}")
    return periods


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration",
        type=lambda t: parse_duration(t, "--duration"),
        default=parse_duration("10m", "--duration"),
        help="how long to run (90s, 10m, 72h; default 10m)",
    )
    parser.add_argument(
        "--faults",
        type=parse_faults,
        default=parse_faults(DEFAULT_FAULTS),
        help=f"each fault's period (default {DEFAULT_FAULTS}; 'none' for none)",
    )
    parser.add_argument(
        "--outage",
        type=lambda t: parse_duration(t, "--outage"),
        default=10.0,
        help="how long the store stays stopped, down or full (default 10s)",
    )
    parser.add_argument(
        "--store",
        choices=("auto", "redis", "mooncake", "none"),
        default="auto",
        help="cold tier on a redis-server of the soak's own (auto: if "
        "installed), or a Mooncake pool of its own on loopback (the run goes "
        "in a network namespace of its own, which needs root)",
    )
    parser.add_argument(
        "--warm", nargs="+", help="warm tier directories (default: one under --dir)"
    )
    parser.add_argument("--dir", help="scratch directory (default: a new temp one)")
    parser.add_argument(
        "--mp",
        action="store_true",
        help="run lmcache server with TieredL2Adapter, driven by LMCache's "
        "multi-process client (what vLLM's LMCacheMPConnector sends), instead "
        "of the in-process plugin",
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=96,
        help="distinct prefixes, picked Pareto (a few hot; default 96)",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=12,
        help="512-token blocks a conversation grows to (default 12)",
    )
    parser.add_argument(
        "--hot-gb",
        type=float,
        default=0.25,
        help="LMCache's CPU tier (with --mp the server's L1): about half the "
        "conversations (default 0.25)",
    )
    parser.add_argument(
        "--warm-gb",
        type=float,
        help="warm (and cold) capacity; default: all conversations fit, so "
        "an acknowledged chunk that is missing was lost, not evicted",
    )
    parser.add_argument(
        "--sample",
        type=float,
        default=5.0,
        help="seconds between RSS/files/threads samples (default 5)",
    )
    parser.add_argument(
        "--stall",
        type=float,
        default=2.0,
        help="a read slower than this many seconds is a stall (default 2)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the workload's seed (default 0)"
    )
    parser.add_argument("--json", help="write the result as JSON here")
    parser.add_argument(
        "--plot",
        default="soak.png",
        help="the picture (PNG; 'none' for none; default soak.png)",
    )
