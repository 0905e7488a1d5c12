"""Thread-pool engine: ``os.preadv``/``os.pwritev`` on a pool of threads.

The fallback where io_uring is blocked (seccomp, ``kernel.io_uring_disabled``)
or chosen by the user. ``preadv``/``pwritev`` release the GIL, so a pool of
threads keeps several requests in flight per device. It trails io_uring on
bandwidth and costs more CPU per byte (figures in DESIGN.md), but needs
nothing from the kernel beyond plain syscalls.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from lmcache_tiered.io import base
from lmcache_tiered.io.base import IOEngine, IORequest, write_depth

logger = logging.getLogger("lmcache_tiered")

#: More threads than this only add contention on a host's few cores.
MAX_THREADS = 64


class _Batch:
    """Collects the results of one ``submit`` and resolves its future once."""

    __slots__ = ("future", "results", "remaining", "lock", "write")

    def __init__(self, future: Future[list[int]], size: int, write: bool) -> None:
        self.future = future
        self.results = [0] * size
        self.remaining = size
        self.lock = threading.Lock()
        self.write = write

    def finish(self, index: int, result: int) -> None:
        with self.lock:
            self.results[index] = result
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.future.set_result(self.results)


_Work = tuple[_Batch, int, IORequest]


class ThreadEngine(IOEngine):
    """``queue_depth`` threads (at most :data:`MAX_THREADS`) doing positioned
    I/O, reads first, writes on at most half of them.

    It does its I/O on duplicates of ``fds``, closed once its last thread is
    done: a close that gives up on a hung transfer (see
    :data:`~lmcache_tiered.io.base.CLOSE_WAIT_S`) lets the caller close its
    descriptors, and the transfer, once it moves, still reaches its own file,
    never another one opened meanwhile under the same number.
    """

    name = "threads"

    def __init__(self, fds: Sequence[int], queue_depth: int) -> None:
        super().__init__(fds, queue_depth)
        self._fds: list[int] = []
        try:
            for fd in self.fds:
                self._fds.append(os.dup(fd))
        except BaseException:
            for fd in self._fds:
                os.close(fd)
            raise
        self.threads = min(queue_depth, MAX_THREADS)
        self._write_threads = write_depth(self.threads)
        self._ready = threading.Condition()
        self._reads: deque[_Work] = deque()
        self._writes: deque[_Work] = deque()
        self._writing = 0
        self._idle = 0
        self._closed = False
        #: workers not yet ended; the last one after close closes ``_fds``
        self._live = 0
        #: started as work comes, up to ``threads``
        self._workers: list[threading.Thread] = []

    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        future: Future[list[int]] = Future()
        future.set_running_or_notify_cancel()
        if not requests:
            future.set_result([])
            return future
        batch = _Batch(future, len(requests), write)
        with self._ready:
            if self._closed:
                raise RuntimeError("ThreadEngine is closed")
            queue = self._writes if write else self._reads
            queue.extend(
                (batch, index, request) for index, request in enumerate(requests)
            )
            self._ready.notify(len(requests))
            # idle workers take what they can, new ones (up to ``threads``)
            # the rest
            wanted = min(len(requests) - self._idle, self.threads - len(self._workers))
            for _ in range(wanted):
                worker = threading.Thread(
                    target=self._work,
                    name=f"lmcache-tiered-io_{len(self._workers)}",
                    daemon=True,
                )
                worker.start()
                self._workers.append(worker)
                self._live += 1
        return future

    def _next(self) -> _Work | None:
        """The next transfer, reads first; None once closed and drained."""
        with self._ready:
            while True:
                if self._reads:
                    return self._reads.popleft()
                if self._writes and self._writing < self._write_threads:
                    self._writing += 1
                    return self._writes.popleft()
                if self._closed and not self._writes:
                    return None
                self._idle += 1
                self._ready.wait()
                self._idle -= 1

    def _work(self) -> None:
        try:
            while (work := self._next()) is not None:
                batch, index, request = work
                result = self._do_transfer(request, batch.write)
                if batch.write:
                    with self._ready:
                        self._writing -= 1
                        self._ready.notify()  # a write held back may go now
                batch.finish(index, result)
        finally:
            with self._ready:
                self._live -= 1
            self._release_fds()

    def _do_transfer(self, request: IORequest, write: bool) -> int:
        # Python indexing would accept -1: a file index is checked explicitly.
        if not 0 <= request.file < len(self._fds):
            return -errno.EBADF
        buffer = request.buffer
        if not write and buffer.readonly:
            return -errno.EFAULT
        fd = self._fds[request.file]
        try:
            if write:
                return os.pwritev(fd, [buffer], request.offset)
            return os.preadv(fd, [buffer], request.offset)
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        except (TypeError, ValueError, BufferError, OverflowError):
            return -errno.EINVAL

    def close(self) -> None:
        """Finish what is queued, waiting at most CLOSE_WAIT_S; then fail what
        has not started (ECANCELED) and leave a hung transfer behind."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
            workers = list(self._workers)
        deadline = time.monotonic() + base.CLOSE_WAIT_S
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        with self._ready:
            stuck = sum(worker.is_alive() for worker in workers)
            cancelled = [*self._reads, *self._writes]
            self._reads.clear()
            self._writes.clear()
        for batch, index, _ in cancelled:
            batch.finish(index, -errno.ECANCELED)
        if stuck:
            logger.warning(
                "I/O engine threads: closing with %d transfers still in flight "
                "after %.3g s (a hung drive?); %d not started were cancelled",
                stuck,
                base.CLOSE_WAIT_S,
                len(cancelled),
            )
        self._release_fds()

    def _release_fds(self) -> None:
        """Close the engine's own descriptors once it is closed and no
        worker can use them any more (once only)."""
        with self._ready:
            if not self._closed or self._live or not self._fds:
                return
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
