"""The change log of a tier other hosts read: which header blocks its owner
wrote, so that a reader re-reads those blocks, not the whole header file.

A shared cold tier's readers (:mod:`lmcache_tiered.cache.shared`) re-read an
owner's headers whenever its header file changes; decoding all of them costs
seconds of CPU at 100,000 slots. So the owner appends, after each batch of
header writes, the slots of that batch to ``<owner>.changes`` on the tier's
first path (:attr:`lmcache_tiered.storage.layout.TierNames.changes`): one
``pwrite`` per batch, outside the tier's lock. A reader keeps its place in
the log and reads only what was appended since (:class:`ChangeReader`).

Format: a 16-byte head (magic, a random generation number), then one 8-byte
entry per slot written (the slot, and a CRC32 of it seeded with the head).
The log is advisory; the header blocks stay the truth. A reader whose place
is lost rescans the whole header file instead: no log (a release that writes
none), another generation (the owner restarted or rotated it), an entry torn
or damaged, a log shorter than the reader's place, or a log whose last
append is older than the header file's last change (something wrote headers
without logging them). The owner starts a new generation once its files are
its own and loaded (at start, after recovering), when an append fails, and
when the log holds :data:`ROTATE_PER_SLOT` entries per slot: a complete file
renamed over the old one, so a reader never sees a half-made head.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_tiered.storage.files import check_owner_trusted, open_regular

logger = logging.getLogger("lmcache_tiered")

MAGIC = b"LMTRCHG1"
# magic, generation
_HEAD = struct.Struct("<8sQ")
# slot, CRC32 of the slot's 4 bytes seeded with the head's CRC32
_ENTRY = struct.Struct("<II")
#: Entries per slot of the tier after which the owner starts a new log (8 B
#: each: the log stays under 2% of the header file's 4 KiB a slot); each
#: reader then rescans the header file once.
ROTATE_PER_SLOT = 8
#: A log whose last append is this much older than the header file's last
#: change is not followed: headers were written without being logged. (The
#: owner logs a batch right after writing its headers; concurrent batches
#: can log a little after another batch's headers.)
STALE_NS = 2_000_000_000


def _seed(generation: int) -> int:
    """What each entry's CRC starts from: entries of another generation, or
    zeros, fail it."""
    return zlib.crc32(_HEAD.pack(MAGIC, generation))


def _generation(head: bytes) -> int | None:
    if len(head) < _HEAD.size:
        return None
    magic, generation = _HEAD.unpack_from(head)
    return int(generation) if magic == MAGIC else None


def log_stamp(path: str) -> tuple[int, int] | None:
    """What changes whenever an owner logs (the inode: a new generation; the
    size: an append), for a look before reading anything; None: no log."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (info.st_ino, info.st_size) if stat.S_ISREG(info.st_mode) else None


class ChangeLog:
    """The owner's side: :meth:`start`, then :meth:`append` after each batch
    of header writes (nothing is logged before a start).

    Never raises into the write path: a log that cannot be written is
    removed (one WARNING), and its readers rescan as they did before logs,
    until the next start.
    """

    def __init__(self, path: str, slots: int, mode: int) -> None:
        self.path = path
        self._mode = mode
        self._limit = _HEAD.size + ROTATE_PER_SLOT * max(slots, 1) * _ENTRY.size
        #: guards the descriptor and the append offset (held across the
        #: log's own small writes only, never the tier's lock)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._seed = 0
        self._offset = 0

    def start(self) -> None:
        """Begin a new generation: every reader rescans once."""
        with self._lock:
            self._start()

    def append(self, slots: Sequence[int]) -> None:
        """Log that the header blocks of ``slots`` were written (written or
        attempted: a reader re-reads them either way)."""
        if not slots:
            return
        with self._lock:
            if self._fd is not None and (
                self._offset + len(slots) * _ENTRY.size > self._limit
            ):
                self._start()
            if self._fd is None:
                return
            data = b"".join(
                _ENTRY.pack(s, zlib.crc32(s.to_bytes(4, "little"), self._seed))
                for s in slots
            )
            try:
                done = os.pwrite(self._fd, data, self._offset) == len(data)
            except OSError:
                done = False
            if done:
                self._offset += len(data)
            else:  # a torn tail: a new generation makes every reader rescan
                self._start()

    def _start(self) -> None:
        """Begin a new generation (locked): a fresh file renamed over the log;
        :meth:`_stop` if that fails."""
        generation = int.from_bytes(os.urandom(8), "little")
        new = f"{self.path}.new"
        try:
            fd = open_regular(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self._mode)
            try:
                os.fchmod(fd, self._mode)  # whatever the umask: readers are others
                head = _HEAD.pack(MAGIC, generation)
                if os.pwrite(fd, head, 0) != len(head):
                    raise OSError(errno.EIO, "short write")
                os.replace(new, self.path)
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(new)
            self._stop(exc)
            return
        self._close()
        self._fd, self._seed, self._offset = fd, _seed(generation), _HEAD.size

    def _stop(self, exc: OSError) -> None:
        """No log from now on (locked): readers rescan on each change."""
        self._close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        logger.warning(
            "%s: cannot write this change log (%s); hosts reading this tier "
            "re-read its whole header file on each change instead",
            self.path,
            exc,
        )

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def close(self) -> None:
        """Stop logging; the log stays for its readers (idempotent)."""
        with self._lock:
            self._close()


@dataclass(frozen=True, slots=True)
class Tail:
    """What was logged since a reader's place: the slots, and when the last
    append happened (the log's mtime)."""

    slots: list[int]
    logged_ns: int

    def covers(self, header_mtime_ns: int) -> bool:
        """Whether the log kept up with a header file last changed at
        ``header_mtime_ns`` (else it was written without logging)."""
        return header_mtime_ns <= self.logged_ns + STALE_NS


class ChangeReader:
    """A reader's place in another owner's change log, for a tier of up to
    ``slots`` slots. A planted log is not followed (the header file is
    rescanned instead): one owned by a user outside ``uids`` (None: any), or
    with a longer tail than such an owner logs before rotating."""

    def __init__(self, path: str, slots: int, uids: frozenset[int] | None) -> None:
        self.path = path
        self._most = ROTATE_PER_SLOT * max(slots, 1) * _ENTRY.size
        self._uids = uids
        #: (generation, offset of the next entry); None: lost
        self._place: tuple[int, int] | None = None

    def mark(self) -> None:
        """Take the log's end as the place: call it just before rescanning
        the whole header file. An entry appended by then, torn or not, is for
        a header already written, which the rescan reads."""
        look = self._look(None)
        if look is None:
            self._place = None
            return
        generation, info, _ = look
        logged = max(info.st_size - _HEAD.size, 0) // _ENTRY.size * _ENTRY.size
        self._place = (generation, _HEAD.size + logged)

    def since(self) -> Tail | None:
        """The slots logged since the place, which moves past them; None if
        the place is lost (see the module docstring): rescan, after
        :meth:`mark`."""
        place, self._place = self._place, None
        look = None if place is None else self._look(place[1])
        if place is None or look is None:
            return None
        (generation, offset), (now, info, data) = place, look
        if now != generation or data is None or len(data) % _ENTRY.size:
            return None
        seed, slots = _seed(generation), []
        for slot, crc in _ENTRY.iter_unpack(data):
            if zlib.crc32(slot.to_bytes(4, "little"), seed) != crc:
                return None
            slots.append(slot)
        self._place = (generation, offset + len(data))
        return Tail(slots, info.st_mtime_ns)

    def _look(
        self, start: int | None
    ) -> tuple[int, os.stat_result, bytes | None] | None:
        """The log's generation, its stat, and its bytes from ``start`` on
        (None if not asked for, or the log is shorter than ``start`` or too
        long a way past it); None where it cannot be read (gone, a link or
        FIFO planted there, an untrusted owner, no permission, an I/O error)
        or has no head."""
        try:
            fd = open_regular(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            check_owner_trusted(fd, self.path, self._uids)
            generation = _generation(os.pread(fd, _HEAD.size, 0))
            info = os.fstat(fd)
            data = None
            if start is not None and 0 <= info.st_size - start <= self._most:
                data = os.pread(fd, info.st_size - start, start)
        except OSError:
            return None
        finally:
            os.close(fd)
        return None if generation is None else (generation, info, data)
