"""Thread-pool engine: ``os.preadv``/``os.pwritev`` on a pool of threads.

The fallback where io_uring is blocked (seccomp, ``kernel.io_uring_disabled``)
or chosen by the user. ``preadv``/``pwritev`` release the GIL, so a pool of
threads keeps several requests in flight per device. It trails io_uring on
bandwidth and costs more CPU per byte (figures in DESIGN.md), but needs
nothing from the kernel beyond plain syscalls.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from lmcache_tiered.io.base import IOEngine, IORequest

#: More threads than this only add contention on a host's few cores.
MAX_THREADS = 64


class _Batch:
    """Collects the results of one ``submit`` and resolves its future once."""

    __slots__ = ("future", "results", "remaining", "lock")

    def __init__(self, future: Future[list[int]], size: int) -> None:
        self.future = future
        self.results = [0] * size
        self.remaining = size
        self.lock = threading.Lock()

    def finish(self, index: int, result: int) -> None:
        with self.lock:
            self.results[index] = result
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.future.set_result(self.results)


class ThreadEngine(IOEngine):
    """``queue_depth`` threads (at most :data:`MAX_THREADS`) doing positioned I/O."""

    name = "threads"

    def __init__(self, fds: Sequence[int], queue_depth: int) -> None:
        super().__init__(fds, queue_depth)
        self.threads = min(queue_depth, MAX_THREADS)
        self._pool = ThreadPoolExecutor(
            max_workers=self.threads, thread_name_prefix="lmcache-tiered-io"
        )
        # Makes "enqueue a whole batch" atomic with respect to close().
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        future: Future[list[int]] = Future()
        future.set_running_or_notify_cancel()
        if not requests:
            future.set_result([])
            return future
        batch = _Batch(future, len(requests))
        with self._lock:
            if self._closed:
                raise RuntimeError("ThreadEngine is closed")
            for index, request in enumerate(requests):
                self._pool.submit(self._transfer, batch, index, request, write)
        return future

    def _transfer(
        self, batch: _Batch, index: int, request: IORequest, write: bool
    ) -> None:
        batch.finish(index, self._do_transfer(request, write))

    def _do_transfer(self, request: IORequest, write: bool) -> int:
        # Python indexing would accept -1: a file index is checked explicitly.
        if not 0 <= request.file < len(self.fds):
            return -errno.EBADF
        buffer = request.buffer
        if not write and buffer.readonly:
            return -errno.EFAULT
        fd = self.fds[request.file]
        try:
            if write:
                return os.pwritev(fd, [buffer], request.offset)
            return os.preadv(fd, [buffer], request.offset)
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        except (TypeError, ValueError, BufferError, OverflowError):
            return -errno.EINVAL

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
