"""A thin io_uring ring over the kernel's three system calls (ctypes, no binding).

Why our own layer instead of a binding: the PyPI ``liburing`` wheels carry
AVX-512 code and kill the process with SIGILL on CPUs without it (AMD EPYC
Rome/Milan, many Intel parts), which no ``except`` can catch. This module needs
only libc and the kernel ABI (``linux/io_uring.h``, stable since 5.6), so it
runs on every x86-64 and aarch64 CPU; and ctypes releases the GIL for every
system call, so a wait in the kernel never freezes LMCache's threads.

Memory ordering, the one subtle part of sharing rings with the kernel:

* The kernel publishes completions with a store-release of the CQ tail and
  reads submissions after a load-acquire of the SQ tail. User space must
  write an SQE before releasing the SQ tail, read the CQ tail with acquire
  before reading CQEs, and release the CQ head only after the reads.
* On x86-64 (TSO) every aligned 4-byte load is an acquire and every store a
  release, and each Python-level access below is a separate C call that the
  compiler cannot reorder: plain accesses are correct.
* Elsewhere (aarch64) the head/tail accesses go through libatomic's
  ``__atomic_load_4``/``__atomic_store_4`` with acquire/release order.

The module imports nothing but the standard library, so it can be run as a
script (``python ring.py``) for the child-process probe in
:mod:`lmcache_tiered.io.probe`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import platform
import struct
import sys
from collections.abc import Sequence
from typing import Any

# System call numbers: the same on x86-64 and aarch64 (and every other
# architecture with the unified table).
_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427

# Setup flags, features, enter flags, SQE flags (linux/io_uring.h).
SETUP_CLAMP = 1 << 4
SETUP_SUBMIT_ALL = 1 << 7
FEAT_SINGLE_MMAP = 1 << 0
FEAT_NODROP = 1 << 1
ENTER_GETEVENTS = 1 << 0
SQE_FIXED_FILE = 1 << 0

# Opcodes used here.
OP_NOP = 0
OP_READ_FIXED = 4
OP_WRITE_FIXED = 5
OP_READ = 22
OP_WRITE = 23
#: What the engine needs; READ/WRITE make 5.6 the oldest kernel that works.
REQUIRED_OPS = {
    OP_NOP: "NOP",
    OP_READ: "READ",
    OP_WRITE: "WRITE",
    OP_READ_FIXED: "READ_FIXED",
    OP_WRITE_FIXED: "WRITE_FIXED",
}

# io_uring_register opcodes.
_REGISTER_BUFFERS = 0
_UNREGISTER_BUFFERS = 1
_REGISTER_FILES = 2
_REGISTER_EVENTFD = 4
_REGISTER_PROBE = 8
_PROBE_OPS = 64
_OP_SUPPORTED = 1

# mmap offsets of the rings and the SQE array.
_OFF_SQ_RING = 0
_OFF_SQES = 0x10000000

#: struct io_uring_sqe (64 bytes): opcode, flags, ioprio, fd, off, addr, len,
#: rw_flags, user_data, buf_index, personality, splice_fd_in, addr3, pad.
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
#: struct io_uring_cqe (16 bytes): user_data, res, flags.
_CQE = struct.Struct("<QiI")
assert _SQE.size == 64 and _CQE.size == 16


def _ring_offsets(*names: str) -> list[tuple[str, type]]:
    """Fields of io_sqring_offsets/io_cqring_offsets: eight u32, then a u64."""
    return [(name, ctypes.c_uint32) for name in names] + [
        ("user_addr", ctypes.c_uint64)
    ]


class _SqOffsets(ctypes.Structure):
    _fields_ = _ring_offsets(
        "head",
        "tail",
        "ring_mask",
        "ring_entries",
        "flags",
        "dropped",
        "array",
        "resv1",
    )


class _CqOffsets(ctypes.Structure):
    _fields_ = _ring_offsets(
        "head",
        "tail",
        "ring_mask",
        "ring_entries",
        "overflow",
        "cqes",
        "flags",
        "resv1",
    )


class _Params(ctypes.Structure):
    """struct io_uring_params (120 bytes)."""

    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SqOffsets),
        ("cq_off", _CqOffsets),
    ]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _ProbeOp(ctypes.Structure):
    _fields_ = [
        ("op", ctypes.c_uint8),
        ("resv", ctypes.c_uint8),
        ("flags", ctypes.c_uint16),
        ("resv2", ctypes.c_uint32),
    ]


class _Probe(ctypes.Structure):
    _fields_ = [
        ("last_op", ctypes.c_uint8),
        ("ops_len", ctypes.c_uint8),
        ("resv", ctypes.c_uint16),
        ("resv2", ctypes.c_uint32 * 3),
        ("ops", _ProbeOp * _PROBE_OPS),
    ]


assert ctypes.sizeof(_Params) == 120

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _call(number: int, *args: int | None) -> int:
    """One system call; raises OSError with the kernel's errno on failure.

    Every argument goes as a C long, so the kernel sees exactly what the C
    prototype would pass (ctypes' default int would truncate pointers).
    """
    result = _syscall(
        ctypes.c_long(number),
        *(ctypes.c_long(arg or 0) for arg in args),
    )
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(result)


def _ordering() -> tuple[object, object] | None:
    """libatomic's acquire load and release store, or None where TSO holds."""
    if platform.machine() in ("x86_64", "AMD64", "i386", "i686"):
        return None
    name = ctypes.util.find_library("atomic") or "libatomic.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise OSError(
            f"io_uring on {platform.machine()} needs libatomic for ordered ring "
            f"accesses ({exc}); install it (Debian/Ubuntu: libatomic1)"
        ) from exc
    load, store = lib.__atomic_load_4, lib.__atomic_store_4
    load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint32
    store.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
    store.restype = None
    return load, store


_ACQUIRE, _RELEASE = 2, 3  # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE


class _Word:
    """One 32-bit head/tail shared with the kernel, read and written in order."""

    __slots__ = ("_words", "_index", "_address", "_atomics")

    def __init__(
        self, words: memoryview, base: int, offset: int, atomics: tuple[Any, Any] | None
    ) -> None:
        self._words, self._index = words, offset // 4
        self._address = base + offset
        self._atomics = atomics

    def load_acquire(self) -> int:
        if self._atomics is None:
            return int(self._words[self._index])
        return int(self._atomics[0](self._address, _ACQUIRE))

    def store_release(self, value: int) -> None:
        value &= 0xFFFFFFFF
        if self._atomics is None:
            self._words[self._index] = value
        else:
            self._atomics[1](self._address, value, _RELEASE)


class Ring:
    """One io_uring instance: prepare entries, submit, reap, register.

    Not thread-safe: one thread owns a ring (the engine's reaper). Entries are
    prepared with :meth:`prep`, handed to the kernel by :meth:`submit`, and
    their completions collected by :meth:`reap` as ``(user_data, res)``.
    """

    def __init__(self, entries: int, flags: int = 0) -> None:
        atomics = _ordering()
        params = _Params(flags=flags | SETUP_CLAMP)
        try:
            self.fd = _call(_SYS_SETUP, entries, ctypes.addressof(params))
        except OSError as exc:
            if not flags & SETUP_SUBMIT_ALL or exc.errno != errno.EINVAL:
                raise
            params = _Params(flags=(flags & ~SETUP_SUBMIT_ALL) | SETUP_CLAMP)
            self.fd = _call(_SYS_SETUP, entries, ctypes.addressof(params))  # < 5.18
        self.flags = params.flags
        self.features = params.features
        self._maps: list[mmap.mmap] = []
        try:
            if not params.features & FEAT_SINGLE_MMAP:
                raise OSError(
                    errno.EOPNOTSUPP, "kernel too old for io_uring here (< 5.4)"
                )
            sq, cq = params.sq_off, params.cq_off
            ring_bytes = max(
                sq.array + params.sq_entries * 4,
                cq.cqes + params.cq_entries * _CQE.size,
            )
            rings = self._map(ring_bytes, _OFF_SQ_RING)
            sqes = self._map(params.sq_entries * _SQE.size, _OFF_SQES)
        except BaseException:
            self.close()
            raise
        base = ctypes.addressof(ctypes.c_char.from_buffer(rings))
        self._words = memoryview(rings).cast("I")
        self._sqes = memoryview(sqes)
        self._cq_bytes = memoryview(rings)
        self.sq_entries = int(params.sq_entries)
        self.cq_entries = params.cq_entries
        self._sq_mask = self._words[sq.ring_mask // 4]
        self._cq_mask = self._words[cq.ring_mask // 4]
        self._sq_head = _Word(self._words, base, sq.head, atomics)
        self._sq_tail = _Word(self._words, base, sq.tail, atomics)
        self._cq_head = _Word(self._words, base, cq.head, atomics)
        self._cq_tail = _Word(self._words, base, cq.tail, atomics)
        self._cqes = cq.cqes
        # The SQ index array maps ring slot i to SQE i, once and for all.
        first = sq.array // 4
        for slot in range(self.sq_entries):
            self._words[first + slot] = slot
        self._tail = self._sq_tail.load_acquire()  # only we move the SQ tail
        self._cq_seen = self._cq_head.load_acquire()  # only we move the CQ head

    def _map(self, length: int, offset: int) -> mmap.mmap:
        region = mmap.mmap(
            self.fd,
            length,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=offset,
        )
        self._maps.append(region)
        return region

    def space(self) -> int:
        """Submission entries free to :meth:`prep` now."""
        return self.sq_entries - self.unsubmitted()

    def unsubmitted(self) -> int:
        """Prepared entries the kernel has not taken yet."""
        return (self._tail - self._sq_head.load_acquire()) & 0xFFFFFFFF

    def prep(
        self,
        opcode: int,
        fd: int,
        address: int,
        length: int,
        offset: int,
        user_data: int,
        sqe_flags: int = 0,
        buf_index: int = 0,
    ) -> None:
        """Fill the next submission entry; call :meth:`space` first.

        Raises struct.error (before touching the ring) when a field does not
        fit its C type, so a bad request never leaves a half-written entry.
        """
        packed = _SQE.pack(
            opcode, sqe_flags, 0, fd, offset, address, length, 0, user_data,
            buf_index, 0, 0, 0, 0,
        )  # fmt: skip
        slot = self._tail & self._sq_mask
        self._sqes[slot * _SQE.size : (slot + 1) * _SQE.size] = packed
        self._tail = (self._tail + 1) & 0xFFFFFFFF

    def submit(self, wait_for: int = 0) -> int:
        """Publish prepared entries and enter the kernel; entries it took.

        ``wait_for`` > 0 also waits (without the GIL) for that many
        completions. Raises OSError (EAGAIN, EBUSY, EINTR, ...) as the kernel
        reports it; entries not taken stay queued for the next call.
        """
        self._sq_tail.store_release(self._tail)
        pending = self.unsubmitted()
        if not pending and not wait_for:
            return 0
        flags = ENTER_GETEVENTS if wait_for else 0
        return _call(_SYS_ENTER, self.fd, pending, wait_for, flags, None, 0)

    def reap(self) -> list[tuple[int, int]]:
        """Every completion ready now, as ``(user_data, res)``; never blocks."""
        tail = self._cq_tail.load_acquire()
        head = self._cq_seen
        done = []
        while head != tail:
            at = self._cqes + (head & self._cq_mask) * _CQE.size
            user_data, res, _ = _CQE.unpack_from(self._cq_bytes, at)
            done.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        if done:
            self._cq_seen = head
            self._cq_head.store_release(head)
        return done

    def _register(self, opcode: int, argument: int | None, count: int) -> None:
        _call(_SYS_REGISTER, self.fd, opcode, argument, count)

    def register_files(self, fds: Sequence[int]) -> None:
        """Register ``fds`` as fixed files (index i = ``fds[i]``)."""
        table = (ctypes.c_int32 * len(fds))(*fds)
        _call(
            _SYS_REGISTER, self.fd, _REGISTER_FILES, ctypes.addressof(table), len(fds)
        )

    def register_eventfd(self, efd: int) -> None:
        """Have the kernel signal ``efd`` for every completion posted."""
        value = ctypes.c_int32(efd)
        self._register(_REGISTER_EVENTFD, ctypes.addressof(value), 1)

    def register_buffers(self, spans: Sequence[tuple[int, int]]) -> None:
        """Register ``(address, length)`` spans as fixed buffers 0..n-1."""
        table = (_Iovec * len(spans))(*(_Iovec(a, n) for a, n in spans))
        _call(
            _SYS_REGISTER,
            self.fd,
            _REGISTER_BUFFERS,
            ctypes.addressof(table),
            len(spans),
        )

    def unregister_buffers(self) -> None:
        _call(_SYS_REGISTER, self.fd, _UNREGISTER_BUFFERS, None, 0)

    def supported_ops(self) -> set[int]:
        """Opcodes this kernel implements (IORING_REGISTER_PROBE, 5.6)."""
        probe = _Probe()
        _call(
            _SYS_REGISTER, self.fd, _REGISTER_PROBE, ctypes.addressof(probe), _PROBE_OPS
        )
        count = min(probe.ops_len, _PROBE_OPS)
        return {
            probe.ops[i].op for i in range(count) if probe.ops[i].flags & _OP_SUPPORTED
        }

    def close(self) -> None:
        """Unmap the rings and close the ring; idempotent."""
        for name in ("_words", "_sqes", "_cq_bytes"):
            view = getattr(self, name, None)
            if view is not None:
                view.release()
                setattr(self, name, None)
        for region in self._maps:
            region.close()
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def self_test() -> str:
    """Set up a ring, check the opcodes, run a no-op and a read; a summary.

    Raises OSError or RuntimeError with the reason when io_uring cannot serve
    the engine here. Run in a child process first (see ``probe``): a kernel
    whose seccomp policy kills on io_uring must not take the server with it.
    """
    ring = Ring(4, SETUP_SUBMIT_ALL)
    try:
        supported = ring.supported_ops()
        missing = [name for op, name in REQUIRED_OPS.items() if op not in supported]
        if missing:
            raise RuntimeError(
                f"kernel lacks io_uring opcode(s) {', '.join(missing)} "
                "(Linux >= 5.6 needed)"
            )
        read_fd, write_fd = os.pipe()
        try:
            os.write(write_fd, b"ok")
            target = ctypes.create_string_buffer(2)
            ring.register_files([read_fd])
            ring.prep(OP_NOP, -1, 0, 0, 0, user_data=1)
            ring.prep(OP_READ, 0, ctypes.addressof(target), 2, 0, 2, SQE_FIXED_FILE)
            ring.submit(wait_for=2)
            results = dict(ring.reap())
        finally:
            os.close(read_fd)
            os.close(write_fd)
        if results != {1: 0, 2: 2} or target.raw != b"ok":
            raise RuntimeError(f"io_uring self-test got {results} / {target.raw!r}")
        return f"io_uring works (kernel {platform.release()}, {platform.machine()})"
    finally:
        ring.close()


def describe(exc: BaseException) -> str:
    """One line for a failed :func:`self_test`, naming the likely fix."""
    if not isinstance(exc, OSError) or exc.errno is None:
        return str(exc)
    name = errno.errorcode.get(exc.errno, "?")
    hint = ""
    if exc.errno in (errno.EPERM, errno.EACCES):
        hint = (
            ": blocked by a seccomp profile (Docker/Podman default) or by sysctl "
            "kernel.io_uring_disabled; allow io_uring_setup/io_uring_enter/"
            "io_uring_register in the container's seccomp profile or set "
            "kernel.io_uring_disabled=0"
        )
    elif exc.errno == errno.ENOSYS:
        hint = (
            ": this kernel has no io_uring (CONFIG_IO_URING off, Linux < 5.6, "
            "gVisor, qemu-user) or a seccomp profile hides it"
        )
    return f"io_uring: {name} {exc.strerror}{hint}"


if __name__ == "__main__":
    try:
        print(self_test())
    except (OSError, RuntimeError) as exc:
        print(describe(exc))
        sys.exit(1)
