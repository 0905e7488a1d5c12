"""The writer: work queued off the caller's thread and done in batches.

:class:`BatchWorker` is a thread that hands every job queued so far to one
handler call, so one call's I/O keeps every device busy; flush markers wait
for what was queued before them, and stopping finishes what is queued. The
multi-process adapter (:mod:`lmcache_tiered.integration.mp`) runs its store, lookup and
load threads on it, the in-process cache its :class:`Writer`.

:class:`Writer` is the in-process plugin's put queue: it references each
LMCache object until its bytes are written (LMCache drops its own reference
as soon as the put call returns), or copies a buffer its owner may reuse at
once; it drops puts past :data:`MAX_QUEUED_BYTES`, knows which keys are still
pending, runs each put's callback once the store function stored it, and
writes what is still queued when the interpreter exits (see
:func:`_flush_at_exit`). Its close is bounded: what is not written within
:data:`EXIT_FLUSH_S` is dropped, and the batch being written gets at most
:data:`~lmcache_tiered.io.base.CLOSE_WAIT_S` more, so nothing reads LMCache's
memory after close returns (LMCache frees its CPU tier right after) unless a
drive hangs a write longer than that: close then returns anyway (one WARNING),
the write left to its engine.

May touch: the objects it is handed (references, bytes) and the store
function it is given; never a tier, the policy or LMCache's CPU tier.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import queue
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from lmcache.v1.memory_management import MemoryObj

from lmcache_tiered.io import aligned_buffer, base
from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.storage.layout import align_up
from lmcache_tiered.storage.payload import Payload

logger = logging.getLogger("lmcache_tiered")

PutCallback = Callable[[StoreKey], None]
#: Most bytes of puts waiting for the writer; beyond it puts are dropped so the
#: CPU tier, whose buffers the queued puts hold, never fills up behind them.
MAX_QUEUED_BYTES = 2 << 30
#: Longest close, or an exiting interpreter, waits for the puts still queued
#: (seconds)
EXIT_FLUSH_S = 30.0
#: Most bytes written as one batch. What a batch writes is released (LMCache's
#: objects, L1 locks in multi-process mode) only when all of it is written: a
#: batch of everything queued kept gigabytes of LMCache's memory unevictable
#: for seconds, and loads found no room in it.
WRITE_BATCH_BYTES = 256 << 20

_Job = TypeVar("_Job")


class BatchWorker(Generic[_Job]):
    """A thread that hands every job queued so far to ``handle`` as one batch.

    With ``weigh``, a batch stops before the job that would take it past
    ``max_weight`` (it always holds one job): the jobs after it wait for the
    next call instead of making this one, and every result in it, later.
    ``handle`` publishes its own results and failures; an exception that
    escapes it is logged and the thread goes on. :meth:`stop` lets it finish
    what is queued, so no accepted job is left undone.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[list[_Job]], None],
        weigh: Callable[[_Job], int] | None = None,
        max_weight: int = 0,
    ) -> None:
        self.name = name
        self._handle = handle
        self._weigh = weigh
        self._max_weight = max_weight
        #: jobs, flush markers (set once every earlier job is handled) and
        #: None, which stops the thread
        self._queue: queue.SimpleQueue[_Job | threading.Event | None] = (
            queue.SimpleQueue()
        )
        #: when the batch being handled began (monotonic s; None: idle), for
        #: a watch that reports a handler stuck (l2_work.StallWatch)
        self.busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: _Job) -> None:
        self._queue.put(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every job queued so far is handled, or ``timeout``
        seconds; False if some were still queued then."""
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> bool:
        """Finish what is queued, then end the thread; False if it is still
        busy after ``timeout`` seconds (a handler stuck in I/O)."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _take(
        self, backlog: deque[_Job | threading.Event | None]
    ) -> list[_Job | threading.Event | None]:
        """The next batch's items from the front of ``backlog``, in order."""
        items: list[_Job | threading.Event | None] = []
        weight = 0
        while backlog:
            item = backlog[0]
            if (
                self._weigh is not None
                and item is not None
                and not isinstance(item, threading.Event)
            ):
                weight += self._weigh(item)
                if items and weight > self._max_weight:
                    break
            items.append(backlog.popleft())
        return items

    def _run(self) -> None:
        backlog: deque[_Job | threading.Event | None] = deque()
        while True:
            if not backlog:
                backlog.append(self._queue.get())
            while not self._queue.empty():
                backlog.append(self._queue.get())
            items = self._take(backlog)
            jobs = [
                i for i in items if i is not None and not isinstance(i, threading.Event)
            ]
            if jobs:
                self.busy_since = time.monotonic()
                try:
                    self._handle(jobs)
                except Exception:
                    logger.exception("lmcache_tiered: %s failed", self._thread.name)
                finally:
                    self.busy_since = None
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if None in items:
                return


#: seconds a worker may spend inside one batch before :class:`StallWatch`
#: reports it (a drive's health probe gives up on an operation at 30 s too),
#: and how often it looks
STALL_S, STALL_CHECK_S = 30.0, 5.0


class StallWatch:
    """Reports a worker stuck inside one batch: once per stall, after
    ``after_s``, a WARNING naming it with the stack of every thread of the
    process, so that a hang under LMCache (a drive, a lock, LMCache itself)
    can be told apart from one in our code from the log alone. One daemon
    thread looks every ``period_s``; it never touches the workers."""

    def __init__(
        self,
        workers: Sequence[BatchWorker[Any]],
        after_s: float | None = None,
        period_s: float | None = None,
    ) -> None:
        """``after_s``, ``period_s``: default :data:`STALL_S` and
        :data:`STALL_CHECK_S`."""
        self.workers = list(workers)
        self.after_s = STALL_S if after_s is None else after_s
        self.period_s = STALL_CHECK_S if period_s is None else period_s
        self._stopped = threading.Event()
        self._reported: dict[str, float] = {}
        self._thread = threading.Thread(
            target=self._run, name="lmcache-tiered-stall-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.period_s):
            now = time.monotonic()
            for worker in self.workers:
                since = worker.busy_since
                if (
                    since is None
                    or now - since < self.after_s
                    or self._reported.get(worker.name) == since
                ):
                    continue
                self._reported[worker.name] = since
                logger.warning(
                    "lmcache_tiered: %s has been inside one batch for %.0f s; "
                    "the process's threads:\n%s",
                    worker.name,
                    now - since,
                    thread_stacks(),
                )


def thread_stacks() -> str:
    """Every thread's name and current stack, as a traceback prints them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


@dataclasses.dataclass(slots=True)
class _Batch:
    """Payloads queued together. ``refs`` are the objects whose memory the
    payloads point into, each holding a reference until written (None for a
    payload copied into its own buffer)."""

    callback: PutCallback | None
    payloads: list[Payload] = dataclasses.field(default_factory=list)
    refs: list[MemoryObj | None] = dataclasses.field(default_factory=list)


class Writer:
    """Puts queued for ``store`` (which writes a batch of payloads and says
    which it stored), written by one thread, every batch waiting at once."""

    def __init__(
        self,
        store: Callable[[list[Payload]], list[bool]],
        *,
        name: str = "lmcache-tiered-writer",
    ) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}
        self._queued_bytes = 0
        self._closed = False
        #: set by a close that timed out: what is still queued is released
        #: unwritten
        self._dropping = False
        #: puts refused because MAX_QUEUED_BYTES were already queued, or still
        #: queued when a close timed out
        self.puts_dropped = 0
        self._worker = BatchWorker[_Batch](
            name,
            self._write,
            weigh=lambda batch: sum(len(p.view) for p in batch.payloads),
            max_weight=WRITE_BATCH_BYTES,
        )
        _flush_at_exit(self)

    def enqueue(
        self,
        items: Sequence[tuple[StoreKey, MemoryObj]],
        callback: PutCallback | None,
        *,
        copy: bool = False,
    ) -> None:
        """Queue a batch; return at once. Each object is referenced until it
        is written, or with ``copy`` its bytes are copied now (for a buffer
        its owner may reuse at once). A key already queued is skipped."""
        chosen = []
        with self._lock:
            if self._closed:
                return
            for key, obj in items:
                digest, size = key_digest(key), obj.get_size()
                if digest in self._pending:
                    continue
                if self._queued_bytes + size > MAX_QUEUED_BYTES:
                    self.puts_dropped += 1
                    continue
                if not copy:
                    obj.ref_count_up()
                self._pending[digest] = size
                self._queued_bytes += size
                chosen.append((key, obj))
        batch = _Batch(callback)
        for key, obj in chosen:
            payload = Payload.of(key, obj)
            if copy:
                buffer = aligned_buffer(align_up(len(payload.view)))
                buffer[: len(payload.view)] = payload.view
                payload = dataclasses.replace(
                    payload, view=buffer[: len(payload.view)], direct=True
                )
            batch.payloads.append(payload)
            batch.refs.append(None if copy else obj)
        if batch.payloads:
            self._worker.put(batch)

    def is_pending(self, key: StoreKey) -> bool:
        """Whether ``key`` is queued and not yet written (or dropped)."""
        return key_digest(key) in self._pending

    def _write(self, batches: list[_Batch]) -> None:
        if self._dropping:
            with self._lock:
                self.puts_dropped += sum(len(b.payloads) for b in batches)
            self._release(batches)
            return
        try:
            done = iter(self._store([p for b in batches for p in b.payloads]))
            for batch in batches:
                for payload in batch.payloads:
                    if next(done) and batch.callback is not None:
                        try:
                            batch.callback(payload.key)
                        except Exception:
                            logger.exception("lmcache_tiered: put callback failed")
        except Exception:
            logger.exception("lmcache_tiered: write failed")
        finally:
            self._release(batches)

    def _release(self, batches: list[_Batch]) -> None:
        for batch in batches:
            for payload, ref in zip(batch.payloads, batch.refs, strict=True):
                with self._lock:
                    self._queued_bytes -= self._pending.pop(key_digest(payload.key), 0)
                if ref is not None:
                    ref.ref_count_down()

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every put queued so far is written, or ``timeout``
        seconds; False if some were still queued then."""
        if self._closed:
            return True
        return self._worker.flush(timeout)

    def flush_at_exit(self) -> None:
        """Write the puts still queued, for at most ``EXIT_FLUSH_S``; the
        interpreter is exiting and close() was not called."""
        queued = len(self._pending)
        if self._closed or not queued:
            return
        if self.flush(EXIT_FLUSH_S):
            logger.info("lmcache_tiered: at exit, wrote %d queued puts", queued)
        else:
            logger.warning(
                "lmcache_tiered: at exit, %d puts still queued after %.0f s: lost",
                len(self._pending),
                EXIT_FLUSH_S,
            )

    def close(self) -> None:
        """Write the queued puts for at most ``EXIT_FLUSH_S``, drop the rest
        (counted, one WARNING), then stop the thread, waiting at most
        ``CLOSE_WAIT_S`` for the batch being written (idempotent). When it
        returns no queued object is referenced or read any more, unless a
        hung drive holds that batch (one WARNING)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        timed_out = not self._worker.flush(EXIT_FLUSH_S)
        dropped_before = self.puts_dropped
        # the batch being written is finished; what is behind it is released
        self._dropping = timed_out
        if not self._worker.stop(base.CLOSE_WAIT_S):
            logger.warning(
                "lmcache_tiered: closing, a write is still in flight %.3g s "
                "after the %.3g s flush (a hung drive?): left behind with %d "
                "puts, which stay referenced until it returns",
                base.CLOSE_WAIT_S,
                EXIT_FLUSH_S,
                len(self._pending),
            )
            return
        if timed_out:
            logger.warning(
                "lmcache_tiered: closing, %d puts still queued after %.3g s: "
                "dropped (a slow or stalled drive?)",
                self.puts_dropped - dropped_before,
                EXIT_FLUSH_S,
            )


def _flush_at_exit(writer: Writer) -> None:
    """Have ``writer`` write its queued puts when the interpreter exits.

    vLLM 0.32's LMCacheConnectorV1 never shuts LMCache down, so close() never
    runs and the daemon writer would die with its queue. The hook runs where
    ``concurrent.futures`` runs its own: in ``threading._register_atexit``,
    before Python joins non-daemon threads, because LMCache's storage-manager
    loop thread never ends and an ``atexit`` hook would never be reached.
    It holds only a weak reference: a closed, dropped writer costs nothing.
    """
    ref = weakref.ref(writer)

    def flush() -> None:
        if (alive := ref()) is not None:
            alive.flush_at_exit()

    register = getattr(threading, "_register_atexit", atexit.register)
    with contextlib.suppress(RuntimeError):  # the interpreter is shutting down
        register(flush)
