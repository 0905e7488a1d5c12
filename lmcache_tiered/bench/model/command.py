"""What ``lmcache-tiered bench`` runs: the interleaved rounds of variants,
and what is printed and written (table, summary and targets lines, JSON,
picture). Its options, presets' parsing and help text (what the bench models)
are in :mod:`lmcache_tiered.cli.bench`.

May touch: stdout and stderr, the ``--json`` and ``--plot`` files; the run
itself goes through :mod:`lmcache_tiered.bench.model.variants`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from lmcache_tiered.bench.common import plot, report, rules, stores, trace
from lmcache_tiered.bench.common.args import OWN_MOONCAKE, split_list
from lmcache_tiered.bench.common.report import RunResult, ttfts
from lmcache_tiered.bench.model import presets, rounds
from lmcache_tiered.bench.model.baseline import ALL_HOT, LOCAL_DISK, NO_EXTERNAL_CACHE
from lmcache_tiered.bench.model.options import DEFAULT_POLICIES
from lmcache_tiered.bench.model.scenario import (
    Setup,
    Workload,
    check_space,
    compared,
    config_json,
    describe,
    load_requests,
    make_setup,
)
from lmcache_tiered.bench.model.variants import TWIN_MARK, base_of, number_twins
from lmcache_tiered.config import GIB
from lmcache_tiered.testing import netns
from lmcache_tiered.warmup import installed_policies


def all_policies() -> list[str]:
    """Every installed warm-up policy, ``none`` (no warm-up) first."""
    return sorted(installed_policies(), key=lambda name: (name != "none", name))


def chosen_policies(text: str | None) -> list[str]:
    """``--policies``: the default pair, ``all`` installed ones, or a list."""
    if text is None:
        return list(DEFAULT_POLICIES)
    if text.strip() == "all":
        return all_policies()
    return split_list(text)


def check_plot_path(path: str) -> None:
    """Fail before the run, not after it, where the picture cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(
            f"--plot {path}: cannot write there ({folder} is not a writable "
            "directory); give another FILE, or --plot none for no picture"
        )


def main(args: argparse.Namespace) -> int:
    """Run every variant on the same workload at each concurrency; print,
    and write JSON/PNG. With ``--cold-adapter mooncake``, first in a network
    namespace of its own (this command again, there), then on a pool of its
    own."""
    own_pool = args.cold_adapter == OWN_MOONCAKE
    with contextlib.ExitStack() as stack:
        try:
            if own_pool and not netns.isolated():
                option = "--cold-adapter mooncake"
                return stores.rerun_isolated(args.command_line, option)
            setup, requests = prepare(args)
            if own_pool:  # every variant in flight may keep all it stores
                size = int(setup.cold_gb * GIB) * args.jobs
                spec = stack.enter_context(stores.mooncake_pool(size))
                setup = replace(setup, cold_adapter=spec)
        except (OSError, RuntimeError, ValueError) as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 2
        return run(args, setup, requests)


def plot_path_of(args: argparse.Namespace) -> str | None:
    return None if args.plot == "none" else str(args.plot)


def prepare(args: argparse.Namespace) -> tuple[Setup, list[trace.Request]]:
    """The options checked, the workload read and the run set up."""
    presets.apply(args.preset, args, args.preset_defaults, args.preset_parse)
    plot_path = plot_path_of(args)
    if plot_path is not None:
        check_plot_path(plot_path)
    for option in ("repeat", "token_budget", "jobs"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be at least 1")
    requests = load_requests(args)
    if not requests:
        raise ValueError("the workload has no requests")
    setup = make_setup(args, requests)
    check_space(setup, requests)
    return setup, requests


def run(args: argparse.Namespace, setup: Setup, requests: list[trace.Request]) -> int:
    """Every variant at each concurrency; the report."""
    policies = chosen_policies(args.policies)
    plot_path = plot_path_of(args)
    setups = [replace(setup, concurrency=c) for c in args.concurrency]
    source = args.trace or (
        f"built-in {args.workload} ({trace.WORKLOADS[args.workload].description})"
    )
    print(describe(setup, requests, source, args.concurrency), flush=True)
    baselines = [] if args.no_baseline else [NO_EXTERNAL_CACHE, LOCAL_DISK, ALL_HOT]
    names = number_twins(
        policies + [name for name in baselines if name not in policies]
    )
    workload = Workload.build(requests, setup.shape, args.seed)
    runs, unavailable = rounds.run_rounds(
        names, setups, workload, args.repeat, args.jobs
    )
    several = len(setups) > 1
    by_concurrency: dict[int, dict[str, dict[str, Any]]] = {}
    for each in setups:
        if several:
            print(f"\nconcurrency {each.concurrency}:")
        by_concurrency[each.concurrency] = report_concurrency(
            runs[each.concurrency], each, args.repeat, policies
        )
    for name, reason in unavailable.items():
        print(f"{name}: not run ({reason})")
    rows = report.seed_rows(by_concurrency, REFERENCES)
    if several:
        print()
        print(
            "seed's table: TTFT p50, p90 and tok/s per variant and concurrency, "
            "and the change against the seed's baseline and against none, run by "
            "run"
            + (
                f"; median (lowest..highest) of {args.repeat} runs"
                if args.repeat > 1
                else "; one run each"
            )
        )
        print(report.seed_table(rows, REFERENCES))
    title = compared(setup)
    if args.json:
        documents = {
            c: {
                "config": config_json(each, requests, source, args),
                "policies": by_concurrency[c],
                "unavailable": unavailable,
            }
            for c, each in zip(by_concurrency, setups, strict=True)
        }
        report.write_json(
            args.json,
            {
                "config": {
                    **config_json(setup, requests, source, args),
                    "concurrency": list(args.concurrency),
                },
                "by_concurrency": {str(c): doc for c, doc in documents.items()},
                "seed_table": rows,
            }
            if several
            else documents[setup.concurrency],
        )
    if plot_path is not None and rows:
        if several:
            plot.draw_concurrencies(
                plot_path, rows, title, LOCAL_DISK, NO_EXTERNAL_CACHE
            )
        else:
            plot.draw_run(
                plot_path,
                {
                    name: [t for result in results for t in ttfts(result)]
                    for name, results in runs[setup.concurrency].items()
                },
                by_concurrency[setup.concurrency],
                title,
                NO_EXTERNAL_CACHE,
                LOCAL_DISK,
            )
        print(f"picture: {os.path.abspath(plot_path)}")
    return 1 if unavailable else 0


#: What the seed's table compares each variant with: the seed's baseline, and
#: our tiers without warm-up.
REFERENCES = (NO_EXTERNAL_CACHE, "none")


def report_concurrency(
    runs: Mapping[str, Sequence[RunResult]],
    setup: Setup,
    repeat: int,
    policies: Sequence[str],
) -> dict[str, dict[str, Any]]:
    """Print one concurrency's table, summary, spread table, targets and
    validity notes; its summaries per variant (the JSON's ``policies``)."""
    summaries = {
        name: report.combine([report.summarize(r) for r in results])
        for name, results in runs.items()
    }
    # a twin (none#2) is the noise, not a contender
    contenders = [n for n in summaries if base_of(n) in policies and TWIN_MARK not in n]
    contenders = [n for n in contenders if n not in BASELINES]
    shares = report.bound_shares(summaries, [*contenders, LOCAL_DISK], "none", ALL_HOT)
    for name, share in shares.items():
        summaries[name]["bound_share"] = share
    print()
    print(report.table(summaries, NO_EXTERNAL_CACHE))
    line = report.summary_line(
        summaries, compared(setup), contenders, NO_EXTERNAL_CACHE, [LOCAL_DISK, ALL_HOT]
    )
    if line is not None:
        print(line)
    for admission in rules.admission_lines(summaries):
        print(admission)
    if repeat > 1:
        print(f"(medians of {repeat} interleaved runs per variant)")
        changes = report.paired_changes(summaries)
        if changes:
            print()
            print(report.spread_table(changes))
            for name, change in changes.items():
                summaries[name]["paired_change_vs_none"] = change
            twins = [name for name in changes if base_of(name) == "none"]
            if twins:
                print(
                    f"({', '.join(twins)}: none again, so its change is this "
                    "machine's run-to-run noise; a change within it is not resolved)"
                )
    else:
        print(
            "(one run per variant: single runs of one variant can differ by tens "
            "of percent; --repeat 6 with none named twice shows by how much)"
        )
    valid = {n: s for n, s in summaries.items() if s["valid"]}
    targets = presets.targets_line(
        valid, report.paired_changes(valid), setup.concurrency, contenders
    )
    if targets is not None:
        print(targets)
    for name, summary in summaries.items():
        if not summary["valid"]:
            print(invalid_note(name, summary))
    return summaries


#: Variants that are references, not contenders.
BASELINES = (NO_EXTERNAL_CACHE, LOCAL_DISK, ALL_HOT)


#: What follows a variant's name in the line that says why its run is not valid.
NOT_VALID = ": not valid, not compared: "


def invalid_note(name: str, summary: Mapping[str, Any]) -> str:
    """Why a variant's run is not valid, and what to change."""
    reasons, fixes = [], []
    if summary["lag_share"] > report.VALID_SHARE:
        reasons.append(
            f"the replay fell up to {summary['lag_max_s']:.2f}s behind its GPU clock "
            f"({100 * summary['lag_share']:.0f}% of its TTFT p50; this machine was "
            "busy, and background I/O had time a GPU server would not give it)"
        )
        fixes.append("fewer --jobs at once, or on an idle machine")
    if summary["device_overrun_share"] > report.VALID_OVERRUN:
        reasons.append(
            "real I/O took "
            f"{100 * summary['device_overrun_share']:.0f}% longer than the modelled "
            "drives (this machine's disk is slower than they are at this F)"
        )
        fixes.append("a larger --kv-scale (fewer bytes) or --warm on a faster disk")
    return f"{name}{NOT_VALID}{'; '.join(reasons)}. Rerun with {', or '.join(fixes)}."
