"""The interleaved rounds of a bench run: every variant once a round, each
round starting one variant later, those without an engine first, the others
``--jobs`` at a time, each in a process of its own (or, with one job, one
after the other in this process). A variant whose replay was not valid with
others beside it (they share the machine's cores) is replayed once more,
alone, and that run counts.

May touch: stderr (progress bars, skipped variants), child processes it
starts and waits for; the runs themselves go through
:mod:`lmcache_tiered.bench.model.variants`.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from functools import partial

from lmcache_tiered.bench.common.progress import Progress, finished_note
from lmcache_tiered.bench.common.report import RunResult, run_validity
from lmcache_tiered.bench.model import variants
from lmcache_tiered.bench.model.scenario import Setup, Workload
from lmcache_tiered.bench.model.variants import VariantUnavailable, policy_of


def run_rounds(
    names: Sequence[str],
    setups: Sequence[Setup],
    workload: Workload,
    repeat: int,
    jobs: int = 1,
) -> tuple[dict[int, dict[str, list[RunResult]]], dict[str, str]]:
    """Every variant ``repeat`` times at each setup's concurrency, round by
    round, up to ``jobs`` of a round's variants with an engine replayed at
    once (those without one first: they take no time); the results per
    concurrency and variant, and the variants that could not run (not tried
    again) with the reason."""
    runs: dict[int, dict[str, list[RunResult]]] = {s.concurrency: {} for s in setups}
    unavailable: dict[str, str] = {}
    total = len(names) * repeat * len(setups)
    number = 0
    for setup in setups:
        for r in range(repeat):
            # interleaved, each round starting one variant later (A B C,
            # B C A, ...): drift of the disk or of other load on the machine
            # then touches every variant alike, and none always runs first
            order = [names[(r + i) % len(names)] for i in range(len(names))]
            labels = {}
            for name in order:
                number += 1
                label = f"[{number}/{total}] {name}"
                if len(setups) > 1:
                    label += f" c{setup.concurrency}"
                if repeat > 1:
                    label += f" ({r + 1}/{repeat})"
                labels[name] = label
            todo = [n for n in order if n not in unavailable]
            quick = [n for n in todo if policy_of(n) in variants.ENGINELESS]
            real = [n for n in todo if n not in quick]
            attempt = partial(
                _attempt, setup=setup, workload=workload, unavailable=unavailable
            )
            # the quick ones first: they take no time
            results = [attempt(n, labels[n]) for n in quick]
            if jobs == 1:
                results += [attempt(n, labels[n]) for n in real]
            else:
                apart = _apart(real, labels, setup, workload, jobs, unavailable)
                results += [
                    _alone_if_invalid(n, result, labels[n], attempt)
                    for n, result in zip(real, apart, strict=True)
                ]
            todo = quick + real
            for name, result in zip(todo, results, strict=True):
                if result is not None:
                    runs[setup.concurrency].setdefault(name, []).append(result)
    return runs, unavailable


def _apart(
    names: Sequence[str],
    labels: Mapping[str, str],
    setup: Setup,
    workload: Workload,
    jobs: int,
    unavailable: dict[str, str],
) -> list[RunResult | None]:
    """Run ``names`` ``jobs`` at a time, each in a fresh process of its own
    (:func:`variants.run_variant_apart`), their progress bars drawn here;
    None, and the reason in ``unavailable``, for each that could not run."""
    context = multiprocessing.get_context("spawn")  # torch and threads: no fork
    with (
        context.Manager() as manager,
        ProcessPoolExecutor(jobs, mp_context=context, max_tasks_per_child=1) as pool,
    ):
        done = {name: manager.Value("i", 0) for name in names}
        futures = {
            name: pool.submit(
                variants.run_variant_apart,
                name,
                setup,
                workload.requests,
                workload.seed,
                done[name],
            )
            for name in names
        }
        bars: dict[str, Progress] = {}
        shown: dict[str, int] = {}
        while bars.keys() != futures.keys() or any(n in shown for n in bars):
            for name, future in futures.items():
                if name not in bars and (future.running() or future.done()):
                    bars[name] = Progress(labels[name], len(workload.requests))
                    shown[name] = 0
                if name in shown:
                    count = done[name].value
                    bars[name].advance(count - shown[name])
                    shown[name] = count
                    if future.done():
                        del shown[name]
                        bars[name].close(_closing_note(future))
            time.sleep(0.2)
        results: list[RunResult | None] = []
        for name, future in futures.items():
            try:
                results.append(future.result())
            except VariantUnavailable as exc:
                _skipped(name, labels[name], exc, unavailable)
                results.append(None)
        return results


def _alone_if_invalid(
    name: str,
    result: RunResult | None,
    label: str,
    attempt: Callable[[str, str], RunResult | None],
) -> RunResult | None:
    """``result``, or where it is not valid (the variants beside it took
    the cores its replay needed), a replay of the variant alone."""
    if result is None:
        return None
    check = run_validity(result)
    if check["valid"]:
        return result
    print(
        f"{label}: not valid beside the others (lag {100 * check['lag_share']:.0f} % "
        f"of its TTFT p50, overrun {100 * check['device_overrun_share']:.0f} %): "
        "replayed alone",
        file=sys.stderr,
    )
    return attempt(name, f"{label} (alone)")


def _closing_note(future: Future[RunResult]) -> str:
    if future.exception() is not None:
        return "failed"
    return finished_note(future.result().wall_s)


def _skipped(
    name: str, label: str, exc: VariantUnavailable, unavailable: dict[str, str]
) -> None:
    """Note a variant that could not run (it is not tried again)."""
    unavailable[name] = str(exc)
    print(f"{label}: skipped: {exc}", file=sys.stderr)


def _attempt(
    name: str,
    label: str,
    *,
    setup: Setup,
    workload: Workload,
    unavailable: dict[str, str],
) -> RunResult | None:
    """One variant's run; None, and the reason in ``unavailable``, if it
    could not run."""
    try:
        return variants.run_variant(name, setup, workload, label)
    except VariantUnavailable as exc:
        _skipped(name, label, exc, unavailable)
        return None
