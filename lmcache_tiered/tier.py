"""One storage level: its devices, slab files, index, capacity and I/O engine.

A tier stores LMCache MemoryObjs in fixed-size slots striped over its devices
(see :mod:`lmcache_tiered.layout`). Reads and writes of a whole batch go to the
engine at once, so every device has a deep queue. The in-memory index is the
only shared state; it is guarded by one lock that is never held across I/O.

Health: a record that fails its checks is a miss and is dropped; a device that
fails is a miss for the whole tier. After :data:`DEGRADE_AFTER` failed I/O
operations in a row, or when its files vanish from its paths (directory
removed, device remounted), the tier is *degraded*: one WARNING line says why,
its lookups and reads are misses, its writes are dropped, and the other tiers
keep serving. A prober thread retries every :data:`PROBE_S` seconds: the same
files working again bring the tier back with its index (every record is
CRC-checked once more), files replaced at its paths are opened afresh.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from lmcache_tiered.config import (
    ConfigError,
    TieredConfig,
    TierSettings,
    exposure_warning,
    shared_file_systems,
)
from lmcache_tiered.files import NotRegularFile, open_regular, printable
from lmcache_tiered.io import aligned_buffer, make_engine
from lmcache_tiered.io.base import ALIGN, IORequest
from lmcache_tiered.keys import key_digest, key_text
from lmcache_tiered.layout import (
    HEADER_SIZE,
    CorruptRecord,
    Extent,
    Geometry,
    RecordHeader,
    align_up,
    decode_header_blocks,
    payload_checksum,
)
from lmcache_tiered.metrics import TierStats

logger = logging.getLogger("lmcache_tiered")

#: Checks records as they land (the checksums release the GIL): shared by all
#: tiers of the process, sized to the cores, since it is CPU work.
_VERIFIERS = ThreadPoolExecutor(
    max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="lmcache-tiered-crc"
)

#: Allocates the MemoryObj a record is read into; None when memory is short.
Allocator = Callable[[RecordHeader], MemoryObj | None]

#: Slots preallocated on disk at a time as the tier fills up.
_GROW_SLOTS = 64
#: Header bytes read per request when the index is rebuilt at start-up.
_SCAN_BYTES = 4 << 20
#: Failed I/O operations in a row (no success between) that degrade a tier.
DEGRADE_AFTER = 3
#: Seconds between checks that a tier's files are still at its paths, and
#: between probes of a degraded tier.
PROBE_S = 5.0
#: errnos of a full file system: the tier stops growing but is not degraded.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: Seconds between WARNING lines about damaged chunks of one tier; the lines
#: carry the running count, so none goes unreported.
DAMAGE_LOG_S = 10.0
#: Seconds :meth:`Tier.close` waits for the prober (stuck in I/O on a hung
#: device, it is a daemon thread and is left behind).
JOIN_S = 10.0


@dataclass(slots=True)
class Entry:
    """A stored record: where it is and who is using it."""

    slot: int
    header: RecordHeader
    pins: int = 0
    #: Reads in flight; the slot is not reused while any run.
    readers: int = 0
    #: Removed while being read: free the slot when the last reader leaves.
    dead: bool = False
    #: Recovered from disk: check the payload CRC on first read even when
    #: ``verify_reads`` is off, since a crash may have torn it.
    verified: bool = True


@dataclass(slots=True)
class _Transfer:
    """The I/O of one record within a batch, with any bounce buffer it needs."""

    slot: int
    requests: list[IORequest] = field(default_factory=list)
    #: (bounce buffer, payload start, length) to copy after a read
    bounces: list[tuple[memoryview, int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Payload:
    """Bytes of one chunk in memory, with what its header must say.

    ``direct`` means ``view`` is 4 KiB aligned, so O_DIRECT can use it as is.
    """

    key: CacheEngineKey
    shape: torch.Size
    dtype: torch.dtype
    fmt: MemoryFormat
    view: memoryview
    direct: bool

    @staticmethod
    def of(key: CacheEngineKey, obj: MemoryObj) -> Payload:
        return Payload(
            key,
            obj.get_shape(),
            obj.get_dtype(),
            obj.get_memory_format(),
            payload_view(obj)[: obj.get_size()],
            obj.data_ptr % ALIGN == 0,
        )


def _identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino): which file a descriptor is, however it was named."""
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def payload_view(obj: MemoryObj) -> memoryview:
    """Writable view of a MemoryObj's whole physical buffer (no copy)."""
    raw: torch.Tensor = obj.raw_data
    return raw.view(torch.uint8).numpy().data.cast("B")


class Tier:
    """A striped, O_DIRECT, crash-consistent store of KV chunks.

    ``owner`` names this process's files (one slab per device and one header
    file); two live processes can never own the same files (``flock``).

    Durability: a record is on disk, and survives a crash of this process,
    once :meth:`write_payloads` returns True for it (payload, then header,
    both written, then each file checked to be still the one at its path);
    with ``tiered.fsync`` it also survives a power loss.
    """

    def __init__(
        self,
        settings: TierSettings,
        config: TieredConfig,
        *,
        owner: str,
        max_payload: int,
        capacity_bytes: int,
        read_only: bool = False,
    ) -> None:
        self.name = settings.name
        #: another process's files, seen through a shared file system: never
        #: written, locked or formatted here; every read is CRC-checked, since
        #: the owner may be rewriting a slot meanwhile (see :meth:`refresh`)
        self.read_only = read_only
        self.paths = settings.paths
        self.verify_reads = config.verify_reads
        self.fsync = config.fsync
        self.stats = TierStats()
        self.geometry = Geometry.plan(
            len(settings.paths), config.stripe_bytes, align_up(max_payload)
        )
        self.max_slots = self._capacity_slots = (
            capacity_bytes // self.geometry.slot_disk_bytes
        )
        if self.max_slots < 1:
            raise ConfigError(
                f"tiered.{self.name}.capacity_gb: {capacity_bytes / 2**30:.3f} GiB "
                f"per worker is less than one chunk slot "
                f"({self.geometry.slot_disk_bytes} bytes); raise the capacity"
            )
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._free: list[int] = []
        self._allocated_slots = 0
        self._sequence = 0
        self._closed = False
        #: called (outside the lock) with the keys evicted by a write
        self.on_evict: Callable[[list[CacheEngineKey]], None] | None = None
        self.direct_io = config.direct_io
        #: why the tier is degraded (None: healthy)
        self.degraded: str | None = None
        self._failures = 0
        #: operations using the files now; a reopen waits for none
        self._busy = 0
        self._next_check = time.monotonic() + PROBE_S
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self._mode = config.file_mode
        self._engine_kind = config.io_engine
        self._queue_depth = config.queue_depth
        self._names = [os.path.join(p, f"{owner}.slab") for p in self.paths]
        self._names.append(os.path.join(self.paths[0], f"{owner}.hdr"))
        self._lock_name = os.path.join(self.paths[0], f"{owner}.lock")
        self._header_file = len(self._names) - 1
        #: monotonic time before which damaged chunks are only counted
        self._damage_quiet_until = 0.0
        #: the index is not loaded (start-up found the files unreadable):
        #: recovery loads it before the tier serves
        self._unloaded = False
        for path in self.paths:
            if (why := exposure_warning(path)) is not None:
                logger.warning(
                    "tier %s: %s; another user could plant data in it", self.name, why
                )
        if not read_only and (shared := shared_file_systems(self.paths)):
            logger.warning(
                "tier %s: %s are on one file system: chunks are striped over "
                "directories, not devices, so reads get no faster; list one "
                "directory per NVMe device in tiered.%s.paths",
                self.name,
                " and ".join(shared),
                self.name,
            )
        self._open_files()
        try:
            if (why := self._load_or_format()) is not None:
                self._unloaded = True
                with self._lock:
                    self._degrade_locked(why)
        except BaseException:
            self._close_files()
            raise

    # ------------------------------------------------------------------ files

    def _open_files(self) -> None:
        """Lock the tier for this process, then open (creating) its files and
        start its engine.

        Locks live on descriptors of their own: an io_uring ring keeps its
        registered files open for a while after it is torn down. Besides the
        owner's lock file, each slab is locked itself, so two processes whose
        first paths differ still cannot share a slab (a directory listed by
        both, under any name).
        """
        if self.read_only:
            self._fds = [self._open(name) for name in self._names]
            self._lock_fds: list[int] = []
            self.engine = make_engine(self._engine_kind, self._fds, self._queue_depth)
            return
        lock_fds: list[int] = []
        fds: list[int] = []
        try:
            lock_fds.append(self._open(self._lock_name, data=False))
            self._take_lock(lock_fds[0], self._lock_name, "is held")
            for name in self._names:
                fds.append(self._open(name))
            self._refuse_shared_files(fds)
            for name, fd in zip(self.slab_paths, fds, strict=False):
                lock_fds.append(self._open(name, data=False))
                if _identity(lock_fds[-1]) != _identity(fd):
                    raise OSError(errno.EAGAIN, f"{name} was replaced while opening")
                self._take_lock(lock_fds[-1], name, "is in use")
            engine = make_engine(self._engine_kind, fds, self._queue_depth)
        except BaseException:
            for fd in [*fds, *lock_fds]:
                os.close(fd)
            raise
        self._lock_fds = lock_fds
        self._fds, self.engine = fds, engine

    def _take_lock(self, fd: int, name: str, what: str) -> None:
        """flock ``fd`` for this process; ConfigError if another holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"tiered.{self.name}.paths: {name} {what} by another live process; "
                "give each LMCache instance its own directories (a directory can "
                "be reached by several names: symbolic links, bind mounts)"
            ) from None

    def _refuse_shared_files(self, fds: Sequence[int]) -> None:
        """ConfigError if two of the tier's names are one file (a hard link):
        their stripe units would overwrite each other."""
        seen: dict[tuple[int, int], str] = {}
        for name, fd in zip(self._names, fds, strict=True):
            if (first := seen.setdefault(_identity(fd), name)) != name:
                raise ConfigError(
                    f"tiered.{self.name}.paths: {first} and {name} are the same "
                    "file (a hard link); remove the link"
                )

    def _open(self, name: str, *, data: bool = True) -> int:
        """Open one of the tier's files: only a regular file, never through a
        symbolic link and without blocking (see :mod:`lmcache_tiered.files`),
        with the configured mode whatever the umask or an earlier run left;
        O_DIRECT for a data file if configured."""
        flags = os.O_RDONLY if self.read_only else os.O_RDWR | os.O_CREAT
        try:
            fd = open_regular(name, flags, self._mode)
        except NotRegularFile as exc:
            raise ConfigError(
                f"tiered.{self.name}.paths: {exc}; tier files are only regular "
                "files: remove it"
            ) from None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise ConfigError(
                f"tiered.{self.name}.paths: {name} is a symbolic link; tier files "
                "are never opened through links: remove it"
            ) from None
        try:
            if data:
                self._set_direct(fd, name)
                if not self.read_only:
                    self._check_owner(fd, name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_owner(self, fd: int, name: str) -> None:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            logger.warning(
                "tier %s: %s is owned by uid %d, not by this process; another user "
                "could plant data in it",
                self.name,
                name,
                info.st_uid,
            )
        elif stat.S_IMODE(info.st_mode) != self._mode:
            os.fchmod(fd, self._mode)

    def _set_direct(self, fd: int, name: str) -> None:
        """Switch ``fd`` to O_DIRECT if configured; buffered I/O for the whole
        tier if the file system refuses it."""
        if not self.direct_io:
            return
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            logger.warning(
                "%s: the file system refuses O_DIRECT; tier %s uses buffered "
                "I/O (page cache) instead",
                name,
                self.name,
            )
            self.direct_io = False

    def _close_files(self) -> None:
        """Stop the engine and close the files and the lock (idempotent)."""
        if not self._fds:
            return
        self.engine.close()
        for fd in [*self._fds, *self._lock_fds]:
            os.close(fd)
        self._fds, self._lock_fds = [], []

    def _load_or_format(self) -> str | None:
        """Rebuild the index from the header file, or start a fresh one; why
        not, when the files cannot be read.

        Files are emptied only when they hold nothing yet, or a superblock
        this package sealed with another layout or format version (settings
        changed). A read error or a damaged superblock returns the reason
        instead and leaves every byte where it is: the caller degrades the
        tier, and ``fsck`` can look at the files. Raises OSError when the
        superblock cannot be written: a tier that cannot record its layout
        must not take writes.
        """
        header_fd = self._fds[self._header_file]
        size = os.fstat(header_fd).st_size
        block = aligned_buffer(HEADER_SIZE)
        on_disk, sealed = None, False
        if size:
            request = IORequest(self._header_file, 0, block)
            (got,) = self._submit([request], write=False).result()
            if got < 0 and not self.read_only:
                return self._unreadable(
                    f"its superblock read failed: {os.strerror(-got)}"
                )
            if got == HEADER_SIZE:
                on_disk = Geometry.decode_superblock(block)
                sealed = Geometry.superblock_sealed(block)
        if on_disk == self.geometry:
            return self._scan_headers(size)
        if self.read_only:
            with self._lock:
                self._entries = OrderedDict()
            return None
        if size and not sealed and not self._holds_nothing(size):
            return self._unreadable("its superblock is damaged")
        if sealed:
            logger.warning(
                "tier %s: %s was written with another layout (%s, now %s); "
                "starting the tier empty",
                self.name,
                self.paths[0],
                on_disk,
                self.geometry,
            )
        for fd in self._fds:
            os.ftruncate(fd, 0)
        block[:] = self.geometry.encode_superblock()
        if self._write_all([IORequest(self._header_file, 0, block)]) != [True]:
            raise OSError(
                errno.EIO, f"cannot write the superblock of {self._names[-1]}"
            )
        with self._lock:
            self._entries, self._free = OrderedDict(), []
            self._allocated_slots = self._sequence = 0
        return None

    def _holds_nothing(self, header_size: int) -> bool:
        """Whether the files hold no record at all (a format cut short), so
        formatting them loses nothing."""
        slabs = self._fds[: self._header_file]
        return header_size <= HEADER_SIZE and not any(
            os.fstat(fd).st_size for fd in slabs
        )

    def _unreadable(self, what: str) -> str:
        """Why the tier does not start on its files, and what to do."""
        owner = os.path.basename(self.header_path).removesuffix(".hdr")
        return (
            f"{self.header_path}: {what}; its files are left as they are: check "
            f"them with `lmcache-tiered fsck {' '.join(self.paths)} --owner "
            f"{owner}`, or remove them to start the tier empty"
        )

    def _scan_headers(self, size: int) -> str | None:
        """Index every valid header; the rest of the slots become free. A
        read error leaves the index as it was and returns why (see
        :meth:`_load_or_format`)."""
        slots = min(size // HEADER_SIZE - 1, self.max_slots)
        if size % HEADER_SIZE:
            self.stats.corrupt += 1  # a header cut by a truncated file
            logger.warning(
                "tier %s: %s ends inside the header of slot %d (truncated file); "
                "records from there on are lost",
                self.name,
                self._names[self._header_file],
                size // HEADER_SIZE - 1,
            )
        found: list[tuple[int, RecordHeader]] = []
        buffer = aligned_buffer(_SCAN_BYTES)
        per_read = _SCAN_BYTES // HEADER_SIZE
        for first in range(0, slots, per_read):
            count = min(per_read, slots - first)
            view = buffer[: count * HEADER_SIZE]
            request = IORequest(self._header_file, Geometry.header_offset(first), view)
            (got,) = self._submit([request], write=False).result()
            if got < 0 and not self.read_only:
                return self._unreadable(
                    f"reading the headers of slots {first}-{first + count - 1} "
                    f"failed: {os.strerror(-got)}"
                )
            if got != len(view):
                slots = first  # the header file ends early: so does the tier
                break
            max_payload = self.geometry.max_payload
            for slot, header in decode_header_blocks(view, first, max_payload):
                if isinstance(header, CorruptRecord):
                    self.stats.corrupt += 1
                else:
                    found.append((slot, header))
        found = self._within_slabs(found)
        found.sort(key=lambda item: item[1].sequence)
        entries: OrderedDict[bytes, Entry] = OrderedDict()
        used = set()
        for slot, header in found:
            digest = key_digest(header.key)
            old = entries.pop(digest, None)
            if old is not None:
                used.discard(old.slot)
            entries[digest] = Entry(slot, header, verified=False)
            used.add(slot)
        with self._lock:
            self._entries = entries
            self._allocated_slots = slots
            self._free = sorted(set(range(slots)) - used, reverse=True)
            self._sequence = max((h.sequence for _, h in found), default=0)
        logger.log(
            logging.DEBUG if self.read_only else logging.INFO,
            "tier %s: recovered %d chunks from %s",
            self.name,
            len(used),
            self._names[self._header_file],
        )
        return None

    def _within_slabs(
        self, found: list[tuple[int, RecordHeader]]
    ) -> list[tuple[int, RecordHeader]]:
        """The records whose payload lies inside the slabs; the others (a slab
        truncated, or replaced by an empty one) are counted and left out."""
        sizes = [os.fstat(fd).st_size for fd in self._fds[: self._header_file]]
        whole = [
            (slot, header)
            for slot, header in found
            if all(
                e.offset + e.length <= sizes[e.device]
                for e in self.geometry.extents(slot, header.payload_size)
            )
        ]
        if cut := len(found) - len(whole):
            self.stats.corrupt += cut
            logger.warning(
                "tier %s: %d chunks run past the end of a slab (truncated or "
                "replaced file); dropped",
                self.name,
                cut,
            )
        return whole

    # ------------------------------------------------------------------ index

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """Whether the key is stored; refreshes its recency, pins on request."""
        return self.touch([key], pin) == 1

    def touch(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """Refresh the recency of the stored ``keys`` (pin them on request);
        returns how many are stored.

        Keys come in prefix order and are touched tails first, so a chain's
        head is always more recent than its tail: eviction never leaves a
        tail whose head is gone. A degraded tier holds nothing.
        """
        with self._lock:
            if self.degraded is not None:
                return 0
            found = 0
            for key in keys:
                entry = self._entries.get(key_digest(key))
                if entry is not None:
                    found += 1
                    entry.pins += pin
            self._touch_locked(keys)
            return found

    def _touch_locked(self, keys: Sequence[CacheEngineKey]) -> None:
        for key in reversed(keys):
            digest = key_digest(key)
            if digest in self._entries:
                self._entries.move_to_end(digest)

    def header(self, key: CacheEngineKey) -> RecordHeader | None:
        if self.degraded is not None:
            return None
        entry = self._entries.get(key_digest(key))
        return None if entry is None else entry.header

    def stored_keys(self) -> list[CacheEngineKey]:
        with self._lock:
            if self.degraded is not None:
                return []
            return [e.header.key for e in self._entries.values()]

    def pin(self, key: CacheEngineKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            entry = self._entries.get(key_digest(key))
            if entry is None or entry.pins == 0:
                return False
            entry.pins -= 1
            return True

    def remove(self, key: CacheEngineKey) -> bool:
        """Forget a record; its slot is reused once no read is using it."""
        with self._lock:
            entry = self._entries.pop(key_digest(key), None)
            if entry is None:
                return False
            self._release(entry)
            return True

    def _release(self, entry: Entry) -> None:
        """Free an entry's slot now, or when its last reader leaves (locked)."""
        if entry.readers:
            entry.dead = True
        else:
            self._free.append(entry.slot)

    @property
    def used_bytes(self) -> int:
        """Bytes of disk this tier holds (slots preallocated so far)."""
        return self._allocated_slots * self.geometry.slot_disk_bytes

    # ------------------------------------------------------------------ reads

    def read(
        self, keys: Sequence[CacheEngineKey], allocate: Allocator
    ) -> list[MemoryObj | None]:
        """Read every key in one batch; None for each miss or bad record.

        All stripe units of all records are in flight together. The caller
        owns the returned MemoryObjs (one reference each). A record that fails
        its checks is dropped from the tier; one that found no memory is not.
        """
        objs: list[MemoryObj | None] = [None] * len(keys)
        with self._files_in_use() as usable:
            if not usable:
                self.stats.misses += len(keys)
                return objs
            entries = self._begin_reads(keys)
            objs = [None if e is None else allocate(e.header) for e in entries]
            views = [None if o is None else payload_view(o) for o in objs]
            direct = [o is not None and o.data_ptr % ALIGN == 0 for o in objs]
            outcomes = self._read_into(entries, views, direct)
        for i, ok in enumerate(outcomes):
            obj = objs[i]
            if not ok and obj is not None:
                obj.ref_count_down()
                objs[i] = None
        return objs

    def read_payloads(self, keys: Sequence[CacheEngineKey]) -> list[Payload | None]:
        """Read records into fresh aligned buffers (tier-to-tier copies)."""
        with self._files_in_use() as usable:
            if not usable:
                self.stats.misses += len(keys)
                return [None] * len(keys)
            entries = self._begin_reads(keys)
            views = [
                None if e is None else aligned_buffer(align_up(e.header.payload_size))
                for e in entries
            ]
            outcomes = self._read_into(entries, views, [True] * len(keys))
        return [
            Payload(
                e.header.key,
                e.header.shape,
                e.header.dtype,
                e.header.fmt,
                v[: e.header.payload_size],
                True,
            )
            if ok and e is not None and v is not None
            else None
            for e, v, ok in zip(entries, views, outcomes, strict=True)
        ]

    def _read_into(
        self,
        entries: Sequence[Entry | None],
        views: Sequence[memoryview | None],
        direct: Sequence[bool],
    ) -> list[bool | None]:
        """Read the records into ``views``; per record True (good), False
        (bad: dropped from the tier) or None (not read: no buffer, or the
        device failed; the record stays).

        One engine batch per record, all in flight at once; each record is
        checked as soon as its own I/O lands, while the others still read, on
        a small pool: one core of CRC32 is slower than the disks.
        """
        transfers = [
            None
            if e is None or v is None
            else self._plan_transfer(e.slot, e.header.payload_size, v, d, True)
            for e, v, d in zip(entries, views, direct, strict=True)
        ]
        started = time.perf_counter()
        pending = {
            self._submit(t.requests, write=False): i
            for i, t in enumerate(transfers)
            if t is not None
        }
        outcomes: list[bool | None] = [None] * len(entries)
        checks: dict[Future[bool | None], int] = {}
        for future in as_completed(pending):
            self.stats.read_latency.observe(time.perf_counter() - started)
            i = pending[future]
            entry, transfer, view = entries[i], transfers[i], views[i]
            assert entry is not None and transfer is not None and view is not None
            check = _VERIFIERS.submit(
                self._finish_read, entry, transfer, future.result(), view
            )
            checks[check] = i
        for check, i in checks.items():
            outcomes[i] = check.result()
        self._end_reads(entries, outcomes)
        return outcomes

    def _begin_reads(self, keys: Sequence[CacheEngineKey]) -> list[Entry | None]:
        entries: list[Entry | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key_digest(key))
                if entry is None:
                    self.stats.misses += 1
                else:
                    entry.readers += 1
                entries.append(entry)
            self._touch_locked(keys)
        return entries

    def _finish_read(
        self,
        entry: Entry,
        transfer: _Transfer,
        results: list[int],
        view: memoryview,
    ) -> bool | None:
        """Check one record's transfers, copy bounce tails, verify its CRC.

        An I/O error is the device's fault, not the record's: a miss that
        keeps the record and counts towards degrading the tier. A short read
        (the slab ends inside the record) is a damaged record, like a bad
        checksum: dropped.
        """
        failure = self._first_error(transfer.requests, results)
        self._note_io(failure)
        if failure is not None:
            self.stats.io_errors += 1
            return None
        header = entry.header
        done = zip(results, transfer.requests, strict=True)
        if not all(n >= len(r.buffer) for n, r in done):
            return self._damaged(header, "is cut short on disk (truncated file)")
        for bounce, start, length in transfer.bounces:
            view[start : start + length] = bounce[:length]
        check = self.verify_reads or self.read_only or not entry.verified
        if check and not header.payload_matches(view[: header.payload_size]):
            return self._damaged(header, "failed its checksum")
        entry.verified = True
        return True

    def _damaged(self, header: RecordHeader, what: str) -> bool:
        """Count a record that fails its checks and log it (one line per
        DAMAGE_LOG_S at most, with the count so far); False (drop it)."""
        with self._lock:
            self.stats.corrupt += 1
            count = self.stats.corrupt
            now = time.monotonic()
            if now < self._damage_quiet_until:
                return False
            self._damage_quiet_until = now + DAMAGE_LOG_S
        logger.warning(
            "tier %s: chunk %s %s; dropped (%d damaged records so far; at most "
            "one such line every %g s)",
            self.name,
            printable(key_text(header.key)),
            what,
            count,
            DAMAGE_LOG_S,
        )
        return False

    def _end_reads(
        self, entries: Sequence[Entry | None], outcomes: Sequence[bool | None]
    ) -> None:
        """Count hits and misses, drop bad records, free slots of dead ones."""
        with self._lock:
            for entry, ok in zip(entries, outcomes, strict=True):
                if entry is None:
                    continue
                entry.readers -= 1
                if ok:
                    self.stats.hits += 1
                    self.stats.bytes_read += entry.header.payload_size
                else:
                    self.stats.misses += 1
                if ok is False:
                    digest = key_digest(entry.header.key)
                    if self._entries.get(digest) is entry:
                        del self._entries[digest]
                    entry.dead = True
                if entry.dead and entry.readers == 0:
                    self._free.append(entry.slot)

    def _plan_transfer(
        self, slot: int, size: int, view: memoryview, direct: bool, reading: bool
    ) -> _Transfer:
        """Requests for one record: straight into/out of ``view`` when it is
        aligned, through a small bounce buffer for any unaligned part."""
        transfer = _Transfer(slot)
        for extent in self.geometry.extents(slot, size):
            buffer = self._extent_buffer(extent, view, direct, transfer, reading)
            transfer.requests.append(IORequest(extent.device, extent.offset, buffer))
        return transfer

    @staticmethod
    def _extent_buffer(
        extent: Extent,
        view: memoryview,
        direct: bool,
        transfer: _Transfer,
        reading: bool,
    ) -> memoryview:
        padded = align_up(extent.length)
        end = extent.start + padded
        if direct and end <= len(view):
            return view[extent.start : end]
        bounce = aligned_buffer(padded)
        if reading:
            transfer.bounces.append((bounce, extent.start, extent.length))
        else:
            bounce[: extent.length] = view[extent.start : extent.start + extent.length]
        return bounce

    # ----------------------------------------------------------------- writes

    def write(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        """Store LMCache MemoryObjs; see :meth:`write_payloads`."""
        return self.write_payloads([Payload.of(key, obj) for key, obj in items])

    def write_payloads(
        self,
        payloads: Sequence[Payload],
        evict_only: Collection[CacheEngineKey] | None = None,
    ) -> list[bool]:
        """Store a batch; True for each key that is stored when this returns.

        Payloads go first, then the headers that make them visible, so a crash
        never leaves a servable record with a torn payload. A key that cannot
        get a slot (the tier is full of pinned or in-use records, its disk is
        full, or it is degraded) is dropped and counted, never waited for.
        Keys are given in prefix order (heads first) and become most recent
        heads last, so tails are evicted first. With ``evict_only`` (keys
        already copied elsewhere, see :meth:`victims`) no other record is
        evicted: a chunk that needs more room is refused instead.
        """
        if self.read_only:
            return [False] * len(payloads)
        allowed = None if evict_only is None else {key_digest(k) for k in evict_only}
        with self._files_in_use() as usable:
            if usable:
                return self._write_payloads(payloads, allowed)
        self.stats.puts_dropped += len(payloads)
        return [False] * len(payloads)

    def _write_payloads(
        self, payloads: Sequence[Payload], allowed: set[bytes] | None
    ) -> list[bool]:
        stored = [False] * len(payloads)
        # heads get the higher sequence numbers: a restart, which orders the
        # index by sequence, keeps them more recent than their tails
        last_sequence = self._reserve_sequences(len(payloads))
        taken: list[tuple[int, int, Payload, _Transfer]] = []
        evicted: list[CacheEngineKey] = []
        seen: set[bytes] = set()
        for i, payload in enumerate(payloads):
            digest = key_digest(payload.key)
            if digest in self._entries or digest in seen:
                stored[i] = True
                continue
            seen.add(digest)
            size = len(payload.view)
            if size > self.geometry.max_payload:
                logger.warning(
                    "tier %s: chunk of %d bytes exceeds the slot size %d; "
                    "set tiered.slot_mb higher to store it",
                    self.name,
                    size,
                    self.geometry.max_payload,
                )
                self.stats.puts_dropped += 1
                continue
            slot = self._take_slot(evicted, allowed)
            if slot is None:
                self.stats.puts_dropped += 1
                continue
            transfer = self._plan_transfer(
                slot, size, payload.view, payload.direct, False
            )
            taken.append((i, slot, payload, transfer))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        if not taken:
            return stored
        requests = [r for _, _, _, t in taken for r in t.requests]
        writing = self._submit(requests, write=True)
        # checksums on the verifier threads while the payloads are in flight
        checksums = _VERIFIERS.map(payload_checksum, [p.view for _, _, p, _ in taken])
        planned = [
            (i, Entry(slot, self._header_for(payload, crc, last_sequence - i)), t)
            for (i, slot, payload, t), crc in zip(taken, checksums, strict=True)
        ]
        payload_ok = self._finish_writes(requests, writing, planned)
        headers = []
        for ok, (_, entry, _) in zip(payload_ok, planned, strict=True):
            if ok:
                block = aligned_buffer(HEADER_SIZE)
                block[:] = entry.header.encode()
                offset = Geometry.header_offset(entry.slot)
                headers.append(IORequest(self._header_file, offset, block))
        header_ok = iter(self._write_all(headers) if headers else ())
        done = [ok and next(header_ok) for ok in payload_ok]
        if any(done) and (gone := self._missing_file()) is not None:
            # written into a file no longer at its path: lost on restart
            with self._lock:
                self._degrade_locked(f"{gone} was removed or replaced")
            done = [False] * len(done)
        with self._lock:
            # tails first, so the chain's head ends up the most recent
            for ok, (i, entry, _) in reversed(list(zip(done, planned, strict=True))):
                if ok:
                    self._insert_locked(entry)
                    stored[i] = True
                else:
                    self.stats.io_errors += 1
                    self._free.append(entry.slot)
        return stored

    def _insert_locked(self, entry: Entry) -> None:
        """Make a written record visible (most recent); a concurrent writer of
        the same key loses its slot."""
        digest = key_digest(entry.header.key)
        old = self._entries.pop(digest, None)
        if old is not None:
            self._release(old)
        self._entries[digest] = entry
        self.stats.puts += 1
        self.stats.bytes_written += entry.header.payload_size

    @staticmethod
    def _header_for(payload: Payload, crc: int, sequence: int) -> RecordHeader:
        return RecordHeader(
            key=payload.key,
            shape=payload.shape,
            dtype=payload.dtype,
            fmt=payload.fmt,
            payload_size=len(payload.view),
            payload_crc=crc,
            sequence=sequence,
            created_ns=time.time_ns(),
        )

    def _write_all(self, requests: list[IORequest]) -> list[bool]:
        """Write a batch (and fdatasync if configured); success per request."""
        return self._finish_writes(requests, self._submit(requests, write=True))

    def _finish_writes(
        self,
        requests: list[IORequest],
        writing: Future[list[int]],
        per_record: Sequence[tuple[int, Entry, _Transfer]] | None = None,
    ) -> list[bool]:
        """Wait for a submitted batch (and fdatasync if configured); success
        per record, or per request when ``per_record`` is None. A failed
        fdatasync fails the whole batch: nothing unsynced is acknowledged."""
        results = writing.result()
        failure = self._first_error(requests, results)
        written = [n >= len(r.buffer) for r, n in zip(requests, results, strict=True)]
        if self.fsync and any(written):
            try:
                for fd in self._fds:
                    os.fdatasync(fd)
            except OSError as exc:
                failure = ("fdatasync of its files", exc.errno or errno.EIO)
                written = [False] * len(written)
        self._note_io(failure)
        if per_record is None:
            return written
        flags = iter(written)
        return [all([next(flags) for _ in t.requests]) for _, _, t in per_record]

    def _reserve_sequences(self, count: int) -> int:
        """Take ``count`` sequence numbers; returns the highest."""
        with self._lock:
            self._sequence += count
            return self._sequence

    def _take_slot(
        self, evicted: list[CacheEngineKey], allowed: set[bytes] | None
    ) -> int | None:
        """A free slot: a released one, a new one, or the LRU victim's (whose
        key is appended to ``evicted``); victims only from ``allowed`` if set."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._allocated_slots < self.max_slots:
                return self._grow()
            for digest, entry in self._entries.items():
                if allowed is not None and digest not in allowed:
                    continue
                if entry.pins == 0 and entry.readers == 0:
                    del self._entries[digest]
                    self.stats.evictions += 1
                    evicted.append(entry.header.key)
                    return entry.slot
            return None

    def victims(self, count: int) -> list[CacheEngineKey]:
        """The keys that storing ``count`` more chunks would evict now, in
        eviction order (for demotion to a lower tier before they go)."""
        with self._lock:
            if self.degraded is not None:
                return []
            spare = len(self._free) + self.max_slots - self._allocated_slots
            need = count - spare
            if need <= 0:
                return []
            return [
                e.header.key
                for e in self._entries.values()
                if e.pins == 0 and e.readers == 0
            ][:need]

    def _grow(self) -> int | None:
        """Preallocate the next group of slots on every device (locked)."""
        first = self._allocated_slots
        count = min(_GROW_SLOTS, self.max_slots - first)
        per_device = self.geometry.per_device
        try:
            for fd in self._fds[: self._header_file]:
                os.posix_fallocate(fd, first * per_device, count * per_device)
            os.posix_fallocate(
                self._fds[self._header_file],
                Geometry.header_offset(first),
                count * HEADER_SIZE,
            )
        except OSError as exc:
            # give back what the failed attempt got: the files then hold
            # exactly the slots that used_bytes counts
            with contextlib.suppress(OSError):
                for fd in self._fds[: self._header_file]:
                    os.ftruncate(fd, first * per_device)
                os.ftruncate(
                    self._fds[self._header_file], Geometry.header_offset(first)
                )
            if exc.errno not in _FULL_ERRNOS:
                # a failing device, not a full one: a dropped put, counted
                self.stats.io_errors += 1
                return None
            logger.warning(
                "tier %s: cannot grow past %d slots (%s); it stays at that size",
                self.name,
                first,
                os.strerror(exc.errno or 0),
            )
            self.max_slots = first
            return None
        self._allocated_slots = first + count
        self._free.extend(range(first + count - 1, first, -1))
        return first

    # ----------------------------------------------------------------- health

    def _submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        """The engine's future for a batch; one already failed with EIO when
        the engine refuses it (closed, out of resources): I/O never raises."""
        try:
            return self.engine.submit(requests, write)
        except Exception as exc:
            logger.debug("tier %s: engine refused a batch: %s", self.name, exc)
            failed: Future[list[int]] = Future()
            failed.set_result([-errno.EIO] * len(requests))
            return failed

    @contextlib.contextmanager
    def _files_in_use(self) -> Iterator[bool]:
        """Wrap an operation that does I/O; it yields False (skip it: a miss
        or a drop) while the tier is degraded. Every PROBE_S the tier checks
        that its files are still the ones at its paths."""
        with self._lock:
            now = time.monotonic()
            check = self.degraded is None and not self._closed
            check = check and now >= self._next_check
            if check:
                self._next_check = now + PROBE_S
        if check and (gone := self._missing_file()) is not None:
            with self._lock:
                self._degrade_locked(f"{gone} was removed or replaced")
        with self._lock:
            usable = self.degraded is None and not self._closed
            self._busy += usable
        try:
            yield usable
        finally:
            if usable:
                with self._lock:
                    self._busy -= 1

    def _first_error(
        self, requests: Sequence[IORequest], results: Sequence[int]
    ) -> tuple[str, int] | None:
        """(file name, errno) of the first failed request of a batch, if any."""
        return next(
            (
                (self._names[r.file], -n)
                for r, n in zip(requests, results, strict=True)
                if n < 0
            ),
            None,
        )

    def _missing_file(self) -> str | None:
        """The first of the tier's files that is no longer at its path."""
        if not self._fds:
            return self._names[0]
        for name, fd in zip(self._names, self._fds, strict=True):
            try:
                on_path = os.stat(name, follow_symlinks=False)
                ours = os.fstat(fd)
            except OSError:
                return name
            if (on_path.st_dev, on_path.st_ino) != (ours.st_dev, ours.st_ino):
                return name
        return None

    def _note_io(self, failure: tuple[str, int] | None) -> None:
        """Count an I/O operation towards the tier's health: ``failure`` is
        (file, errno) of an error, None for a success."""
        with self._lock:
            if failure is None:
                self._failures = 0
                return
            self._failures += 1
            if self._failures >= DEGRADE_AFTER:
                name, error = failure
                self._degrade_locked(
                    f"{name}: {os.strerror(error)} "
                    f"({self._failures} failed I/O operations in a row)"
                )

    def _degrade_locked(self, reason: str) -> None:
        """Stop using the files (one log line) and start the prober."""
        if self.degraded is not None or self._closed:
            return
        self.degraded = reason
        self.stats.degradations += 1
        logger.warning(
            "tier %s degraded: %s; its reads are misses and its writes are dropped "
            "until a probe (every %g s) finds it working",
            self.name,
            reason,
            PROBE_S,
        )
        self._prober = threading.Thread(
            target=self._probe_loop,
            name=f"lmcache-tiered-probe-{self.name}",
            daemon=True,
        )
        self._prober.start()

    def _probe_loop(self) -> None:
        while not self._stop.wait(PROBE_S):
            try:
                if self._recover():
                    return
            except Exception as exc:  # still broken: try again later
                logger.debug("tier %s: probe failed: %s", self.name, exc)

    def _recover(self) -> bool:
        """One probe of a degraded tier; True once it serves again.

        The same files answering again keep the index, each record to be
        CRC-checked on its next read (or load it, if start-up could not);
        files replaced at the tier's paths (or a path back after it was
        removed) are opened afresh, once no operation still uses the old ones.
        """
        if self._missing_file() is None:
            if self._unloaded:
                if (why := self._load_or_format()) is not None:
                    logger.debug("tier %s: still unreadable: %s", self.name, why)
                    return False
                how = f"its files read again, {len(self._entries)} chunks found"
            elif not self._probe_io():
                return False
            else:
                how = "its files answer again"
        else:
            with self._lock:
                if self._busy:
                    return False
            self._close_files()
            self.max_slots = self._capacity_slots
            self._open_files()
            try:
                why = self._load_or_format()
            except BaseException:
                self._close_files()
                raise
            if why is not None:
                self._unloaded = True
                logger.debug("tier %s: still unreadable: %s", self.name, why)
                return False
            how = f"reopened its files, {len(self._entries)} chunks found"
        self._unloaded = False
        with self._lock:
            for entry in self._entries.values():
                entry.verified = False
            self.degraded = None
            self._failures = 0
            self._next_check = time.monotonic() + PROBE_S
        logger.warning("tier %s recovered: %s", self.name, how)
        return True

    def _probe_io(self) -> bool:
        """Read the superblock and write it back unchanged, and read the first
        block of every slab: the tier's devices answer again."""
        block = aligned_buffer(HEADER_SIZE)
        superblock = IORequest(self._header_file, 0, block)
        if self._submit([superblock], write=False).result() != [HEADER_SIZE]:
            return False
        if Geometry.decode_superblock(block) != self.geometry:
            return False
        if self._submit([superblock], write=True).result() != [HEADER_SIZE]:
            return False
        slabs = [
            IORequest(i, 0, aligned_buffer(ALIGN))
            for i, fd in enumerate(self._fds[: self._header_file])
            if os.fstat(fd).st_size >= ALIGN
        ]
        return all(n == ALIGN for n in self._submit(slabs, write=False).result())

    # ------------------------------------------------------------------ close

    @property
    def slab_paths(self) -> list[str]:
        """The data files, one per device (a raw read of them is the
        ceiling for reading this tier)."""
        return self._names[: self._header_file]

    @property
    def header_path(self) -> str:
        """The header file: one per owner, so it names the owner's files."""
        return self._names[self._header_file]

    def refresh(self) -> None:
        """Re-read a read-only tier's headers: what its owner stored since."""
        assert self.read_only, "only another process's tier is refreshed"
        with self._files_in_use() as usable:
            if usable:
                self._load_or_format()

    def close(self) -> None:
        """Stop the prober, release the engine and the files (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            prober = self._prober
        self._stop.set()
        if prober is not None:
            prober.join(JOIN_S)
            if prober.is_alive():
                logger.warning(
                    "tier %s: its prober is stuck in I/O; closing without it",
                    self.name,
                )
        self._close_files()
