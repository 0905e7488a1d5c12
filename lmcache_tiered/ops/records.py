"""Read-only access to one owner's files of a tier, for the operator tools.

A tier directory holds, per owner (``kv-w<worker>``), a header file on the
first path, one slab per path and a lock file, named by
:class:`lmcache_tiered.storage.layout.TierNames`. :class:`TierFiles` opens them
without O_DIRECT and without taking the lock, decodes the superblock and
every header with the live tier's own scan and validation
(:func:`lmcache_tiered.storage.layout.scan_headers`), and reads payloads extent by
extent to check their CRC.

The files are checked, not trusted: each is opened without blocking and only
if it is a regular file (a FIFO planted under a tier name would hang the
tool), and a superblock declaring slots larger than :data:`MAX_RECORD_BYTES`
is refused, so no size read from disk decides how much memory is taken.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.keys import StoreKey
from lmcache_tiered.storage.files import NotRegularFile, open_regular, try_lock
from lmcache_tiered.storage.layout import (
    HEADER_SIZE,
    CorruptRecord,
    Geometry,
    RecordHeader,
    TierNames,
    align_up,
    payload_checksum,
    scan_headers,
)
from lmcache_tiered.storage.layout import newest as newest_records

#: Payload bytes read per call while checking a record.
_CHECK_BYTES = 4 << 20
#: The largest slot the tools read: a real chunk is tens of MiB; a superblock
#: declaring more is damaged or crafted.
MAX_RECORD_BYTES = 1 << 30


class ToolError(Exception):
    """The tool cannot run as asked (exit code 2): the message says why."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One non-empty header block: a record, or why it is not one."""

    index: int
    header: RecordHeader | None
    problem: str | None = None


def owners(path: str, only: str | None = None) -> list[str]:
    """Owners (``kv-w0``, ...) with a header file under ``path``, or just
    ``only``; ToolError if there are none."""
    if only:
        return [only]
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise ToolError(f"{path}: {exc.strerror}") from None
    found = sorted(o for n in names if (o := TierNames.owner_of(n)) is not None)
    if not found:
        raise ToolError(f"{path}: no tier files (*{TierNames.HEADER}) here")
    return found


def lock_holder(lock_name: str) -> int | None:
    """PID of the live process whose tier holds ``lock_name``, from
    /proc/locks: taking the lock even briefly could make a starting server
    fail, so read-only tools only look."""
    try:
        info = os.stat(lock_name, follow_symlinks=False)
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return None
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for line in lines:
        fields = line.split()
        if "FLOCK" in fields and device in fields:
            return int(fields[fields.index(device) - 1])
    return None


class TierFiles:
    """One owner's header file and slabs, opened without following links.

    ``paths`` are the tier's directories in the order of its
    ``tiered.<tier>.paths`` (stripe unit ``u`` lives on path ``u % N``).
    ``writable`` opens the header file for a repair: take :meth:`lock` first.
    """

    def __init__(self, paths: Sequence[str], owner: str, *, writable: bool = False):
        self.paths = list(paths)
        self.owner = owner
        names = TierNames(tuple(self.paths), owner)
        self.header_name, self.lock_name = names.header, names.lock
        self.slab_names = names.slabs
        self._fds: list[int] = []
        try:
            mode = os.O_RDWR if writable else os.O_RDONLY
            self.header_fd = self._open(self.header_name, mode)
            self.slab_fds = [self._open(n, os.O_RDONLY) for n in self.slab_names]
            self.header_bytes = os.fstat(self.header_fd).st_size
            self.geometry = Geometry.decode_superblock(
                os.pread(self.header_fd, HEADER_SIZE, 0)
            )
            devices = None if self.geometry is None else self.geometry.devices
            if devices is not None and devices != len(self.paths):
                raise ToolError(
                    f"{self.header_name}: this tier has {devices} device(s); give "
                    f"its {devices} paths in the order of tiered.<tier>.paths"
                )
            if self.geometry and self.geometry.max_payload > MAX_RECORD_BYTES:
                raise ToolError(
                    f"{self.header_name}: its superblock declares slots of "
                    f"{self.geometry.max_payload} bytes, more than the "
                    f"{MAX_RECORD_BYTES} this tool reads: damaged or crafted"
                )
        except BaseException:
            self.close()
            raise
        #: whole header blocks after the superblock
        self.slots = max(self.header_bytes // HEADER_SIZE - 1, 0)
        #: the header file ends inside a block (truncated)
        self.cut_tail = self.header_bytes % HEADER_SIZE != 0

    def _open(self, name: str, mode: int) -> int:
        try:
            fd = open_regular(name, mode)
        except NotRegularFile as exc:
            raise ToolError(str(exc)) from None
        except OSError as exc:
            why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise ToolError(f"{name}: {why}") from None
        self._fds.append(fd)
        return fd

    def lock(self) -> None:
        """Take the tier's lock as a live tier does; ToolError if one holds it."""
        fd = self._open(self.lock_name, os.O_RDONLY | os.O_CREAT)
        if not try_lock(fd):
            raise ToolError(
                f"{self.lock_name} is held by a live process "
                f"(pid {lock_holder(self.lock_name) or '?'}): stop it first"
            )

    @property
    def disk_bytes(self) -> int:
        """Bytes of the header file and slabs as the file system sees them."""
        return self.header_bytes + sum(os.fstat(fd).st_size for fd in self.slab_fds)

    def scan(self) -> Iterator[Slot]:
        """Every non-empty header block, decoded as a live tier would."""
        if self.geometry is None:
            return

        def read(first: int, count: int) -> bytes:
            offset = Geometry.header_offset(first)
            return os.pread(self.header_fd, count * HEADER_SIZE, offset)

        found, _ = scan_headers(read, self.slots, self.geometry.max_payload)
        for slot, header in found:
            if isinstance(header, CorruptRecord):
                yield Slot(slot, None, f"header: {header}")
            else:
                yield Slot(slot, header)

    def read_payload(self, slot: int, header: RecordHeader) -> memoryview:
        """The record's payload, checked; CorruptRecord if short or bad."""
        buffer = aligned_buffer(align_up(header.payload_size))
        self._read_checked(slot, header, buffer)
        return buffer[: header.payload_size]

    def check_payload(self, slot: int, header: RecordHeader) -> None:
        """Check the record's payload through a small buffer; CorruptRecord
        if short or bad."""
        self._read_checked(slot, header, None)

    def _read_checked(
        self, slot: int, header: RecordHeader, into: memoryview | None
    ) -> None:
        """Read the payload in order, into ``into`` or a scratch buffer of at
        most _CHECK_BYTES, and compare its checksum with the header's."""
        assert self.geometry is not None
        scratch = aligned_buffer(_CHECK_BYTES) if into is None else into
        crc = 0
        for extent in self.geometry.extents(slot, header.payload_size):
            fd = self.slab_fds[extent.device]
            if extent.offset + extent.length > os.fstat(fd).st_size:
                raise CorruptRecord(
                    f"payload cut short on {self.slab_names[extent.device]}"
                )
            for done in range(0, extent.length, _CHECK_BYTES):
                length = min(_CHECK_BYTES, extent.length - done)
                start = 0 if into is None else extent.start + done
                view = scratch[start : start + length]
                if os.preadv(fd, [view], extent.offset + done) != length:
                    raise CorruptRecord(
                        f"payload cut short on {self.slab_names[extent.device]}"
                    )
                crc = payload_checksum(view, header.version, crc)
        if crc != header.payload_crc:
            raise CorruptRecord("payload checksum mismatch")

    def drop(self, slot: int) -> None:
        """Zero a record's header: a live tier then sees a free slot."""
        os.pwrite(self.header_fd, bytes(HEADER_SIZE), Geometry.header_offset(slot))

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> TierFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def newest(slots: Sequence[Slot]) -> tuple[dict[bytes, Slot], list[Slot]]:
    """The record a live tier serves per key (highest sequence), and the
    stale older copies it ignores (see :func:`lmcache_tiered.storage.layout.newest`)."""

    def header(slot: Slot) -> RecordHeader:
        assert slot.header is not None
        return slot.header

    return newest_records([s for s in slots if s.header is not None], header)


def group_of(key: StoreKey) -> str:
    """What a chunk's key says about whose it is: the model, plus the
    request tags (tenant, user) or the cache salt."""
    text = getattr(key, "model_name", "?")
    tags = getattr(key, "tags", None)
    if tags:
        text += "".join(f" {k}={v}" for k, v in tags)
    salt = getattr(key, "cache_salt", "")
    return f"{text} salt={salt}" if salt else text


class Progress:
    """A one-line progress bar on stderr (only on a terminal, or forced)."""

    def __init__(
        self, total: int, label: str, *, force: bool = False, out: TextIO | None = None
    ):
        self.out = out or sys.stderr
        self.enabled = force or self.out.isatty()
        self.total, self.label = max(total, 1), label
        self._shown = 0.0
        self._done = -1

    def update(self, done: int) -> None:
        """Redraw, at most ten times a second (always for the last step)."""
        now = time.monotonic()
        if not self.enabled or done == self._done:
            return
        if now - self._shown < 0.1 and done < self.total:
            return
        self._shown, self._done = now, done
        filled = 30 * done // self.total
        self.out.write(
            f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}"
        )
        self.out.flush()

    def finish(self) -> None:
        if self.enabled:
            self.update(self.total)
            self.out.write("\n")
