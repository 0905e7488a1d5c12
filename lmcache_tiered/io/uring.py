"""io_uring engine over the PyPI ``liburing`` binding.

Why it is built this way (facts measured on this project's machines):

* The binding holds the GIL while it waits in the kernel, so nothing here ever
  calls ``io_uring_wait_cqe``/``submit_and_wait``. An eventfd is registered
  with the ring; a daemon reaper thread blocks in ``os.eventfd_read`` (which
  releases the GIL) and then reaps every ready completion without blocking.
* Only the reaper thread submits to the ring. When the task that submitted a
  request exits, the kernel cancels its requests still queued in io-wq
  (``-ECANCELED`` seen on this kernel with short-lived submitting threads);
  callers (thread pools, event loops) come and go, the reaper lives as long as
  the ring. Callers only queue their batch under a short lock and poke the
  eventfd.
* Files are registered (``IOSQE_FIXED_FILE``); buffers optionally too
  (:meth:`UringEngine.register_buffers`): ``readv_fixed`` cuts CPU per byte
  several times because the kernel skips pinning pages on every request.
* The binding's ``Iovec`` never releases the buffers it is built from (one
  leaked reference and buffer export per entry: 200 Iovecs over 1 MiB buffers
  grew RSS by 200 MiB). The engine builds its Iovecs once, over a placeholder,
  and points their C entries at each request's memory (``_SlotIovec``), so a
  request costs no allocation and leaks nothing.
* At most ``queue_depth`` requests are in flight; the rest wait in a pending
  queue that the reaper tops up as completions arrive, so one huge batch
  cannot starve the others and the completion queue can never overflow.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

import liburing

from lmcache_tiered.io.base import IOEngine, IORequest

logger = logging.getLogger("lmcache_tiered")

#: Ring size cap: deeper queues buy nothing on NVMe and pin kernel memory.
MAX_QUEUE_DEPTH = 4096
#: The kernel refuses a registered buffer larger than 1 GiB.
MAX_FIXED_BUFFER = 1 << 30
#: user_data of a submission slot turned into a no-op (see ``_prep``).
_NOP_TAG = 0
#: Backoff when the kernel refuses a submission for lack of resources.
_RETRY_S = 0.001


def uring_available() -> tuple[bool, str]:
    """Really set up a tiny ring and run a no-op through it.

    Seccomp profiles (Docker's default among them) and
    ``kernel.io_uring_disabled`` make ``io_uring_setup`` or ``io_uring_enter``
    fail with ENOSYS/EPERM; a tier must then fall back with a clear reason.
    """
    ring = liburing.Ring()
    try:
        liburing.io_uring_queue_init(2, ring)
    except OSError as exc:
        return False, f"io_uring_setup failed ({_describe(exc)})"
    try:
        sqe = liburing.io_uring_get_sqe(ring)
        liburing.io_uring_prep_nop(sqe)
        liburing.io_uring_submit_and_wait(ring, 1)  # a no-op completes inline
        stable = ring.features & liburing.IORING_FEAT_SUBMIT_STABLE
        _SlotIovec(1)
    except OSError as exc:
        return False, f"io_uring_enter failed ({_describe(exc)})"
    except RuntimeError as exc:
        return False, f"liburing {liburing.__version__}: {exc}"
    finally:
        liburing.io_uring_queue_exit(ring)
    if not stable:
        return False, "kernel too old: no IORING_FEAT_SUBMIT_STABLE (5.5)"
    return True, f"io_uring works (liburing binding {liburing.__version__})"


def _describe(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "?")
    hint = ""
    if exc.errno in (errno.EPERM, errno.ENOSYS):
        hint = ": blocked by seccomp or kernel.io_uring_disabled"
    return f"{name} {exc.strerror}{hint}"


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable ABI since 3.11)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def _span(buffer: memoryview) -> tuple[int, int]:
    """Address and byte length of a C-contiguous buffer, read-only ones too.

    Raises BufferError for a non-contiguous buffer.
    """
    view = _PyBuffer()
    _get_buffer(buffer, ctypes.byref(view), 0)  # PyBUF_SIMPLE
    try:
        return view.buf or 0, view.len
    finally:
        _release_buffer(ctypes.byref(view))


class _IovecEntry(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


#: Built once per process: the binding's leaked references pin only this.
_PLACEHOLDER = bytearray(1)


class _SlotIovec:
    """A ``liburing.Iovec`` whose C entries can be pointed at any memory.

    The binding lays an Iovec out as the object header, then ``_len`` and a
    pointer to its C ``iovec`` array; the layout is checked on construction,
    so a binding that changes it fails loudly (and :func:`uring_available`
    reports it) instead of corrupting memory.
    """

    __slots__ = ("iov", "entries")

    def __init__(self, count: int) -> None:
        self.iov = liburing.Iovec([_PLACEHOLDER] * count)
        header_at = id(self.iov) + object.__basicsize__
        if type(self.iov).__basicsize__ < object.__basicsize__ + 16:
            raise RuntimeError("unrecognised liburing.Iovec layout")
        length, pointer = (ctypes.c_size_t * 2).from_address(header_at)
        if length != count:  # checked before following the pointer
            raise RuntimeError("unrecognised liburing.Iovec layout")
        self.entries = (_IovecEntry * count).from_address(pointer)
        first = self.entries[0]
        if first.iov_base != _span(memoryview(_PLACEHOLDER))[0] or first.iov_len != 1:
            raise RuntimeError("unrecognised liburing.Iovec layout")

    def point(self, index: int, address: int, nbytes: int) -> None:
        entry = self.entries[index]
        entry.iov_base = address
        entry.iov_len = nbytes


class _Batch:
    """One ``submit`` call; touched only under the engine lock."""

    __slots__ = ("future", "results", "remaining", "write")

    def __init__(self, future: Future[list[int]], size: int, write: bool) -> None:
        self.future = future
        self.results = [0] * size
        self.remaining = size
        self.write = write

    def finish(self, index: int, result: int) -> bool:
        """Record one result; True when it was the batch's last."""
        self.results[index] = result
        self.remaining -= 1
        return self.remaining == 0


class _Op:
    """One request waiting for or in the ring.

    Holding ``buffer`` keeps the request's memory from being garbage
    collected until the kernel is done with it (an explicit ``release()`` by
    the caller is, as in C, the caller's bug); ``address``/``nbytes`` are what
    the kernel gets.
    """

    __slots__ = ("batch", "index", "file", "offset", "buffer", "address", "nbytes")

    def __init__(self, batch: _Batch, index: int, request: IORequest) -> None:
        self.batch = batch
        self.index = index
        self.file = request.file
        self.offset = request.offset
        self.buffer = request.buffer
        self.address, self.nbytes = _span(request.buffer)


class UringEngine(IOEngine):
    """Registered files, optional registered buffers, one ring per engine."""

    name = "uring"

    def __init__(self, fds: Sequence[int], queue_depth: int) -> None:
        super().__init__(fds, queue_depth)
        self._depth = min(queue_depth, MAX_QUEUE_DEPTH)
        # One Iovec per submission slot: reusable once io_uring_submit returns
        # (IORING_FEAT_SUBMIT_STABLE), so ``_depth`` of them always suffice.
        self._slots = [_SlotIovec(1) for _ in range(self._depth)]
        self._next_slot = 0
        self._ring = liburing.Ring()
        try:
            # SUBMIT_ALL: a bad entry fails alone instead of stalling the rest.
            liburing.io_uring_queue_init(
                self._depth, self._ring, liburing.IORING_SETUP_SUBMIT_ALL
            )
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            liburing.io_uring_queue_init(self._depth, self._ring)  # kernel < 5.18
        self._efd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            # The binding wants FileIndex kept alive while the files are used.
            self._files = liburing.FileIndex(self.fds or [-1])
            liburing.io_uring_register_files(self._ring, self._files)
            liburing.io_uring_register_eventfd(self._ring, self._efd)
        except BaseException:
            liburing.io_uring_queue_exit(self._ring)
            os.close(self._efd)
            raise
        self._lock = threading.Lock()
        self._pending: deque[_Op] = deque()
        self._inflight: dict[int, _Op] = {}
        self._next_tag = _NOP_TAG + 1
        self._closing = False
        # Registered buffers: sorted start addresses, (end, index) per start,
        # and the views that keep the registered memory from being freed.
        self._starts: list[int] = []
        self._ends: list[tuple[int, int]] = []
        self._pinned: list[memoryview] = []
        self._completions = 0
        self._fixed = 0
        self._stalled = False
        self._reaper = threading.Thread(
            target=self._reap_forever, name="lmcache-tiered-uring", daemon=True
        )
        self._reaper.start()

    @property
    def ring_fd(self) -> int:
        """The ring's file descriptor (``/proc/self/fdinfo/<fd>`` describes it)."""
        return int(self._ring.ring_fd)

    def stats(self) -> dict[str, int]:
        """Completions reaped and requests that used a registered buffer."""
        with self._lock:
            return {"completions": self._completions, "fixed": self._fixed}

    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        future: Future[list[int]] = Future()
        future.set_running_or_notify_cancel()
        batch = _Batch(future, len(requests), write)
        ops: list[_Op] = []
        for index, request in enumerate(requests):
            if not 0 <= request.file < len(self.fds):
                batch.finish(index, -errno.EBADF)
            elif not write and request.buffer.readonly:
                batch.finish(index, -errno.EFAULT)
            else:
                try:
                    ops.append(_Op(batch, index, request))
                except BufferError:  # not contiguous
                    batch.finish(index, -errno.EINVAL)
        if not ops:
            future.set_result(batch.results)
            return future
        with self._lock:
            if self._closing:
                raise RuntimeError("UringEngine is closed")
            self._pending.extend(ops)
            # Under the lock: once close() has run, the eventfd number may
            # belong to another file. The write never blocks.
            os.eventfd_write(self._efd, 1)  # the reaper submits
        return future

    def register_buffers(self, regions: Sequence[memoryview]) -> bool:
        """Register memory that requests will read into or write from.

        A request whose buffer lies inside one registered piece then goes out
        as ``readv_fixed``/``writev_fixed`` (no page pinning per request); any
        other buffer still works through plain ``readv``/``writev``. Regions
        over 1 GiB are split (a request straddling a split takes the plain
        path). Replaces any earlier registration. Returns False, with a log
        line, when the kernel lacks the fixed vectored opcodes (before 6.15)
        or refuses the memory (read-only, ``RLIMIT_MEMLOCK`` for non-root).
        """
        views = [memoryview(region).cast("B") for region in regions]
        pieces = [
            view[start : start + MAX_FIXED_BUFFER]
            for view in views
            for start in range(0, len(view), MAX_FIXED_BUFFER)
        ]
        with self._lock:
            if self._closing:
                raise RuntimeError("UringEngine is closed")
            if not self._fixed_supported_locked():
                logger.info("io_uring: no READV_FIXED (kernel < 6.15); plain readv")
                return False
            self._unregister_buffers_locked()
            if not pieces:
                return True
            spans = [_span(piece) for piece in pieces]
            table = _SlotIovec(len(pieces))
            for index, (address, nbytes) in enumerate(spans):
                table.point(index, address, nbytes)
            try:
                liburing.io_uring_register_buffers(self._ring, table.iov)
            except OSError as exc:
                logger.warning("io_uring: cannot register buffers (%s)", exc)
                return False
            order = sorted(range(len(spans)), key=lambda index: spans[index][0])
            self._starts = [spans[index][0] for index in order]
            self._ends = [(sum(spans[index]), index) for index in order]
            self._pinned = pieces
        logger.info(
            "io_uring: registered %d buffer(s), %.1f MiB",
            len(pieces),
            sum(len(piece) for piece in pieces) / 2**20,
        )
        return True

    def _fixed_supported_locked(self) -> bool:
        probe = liburing.io_uring_get_probe_ring(self._ring)
        try:
            return all(
                liburing.io_uring_opcode_supported(probe, op)
                for op in (
                    liburing.io_uring_op.IORING_OP_READV_FIXED,
                    liburing.io_uring_op.IORING_OP_WRITEV_FIXED,
                )
            )
        finally:
            liburing.io_uring_free_probe(probe)

    def _unregister_buffers_locked(self) -> None:
        if not self._pinned:
            return
        # In-flight fixed requests keep their pages: the kernel holds a
        # reference to the old table until they complete.
        liburing.io_uring_unregister_buffers(self._ring)
        self._starts, self._ends, self._pinned = [], [], []

    def _buffer_index(self, op: _Op) -> int:
        """Index of the registered piece holding all of the op's buffer, or -1."""
        slot = bisect.bisect_right(self._starts, op.address) - 1
        if slot < 0:
            return -1
        end, index = self._ends[slot]
        return index if op.address + op.nbytes <= end else -1

    def _reap_forever(self) -> None:
        """The reaper: the only thread that submits to or reaps from the ring."""
        cqe = liburing.Cqe()
        while True:
            if self._stalled:
                time.sleep(_RETRY_S)
            else:
                os.eventfd_read(self._efd)  # releases the GIL while waiting
            done: list[_Batch] = []
            with self._lock:
                self._reap_locked(cqe, done)
                self._fill_locked(done)
                stop = self._closing and not self._pending and not self._inflight
            for batch in done:
                batch.future.set_result(batch.results)
            if stop:
                return

    def _reap_locked(self, cqe: liburing.Cqe, done: list[_Batch]) -> None:
        # CqeIter + cq_advance: cqe[i] for i > 0 does not wrap around the ring.
        count = 0
        for _ in liburing.CqeIter(self._ring, cqe):
            entry = cqe[0]
            count += 1
            try:
                result = entry.res
            except OSError as exc:  # the binding raises for negative results
                result = -(exc.errno or errno.EIO)
            op = self._inflight.pop(entry.user_data, None)
            if op is not None and op.batch.finish(op.index, result):
                done.append(op.batch)
        if count:
            liburing.io_uring_cq_advance(self._ring, count)
            self._completions += count

    def _fill_locked(self, done: list[_Batch]) -> None:
        while self._pending and len(self._inflight) < self._depth:
            # Flush before taking an entry: a taken entry goes out on the next
            # submit whether it was filled or not.
            if self._next_slot == len(self._slots) and not self._submit_locked():
                return
            sqe = liburing.io_uring_get_sqe(self._ring)
            if sqe is None:  # submission queue full: flush it, then retry
                if not self._submit_locked():
                    return
                sqe = liburing.io_uring_get_sqe(self._ring)
                if sqe is None:
                    return
            op = self._pending.popleft()
            tag = self._prep(sqe, op)
            if tag != _NOP_TAG:
                self._inflight[tag] = op
            elif op.batch.finish(op.index, -errno.EINVAL):
                done.append(op.batch)
        if liburing.io_uring_sq_ready(self._ring):
            self._submit_locked()

    def _prep(self, sqe: liburing.SQE, op: _Op) -> int:
        """Fill one submission slot; its tag, or ``_NOP_TAG`` when invalid.

        A failed ``io_uring_prep_*`` (e.g. an offset that does not fit in 64
        bits) leaves its slot in the queue: it becomes a no-op so stale
        contents never reach the kernel.
        """
        slot = self._slots[self._next_slot]
        self._next_slot += 1
        slot.point(0, op.address, op.nbytes)
        index = self._buffer_index(op) if self._starts else -1
        try:
            if index < 0:
                prep = (
                    liburing.io_uring_prep_writev
                    if op.batch.write
                    else liburing.io_uring_prep_readv
                )
                prep(sqe, op.file, slot.iov, op.offset)
            else:
                prep_fixed = (
                    liburing.io_uring_prep_writev_fixed
                    if op.batch.write
                    else liburing.io_uring_prep_readv_fixed
                )
                prep_fixed(sqe, op.file, slot.iov, index, op.offset)
        except (OverflowError, TypeError, ValueError):
            liburing.io_uring_prep_nop(sqe)
            liburing.io_uring_sqe_set_data64(sqe, _NOP_TAG)
            return _NOP_TAG
        if index >= 0:
            self._fixed += 1
        tag = self._next_tag
        self._next_tag += 1
        liburing.io_uring_sqe_set_flags(sqe, liburing.IOSQE_FIXED_FILE)
        liburing.io_uring_sqe_set_data64(sqe, tag)
        return tag

    def _submit_locked(self) -> bool:
        """Hand prepared entries to the kernel; False when it must be retried.

        Entries the kernel refuses for lack of resources stay in the
        submission queue; the reaper retries after a short sleep instead of
        waiting for a completion that may never come.
        """
        while True:
            try:
                liburing.io_uring_submit(self._ring)
            except InterruptedError:
                continue
            except OSError as exc:
                if not self._stalled:
                    logger.warning("io_uring_submit failed (%s); retrying", exc)
                self._stalled = True
                return False
            self._stalled = False
            self._next_slot = 0
            return True

    def close(self) -> None:
        if threading.current_thread() is self._reaper:
            raise RuntimeError("UringEngine.close() called from a completion callback")
        with self._lock:
            first = not self._closing
            if first:
                self._closing = True
                os.eventfd_write(self._efd, 1)
        self._reaper.join()
        if first:
            with self._lock:
                self._unregister_buffers_locked()
            liburing.io_uring_queue_exit(self._ring)
            os.close(self._efd)
