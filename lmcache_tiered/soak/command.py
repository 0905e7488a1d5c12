"""What ``lmcache-tiered soak`` runs: a worker under load (the in-process
plugin; with ``--mp`` ``lmcache server`` and the client that drives it),
faults on a schedule, samples, and the verdict. Its options and help text
are in :mod:`lmcache_tiered.cli.soak`.

May touch: the directories it is given (``--dir``, ``--warm``), removed at
the end unless given; the store (redis-server or Mooncake pool) and lmcache
servers it starts; the report files it is told.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmcache_tiered.bench.common.stores import rerun_isolated
from lmcache_tiered.config import PREFIX, plugin_extra_config
from lmcache_tiered.soak.processes import MpWorker, WorkerProcess
from lmcache_tiered.soak.report import BACK_S, Fault, Sample, SoakResult, report
from lmcache_tiered.soak.stores import MooncakeStore, RedisStore, SoakStore
from lmcache_tiered.soak.workload import CHUNK_TOKENS, Conversations
from lmcache_tiered.testing import netns

#: Bytes on disk of one soak chunk (tiny model: 1 KiB per token) and header.
_CHUNK_DISK_BYTES = CHUNK_TOKENS * 1024 + 8192
#: Seconds the worker may take to close its engine when the soak ends.
STOP_S = 120.0
#: Error lines kept for the report (a 72-hour run could have many).
MAX_ERRORS_KEPT = 50
#: A progress line about this many times a run, at most every 10 minutes.
PROGRESS_LINES, PROGRESS_MAX_S = 12, 600.0


class Soak:
    """The run: the schedule, the worker's lines, the samples. The worker
    is the in-process plugin, or with ``--mp`` ``lmcache server`` and its
    client (:mod:`lmcache_tiered.soak.processes`)."""

    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        self.args = args
        self.scratch = scratch
        self.conversations = Conversations(args.conversations, args.blocks, args.seed)
        self.result = SoakResult(
            duration_s=args.duration,
            faults_asked=args.faults,
            subject="lmcache server" if args.mp else "worker",
        )
        self.acked: dict[str, int] = {}
        #: conversations whose last chunk at that depth the worker damaged
        self.damaged: dict[str, int] = {}
        self.requests = 0
        self.store = self._start_store()
        self.store_down = False
        self.result.store = self.store.name if self.store else "none"
        self.warm = args.warm or [str(scratch / "warm")]
        for path in self.warm:
            os.makedirs(path, exist_ok=True)
        # with --mp the server's log and the client's
        self.log = open(scratch / "worker.log", "ab")  # noqa: SIM115 (closed in run)
        #: the worker checked what was acknowledged before and serves (its
        #: samples count); the damaged records it found
        self.ready = False
        self.corrupt = 0
        self.started = time.monotonic()
        #: the same instant on the wall clock, which the worker's lines carry
        self.started_wall = time.time()
        try:
            self.worker = self._start_worker()
        except BaseException:
            self.log.close()
            if self.store is not None:
                self.store.close()
            raise

    def _start_store(self) -> SoakStore | None:
        kind = self.args.store
        if kind == "auto":
            kind = "redis" if shutil.which("redis-server") else "none"
        if kind == "redis":
            return RedisStore()
        if kind == "mooncake":
            return MooncakeStore(
                int(self._capacity_gb() * 2**30), self.scratch / "mooncake"
            )
        return None

    def _capacity_gb(self) -> float:
        """Warm (and cold) capacity: by default all conversations fit, so an
        acknowledged chunk that is missing was lost, not evicted."""
        return self.args.warm_gb or (
            1.25 * self.conversations.chunk_count * _CHUNK_DISK_BYTES / 2**30
        )

    # ---------------------------------------------------------- the worker

    def _settings(self) -> dict[str, Any]:
        """The tiers' settings (``tiered.*`` without the prefix): warm on the
        directories, cold on the store, written through; both hold it all."""
        capacity_gb = self._capacity_gb()
        settings = {"warm.paths": self.warm, "warm.capacity_gb": capacity_gb}
        if self.store is not None:
            settings["cold.adapter"] = self.store.spec
            settings["cold.capacity_gb"] = capacity_gb
            settings["cold.write"] = "through"
        return settings

    def _start_worker(self) -> WorkerProcess | MpWorker:
        self.ready = False
        self.corrupt = 0
        spec = {
            "conversations": {
                "count": self.conversations.count,
                "blocks": self.conversations.blocks,
                "seed": self.conversations.seed,
            },
            "acked": self.acked,
            "damaged": self.damaged,
            # a new worker does not replay what the last one did
            "first_request": self.requests + 1_000_000 * self.result.restarts,
        }
        settings = self._settings()
        if self.args.mp:
            adapter = {
                "type": "plugin",
                "module_path": "lmcache_tiered.mp",
                "class_name": "TieredL2Adapter",
                "adapter_params": settings,
            }
            spec["warm"] = {"paths": self.warm}
            return MpWorker(adapter, self.args.hot_gb, spec, self.scratch, self.log)
        spec["hot_gb"] = self.args.hot_gb
        spec["extra_config"] = plugin_extra_config(
            {PREFIX + k: v for k, v in settings.items()}
        )
        return WorkerProcess("lmcache_tiered.soak.worker", spec, self.scratch, self.log)

    def _restart(self) -> None:
        """A new worker for one that ended (its counts kept)."""
        self.result.corrupt_seen += self.corrupt
        self.result.restarts += 1
        self.worker = self._start_worker()

    def _handle(self, line: dict[str, Any]) -> None:
        kind = line["type"]
        result = self.result
        if kind == "ack":
            name, depth = line["conversation"], line["depth"]
            self.acked[name] = max(self.acked.get(name, 0), depth)
            if depth >= self.damaged.get(name, depth + 1):
                del self.damaged[name]  # the damaged chunk written anew
            result.acked += 1
        elif kind == "tick":
            self.requests += line["ops"]
            result.requests += line["ops"]
            result.wrong_chunks += line["wrong_chunks"]
            self.corrupt = line["corrupt"]
            result.slowest_read_s = max(result.slowest_read_s, line["slowest_read_s"])
            cold = line["degraded"].get("cold") or line["refused"].get("cold")
            # when the worker said it: a killed or closing worker's last
            # lines are handled after it ended
            said = line["t"] - self.started_wall
            self._check_back(cold, said)
            if line["slowest_read_s"] > self.args.stall:
                result.stalls.append((said, line["slowest_read_s"]))
        elif kind == "ready":
            self.ready = True
            result.checked_chunks += line["checked_chunks"]
            result.lost_chunks += line["lost_chunks"]
            if line["lost_conversations"]:
                result.notes.append(
                    f"at {self.elapsed():.0f} s a new worker missed acknowledged "
                    f"chunks of conversations {line['lost_conversations']}"
                )
            result.wrong_chunks += line["wrong_chunks"]
        elif kind == "damaged":
            self.damaged[line["conversation"]] = line["depth"]
            result.damaged += 1
        elif kind == "error":
            result.unacknowledged += line["what"] == "put not acknowledged"
            if len(result.errors) < MAX_ERRORS_KEPT:
                result.errors.append(f"{line['what']}: {line['why']}")

    def _check_back(self, degraded: str | None, said: float) -> None:
        """A store that is back must be served again within BACK_S."""
        outages = [f for f in self.result.faults if f.kind == "store"]
        if degraded is None or self.store_down or not outages:
            return
        late = said - outages[-1].end
        if late > BACK_S and outages[-1] not in self.result.not_back:
            self.result.not_back.append(outages[-1])
            self.result.notes.append(
                f"cold tier still {degraded!r} {late:.0f} s after the store was back"
            )

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _drain(self, until: float) -> None:
        """Handle the worker's lines until monotonic ``until``; a worker that
        ended on its own is a failure, restarted."""
        while (left := until - time.monotonic()) > 0:
            try:
                line = self.worker.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if (code := self.worker.died()) is None:
                    continue
            else:
                if line is not None:
                    self._handle(line)
                    continue
                code = self.worker.wait()
            self.worker.kill()  # what is left of it (an MP worker's other half)
            self._drain_until_end()
            self.result.deaths.append((self.elapsed(), code))
            self._restart()

    # ---------------------------------------------------------------- faults

    def _fault(self, kind: str, count: int) -> Fault:
        """Inject one fault; what it was, for the picture and the report."""
        start = self.elapsed()
        if kind == "kill":
            self.worker.kill()
            self._drain_until_end()
            self._restart()
            return Fault(start, self.elapsed(), "kill", "SIGKILL, restarted")
        if kind == "damage":
            if not self.ready:  # SIGUSR1 would kill it: no handler yet
                return Fault(start, start, "damage", "skipped: the worker was starting")
            self.worker.damage()
            return Fault(start, start, "damage", "a payload byte flipped")
        assert self.store is not None
        outages = self.store.outages()
        outage = outages[count % len(outages)]
        self.store_down = True
        outage.begin()
        self._drain(time.monotonic() + self.args.outage)
        outage.end()
        self.store_down = False
        what = f"{outage.what} {self.args.outage:g} s"
        return Fault(start, self.elapsed(), "store", what)

    def _drain_until_end(self) -> None:
        """Handle the ended worker's last lines."""
        while (line := self.worker.lines.get()) is not None:
            self._handle(line)

    def _schedule(self) -> Iterator[tuple[float, str, int]]:
        """(elapsed seconds, kind, how many of that kind before) in time order."""
        periods = dict(self.args.faults)
        if self.store is None:
            periods.pop("store", None)
        events = [
            (period * (n + 1), kind, n)
            for kind, period in periods.items()
            for n in range(int(self.args.duration // period))
        ]
        yield from sorted(events)

    # ------------------------------------------------------------------ run

    def run(self) -> SoakResult:
        if self.store is None and "store" in self.args.faults:
            self.result.notes.append(
                "no store fault: no cold store (--store none, or auto without "
                "redis-server)"
            )
        next_sample = self.started
        every = min(self.args.duration / PROGRESS_LINES, PROGRESS_MAX_S)
        next_progress = self.started + every
        pending = list(self._schedule())
        end = self.started + self.args.duration
        while (now := time.monotonic()) < end:
            if now >= next_sample:
                self._sample()
                next_sample += self.args.sample
            if now >= next_progress:
                self._progress()
                next_progress += every
            if pending and self.started + pending[0][0] <= now:
                _, kind, count = pending.pop(0)
                self.result.faults.append(self._fault(kind, count))
                continue
            due = [next_sample, end] + [self.started + p[0] for p in pending[:1]]
            self._drain(min(due))
        self._sample()
        self._stop_worker()
        return self.result

    def _sample(self) -> None:
        usage = self.worker.usage() if self.ready else None
        if usage is not None:
            rss, files, threads = usage
            self.result.samples.append(
                Sample(self.elapsed(), rss, files, threads, self.result.requests)
            )

    def _progress(self) -> None:
        """One line of where the run stands, for a watcher of a long run."""
        result, last = self.result, self.result.samples[-1:]
        usage = (
            f", RSS {last[0].rss / 2**20:.0f} MiB, {last[0].files} files, "
            f"{last[0].threads} threads"
            if last
            else ""
        )
        print(
            f"soak: {self.elapsed() / 60:.1f}/{self.args.duration / 60:g} min, "
            f"{result.requests} requests, {len(result.faults)} faults, "
            f"{result.wrong_chunks} wrong, {result.lost_chunks} lost, "
            f"{len(result.stalls)} reads over {self.args.stall:g} s{usage}",
            flush=True,
        )

    def _stop_worker(self) -> None:
        """SIGTERM: the worker destroys its engine, or the server closes its
        adapter (a clean close), then its last lines are handled."""
        self.result.stopped_in_s = self.worker.stop(STOP_S)
        self._drain_until_end()
        self.result.corrupt_seen += self.corrupt
        code = self.worker.returncode
        if code is not None and code not in (0, -signal.SIGTERM):
            self.result.deaths.append((self.elapsed(), code))

    def close(self) -> None:
        self.worker.kill()
        if self.store is not None:
            self.store.close()
        self.log.close()


def run(args: argparse.Namespace) -> int:
    """The soak; with ``--store mooncake`` first in a network namespace of
    its own (this command again, there)."""
    if args.store == "mooncake" and not netns.isolated():
        try:
            return rerun_isolated(args.command_line, "--store mooncake")
        except ValueError as exc:
            print(f"soak: {exc}", file=sys.stderr)
            return 2
    if args.dir:
        scratch = Path(args.dir)
        scratch.mkdir(parents=True, exist_ok=True)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="lmcache-tiered-soak-"))
    try:
        soak = Soak(args, scratch)
    except RuntimeError as exc:  # a store that did not start, Mooncake missing
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    print(
        f"soak: {args.duration / 60:g} min, faults "
        f"{', '.join(f'{k} every {p:g} s' for k, p in args.faults.items()) or 'none'}"
        f", store {soak.result.store}, {soak.result.subject} under test; "
        f"log {scratch / 'worker.log'}",
        flush=True,
    )
    try:
        result = soak.run()
    finally:
        soak.close()
    passed = report(result, args, scratch / "worker.log")
    if not args.dir and passed:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if passed else 1
