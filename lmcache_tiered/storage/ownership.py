"""Who writes an owner's files: the ``flock``, and the owner record beside it.

``flock`` keeps a second process off an owner's files where the file system
enforces it. On NFS mounted ``nolock`` or ``local_lock=flock``, or Lustre with
``localflock``, a lock is seen only on the host that took it, so two hosts
given one host id (one Helm value for every replica) would both write one
owner's files. The owner's lock file therefore also holds an
:class:`OwnerRecord`: a random nonce, the host and process, and a heartbeat the
tier renews every probe period. A writer reads it back before every write
batch and stops writing once another nonce is there; a process that finds
another writer's live record (renewed within :data:`STALE_S`) does not write
until it goes stale. Both are named in the log.

Heartbeats compare wall clocks across hosts: skew under :data:`STALE_S` (NTP)
is assumed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import time
import zlib
from dataclasses import dataclass, replace

from lmcache_tiered.config import ConfigError
from lmcache_tiered.storage.files import lock_holder, printable, try_lock

#: Seconds after its last heartbeat that an owner record no longer stands.
STALE_S = 30.0
_MAGIC = b"LMTROWN1"
# magic, nonce, heartbeat (ns since the epoch), pid, host; then a CRC32
_RECORD = struct.Struct("<8s16sQI64s")
_CRC = struct.Struct("<I")


def take_lock(fd: int, setting: str, name: str, what: str = "is held") -> None:
    """flock ``fd`` (the file ``name``, under ``setting``) for this process;
    a ConfigError naming the holder if another process has it."""
    if try_lock(fd):
        return
    holder = lock_holder(fd)
    by = "another live process" if holder is None else f"live process {holder}"
    raise ConfigError(
        f"{setting}: {name} {what} by {by}; give each LMCache instance its own "
        "directories (a directory can be reached by several names: symbolic "
        "links, bind mounts)"
    )


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    """The writer an owner's lock file names."""

    nonce: bytes
    heartbeat_ns: int
    pid: int
    host: str

    def __str__(self) -> str:
        return f"process {self.pid} on {printable(self.host)}"

    def encode(self) -> bytes:
        host = self.host.encode()[:64]
        body = _RECORD.pack(_MAGIC, self.nonce, self.heartbeat_ns, self.pid, host)
        return body + _CRC.pack(zlib.crc32(body))

    @staticmethod
    def decode(data: bytes) -> OwnerRecord | None:
        """The record in ``data``; None where there is none (an empty lock
        file, a torn or foreign one)."""
        if len(data) < _RECORD.size + _CRC.size or data[:8] != _MAGIC:
            return None
        (crc,) = _CRC.unpack_from(data, _RECORD.size)
        if zlib.crc32(data[: _RECORD.size]) != crc:
            return None
        _, nonce, heartbeat_ns, pid, host = _RECORD.unpack_from(data)
        text = host.rstrip(b"\0").decode(errors="replace")
        return OwnerRecord(nonce, heartbeat_ns, pid, text)


class OwnerLease:
    """This process's claim on an owner's files, kept in the lock file ``fd``
    (``name``). Its methods do one small read or write: never under a lock."""

    def __init__(self, fd: int, name: str) -> None:
        self._fd = fd
        self.name = name
        self.me = OwnerRecord(os.urandom(16), 0, os.getpid(), socket.gethostname())

    def read(self) -> OwnerRecord | None:
        try:
            return OwnerRecord.decode(os.pread(self._fd, _RECORD.size + _CRC.size, 0))
        except OSError:
            return None

    def taken_by(self) -> OwnerRecord | None:
        """The other writer whose record replaced ours, if one did."""
        other = self.read()
        return other if other is not None and other.nonce != self.me.nonce else None

    def rival(self) -> OwnerRecord | None:
        """Another writer's live record: renewed within STALE_S, by a live
        process where it is one of this host's (None: the files are ours to
        take)."""
        other = self.taken_by()
        if other is None:
            return None
        if other.host == self.me.host and (
            other.pid == self.me.pid or not _alive(other.pid)
        ):
            return None  # this process's earlier claim, or a dead process's
        return other if time.time_ns() - other.heartbeat_ns < STALE_S * 1e9 else None

    def claim(self) -> None:
        """Write our record with a fresh heartbeat (OSError if it cannot)."""
        record = replace(self.me, heartbeat_ns=time.time_ns())
        os.pwrite(self._fd, record.encode(), 0)

    def renew(self) -> OwnerRecord | None:
        """Heartbeat; the other writer instead, if its record replaced ours.
        A failed write is left to the tier's own I/O to notice."""
        if (other := self.taken_by()) is not None:
            return other
        with contextlib.suppress(OSError):
            self.claim()
        return None

    def conflict(self, other: OwnerRecord) -> str:
        """Why this process does not write the files ``other`` writes."""
        return (
            f"{self.name} names {other} as the writer of these files, and this is "
            f"{self.me}: two processes write one owner's files, so the file "
            "system does not enforce flock (NFS nolock or local_lock=flock, Lustre "
            "localflock) and the two were given one host id; give each host its "
            f"own. This process does not write them until that record is "
            f"{STALE_S:g} s old"
        )


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists."""
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True
