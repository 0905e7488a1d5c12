"""What a soak found, and whether it passed: a table, a pass/fail line, JSON
and a picture of the worker's memory, files and threads with the faults.

The verdict's rules (:func:`verdict`): no wrong byte, no acknowledged chunk
lost, no worker death but the soak's own kills, no read slower than
``--stall`` except at most one per store outage, and RSS, open files and
threads flat: over the run's last third at most a little above their peak
before it (a leak grows; a warm-up plateau does not).

May touch: the JSON and PNG files it is given.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

#: Seconds within which the cold tier serves (and takes writes) again once
#: its store is back: two probe periods, a check's timeouts, a tick.
BACK_S = 15.0
#: How much the last third may exceed the earlier peak and still be flat.
RSS_SLACK_BYTES, RSS_SLACK_SHARE = 64 << 20, 0.10
FILES_SLACK = THREADS_SLACK = 8


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: from ``start`` to ``end`` (seconds into the run)."""

    start: float
    end: float
    kind: str
    what: str


@dataclass(frozen=True, slots=True)
class Sample:
    """The worker at ``t`` seconds: RSS bytes, open files, threads, and the
    requests served so far."""

    t: float
    rss: int
    files: int
    threads: int
    requests: int


@dataclass(slots=True)
class SoakResult:
    """Counts and samples of one soak."""

    duration_s: float
    faults_asked: dict[str, float]
    #: the process under test: the in-process "worker" or "lmcache server"
    subject: str = "worker"
    store: str = "none"
    requests: int = 0
    acked: int = 0
    unacknowledged: int = 0
    checked_chunks: int = 0
    lost_chunks: int = 0
    wrong_chunks: int = 0
    damaged: int = 0
    corrupt_seen: int = 0
    restarts: int = 0
    slowest_read_s: float = 0.0
    #: how long the last worker took to close its engine (None: it hung)
    stopped_in_s: float | None = None
    #: (seconds into the run, slowest read of that second)
    stalls: list[tuple[float, float]] = field(default_factory=list)
    #: (seconds into the run, exit code) of workers that ended on their own
    deaths: list[tuple[float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    #: store outages after which the cold tier did not serve again in time
    not_back: list[Fault] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


def _growth(result: SoakResult, value: str) -> tuple[float, float]:
    """(max before the last third, max over the last third) of ``value``: a
    leak climbs past every earlier peak. Samples taken during a store fault
    or until the tier is back (BACK_S) are left out: the clients the tier
    makes and drops then (a fresh one to serve reads while writes are
    refused) come and go with the fault, whenever in the run it falls."""
    faults = [f for f in result.faults if f.kind == "store"]
    samples = [
        s
        for s in result.samples
        if not any(f.start <= s.t <= f.end + BACK_S for f in faults)
    ]
    if len(samples) < 3:
        return 0.0, 0.0
    end = samples[-1].t
    before = [getattr(s, value) for s in samples if s.t < 2 * end / 3]
    last = [getattr(s, value) for s in samples if s.t >= 2 * end / 3]
    return float(max(before, default=0)), float(max(last, default=0))


def _mode(result: SoakResult) -> str:
    """`` --mp`` for a soak of ``lmcache server``, else nothing."""
    return "" if result.subject == "worker" else " --mp"


def _fault_counts(faults: list[Fault]) -> str:
    """``2 kill (SIGKILL, restarted), 3 damage (...)``: each kind and variant
    once, however long the run (the times are in the JSON and the picture)."""
    counts = Counter((f.kind, f.what) for f in faults)
    return ", ".join(f"{n} {kind} ({what})" for (kind, what), n in counts.items())


def stalls_in(result: SoakResult, faults: list[Fault]) -> list[tuple[float, float]]:
    """The stalls during ``faults`` (or within a tick and a probe after)."""
    return [
        s for s in result.stalls if any(f.start <= s[0] <= f.end + 5 for f in faults)
    ]


def verdict(result: SoakResult, stall_s: float) -> list[str]:
    """Why the soak failed; empty if it passed."""
    why = []
    if result.wrong_chunks:
        why.append(f"{result.wrong_chunks} chunks served with wrong bytes")
    if result.lost_chunks:
        why.append(f"{result.lost_chunks} acknowledged chunks lost")
    if result.deaths:
        why.append(
            f"{len(result.deaths)} {result.subject} deaths (exit {result.deaths[0][1]})"
        )
    outages = [f for f in result.faults if f.kind == "store"]
    in_outage = stalls_in(result, outages)
    outside = len(result.stalls) - len(in_outage)
    if outside:
        why.append(f"{outside} reads over {stall_s:g} s outside store outages")
    if len(in_outage) > len(outages):
        why.append(
            f"{len(in_outage)} reads over {stall_s:g} s in {len(outages)} outages"
        )
    if result.not_back:
        why.append(f"the cold tier was not back after {len(result.not_back)} outages")
    before, last = _growth(result, "rss")
    if last > before * (1 + RSS_SLACK_SHARE) + RSS_SLACK_BYTES:
        why.append(f"RSS grew: {before / 2**20:.0f} -> {last / 2**20:.0f} MiB")
    for value, slack in (("files", FILES_SLACK), ("threads", THREADS_SLACK)):
        before, last = _growth(result, value)
        if last > before + slack:
            why.append(f"{value} grew: {before:.0f} -> {last:.0f}")
    if result.stopped_in_s is None:
        why.append(f"the last {result.subject} did not close (killed)")
    if result.requests == 0:
        why.append("no request was served")
    elif result.acked == 0:
        # nothing acknowledged, nothing checked: a pass would say nothing
        why.append("no put was acknowledged")
    return why


def report(result: SoakResult, args: argparse.Namespace, log: Path) -> bool:
    """Print the table and the pass/fail line, write JSON and the picture;
    whether the soak passed."""
    failures = verdict(result, args.stall)
    console = Console()
    table = Table(title=f"soak{_mode(result)}, {result.duration_s / 60:g} min")
    table.add_column("what")
    table.add_column("figure", justify="right")
    rss = [s.rss for s in result.samples] or [0]
    outages = [f for f in result.faults if f.kind == "store"]
    rows = [
        ("requests served (each read checked)", f"{result.requests}"),
        ("puts acknowledged / not", f"{result.acked} / {result.unacknowledged}"),
        ("chunks checked after restarts", f"{result.checked_chunks}"),
        ("acknowledged chunks lost", f"{result.lost_chunks}"),
        ("chunks with wrong bytes", f"{result.wrong_chunks}"),
        ("records damaged / corrupt seen", f"{result.damaged} / {result.corrupt_seen}"),
        (
            f"reads over {args.stall:g} s (in store outages)",
            f"{len(result.stalls)} ({len(stalls_in(result, outages))})",
        ),
        ("slowest read (s)", f"{result.slowest_read_s:.2f}"),
        (
            f"{result.subject} restarts / deaths",
            f"{result.restarts} / {len(result.deaths)}",
        ),
        (
            f"last {result.subject}'s clean close (s)",
            "hung" if result.stopped_in_s is None else f"{result.stopped_in_s:.1f}",
        ),
        ("store", result.store),
        ("faults", _fault_counts(result.faults)),
        ("RSS MiB (min / max)", f"{min(rss) / 2**20:.0f} / {max(rss) / 2**20:.0f}"),
    ]
    if result.samples:
        files = [s.files for s in result.samples]
        threads = [s.threads for s in result.samples]
        rows.append(("open files (min / max)", f"{min(files)} / {max(files)}"))
        rows.append(("threads (min / max)", f"{min(threads)} / {max(threads)}"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for note in [*result.notes, *result.errors[:5]]:
        console.print(f"note: {note}")
    if args.json:
        document = asdict(result) | {"failures": failures, "passed": not failures}
        Path(args.json).write_text(json.dumps(document, indent=1))
    if args.plot != "none" and result.samples:
        draw(result, args.plot, failures)
        console.print(f"picture: {args.plot}")
    if failures:
        console.print(f"FAIL: {'; '.join(failures)} (worker log: {log})")
    else:
        console.print("PASS: no wrong byte, nothing acknowledged lost, no stall, flat")
    return not failures


def draw(result: SoakResult, path: str, failures: list[str]) -> None:
    """RSS, open files and threads over the run, each fault a line."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    minutes = [s.t / 60 for s in result.samples]
    figure, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    series: list[tuple[Any, list[float], str]] = [
        (axes[0], [s.rss / 2**20 for s in result.samples], "RSS (MiB)"),
        (axes[1], [float(s.files) for s in result.samples], "open files"),
        (axes[2], [float(s.threads) for s in result.samples], "threads"),
    ]
    colors = {"kill": "tab:red", "store": "tab:orange", "damage": "tab:purple"}
    for axis, values, label in series:
        axis.plot(minutes, values, color="tab:blue", linewidth=1.2)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        for fault in result.faults:
            axis.axvline(fault.start / 60, color=colors[fault.kind], alpha=0.5, lw=0.8)
    axes[-1].set_xlabel("minutes (faults: red kill, orange store, purple damage)")
    state = "FAIL: " + "; ".join(failures) if failures else "PASS"
    figure.suptitle(
        f"lmcache-tiered soak{_mode(result)}, {result.duration_s / 60:g} min: {state}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
