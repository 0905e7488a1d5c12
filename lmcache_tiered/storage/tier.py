"""One storage level: the read and write data path over its files and index.

A tier stores LMCache MemoryObjs in fixed-size slots striped over its devices
(see :mod:`lmcache_tiered.storage.layout`). Reads and writes of a whole batch
go to the engine at once, so every device has a deep queue. The write half of
the data path is :class:`lmcache_tiered.storage.tier_writes.TierWrites`;
:class:`Tier` composes the modules that do the rest:
:mod:`lmcache_tiered.storage.index` (what is stored where, eviction),
:mod:`lmcache_tiered.storage.tierfiles` (opening, locking, growing and reading
back the files) and :mod:`lmcache_tiered.storage.health` (degrading after
failed I/O and recovering). The index is the only shared state; it is guarded
by one lock that is never held across I/O.

A record that fails its checks is a miss and is dropped; a device that fails
is a miss for the whole tier, and enough failures degrade it (see
:mod:`lmcache_tiered.storage.health`). Its settings come as
:class:`lmcache_tiered.config.TierOptions`; nothing here reads the plugin's
configuration.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from operator import itemgetter

from lmcache.v1.memory_management import MemoryObj

from lmcache_tiered.config import ConfigError, TierOptions
from lmcache_tiered.io import IOEngine, aligned_buffer
from lmcache_tiered.io.base import ALIGN
from lmcache_tiered.keys import StoreKey
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage.base import StorageTier
from lmcache_tiered.storage.changes import ChangeLog
from lmcache_tiered.storage.checks import CheckBatch
from lmcache_tiered.storage.health import TierHealth
from lmcache_tiered.storage.index import Entry, SlotIndex
from lmcache_tiered.storage.layout import (
    Geometry,
    RecordHeader,
    TierNames,
    align_up,
)
from lmcache_tiered.storage.mirror import Follower, MirrorIndex
from lmcache_tiered.storage.payload import Allocator, Payload, payload_view
from lmcache_tiered.storage.seal import RecordSeal, SealedRecords
from lmcache_tiered.storage.tier_writes import TierWrites
from lmcache_tiered.storage.tierfiles import TierFileSet, Transfer, plan_transfer

__all__ = ["Allocator", "Payload", "Tier"]

logger = logging.getLogger("lmcache_tiered")


class Tier(TierWrites, StorageTier):
    """A striped, O_DIRECT, crash-consistent store of KV chunks.

    ``owner`` names this process's files (one slab per device and one header
    file); two live processes can never own the same files (``flock``).

    Durability: a record is on disk, and survives a crash of this process,
    once :meth:`write_payloads` returns True for it (payload, then header,
    both written, then each file checked to be still the one at its path);
    with ``fsync`` it also survives a power loss.

    ``held_lock`` hands over the owner's lock file, already locked by this
    process (:class:`lmcache_tiered.storage.directories.DirectoryHold`).

    ``seal``: the fleet secret's (:mod:`lmcache_tiered.storage.seal`): every
    record written carries a MAC, and a record without a valid one is never
    served (dropped at load, refused at read, whatever ``verify_reads`` says).

    ``read_only``: another process's files, seen through a shared file
    system: never written, locked or formatted here; every read is
    CRC-checked, since the owner may be rewriting a slot meanwhile (see
    :meth:`refresh`).

    ``change_log``: log the slots each write batch changed, for the hosts
    that read these files (:mod:`lmcache_tiered.storage.changes`).
    """

    def __init__(
        self,
        options: TierOptions,
        *,
        owner: str,
        max_payload: int,
        capacity_bytes: int,
        read_only: bool = False,
        held_lock: Callable[[], int] | None = None,
        seal: RecordSeal | None = None,
        change_log: bool = False,
    ) -> None:
        self.name = options.name
        self.owner = owner
        self.read_only = read_only
        self.paths = options.paths
        self.verify_reads = options.verify_reads
        self._slot_setting = options.slot_setting
        self.stats = TierStats()
        self.geometry = Geometry.plan(
            len(options.paths), options.stripe_bytes, align_up(max_payload)
        )
        self._capacity_slots = capacity_bytes // self.geometry.slot_disk_bytes
        if self._capacity_slots < 1:
            raise ConfigError(
                f"{options.capacity_setting}: {capacity_bytes / 2**30:.3f} GiB "
                f"per worker is less than one chunk slot "
                f"({self.geometry.slot_disk_bytes / 2**20:.1f} MiB: LMCache's "
                f"chunk, or {options.slot_setting} where set); raise "
                f"{options.capacity_setting} or lower {options.slot_setting}"
            )
        self._lock = threading.Lock()
        mirror = MirrorIndex(self._capacity_slots) if read_only else None
        #: what is stored where; read or change it only under the tier's lock
        self.index = SlotIndex(self._capacity_slots) if mirror is None else mirror
        names = TierNames(options.paths, owner)
        where = f"tier {self.name} ({names.header})"
        self.sealed = None if seal is None else SealedRecords(seal, self.stats, where)
        self.files = TierFileSet(
            options, names, self.geometry, self.stats, read_only=read_only
        )
        #: a read-only tier's refresh reads what its owner's change log names
        self._follower = (
            None
            if mirror is None
            else Follower(
                self.files, names.changes, mirror, self._lock, self.stats, self.sealed
            )
        )
        self.health = TierHealth(
            self.name,
            self._lock,
            self.stats,
            missing=self.files.missing,
            recover=self._recover,
            watch=None if read_only else self._renew_lease,
        )
        #: the index is not loaded (start-up found the files unreadable):
        #: recovery loads it before the tier serves
        self._unloaded = False
        #: ours, for the hosts reading these files: started once the files
        #: are ours and loaded (:meth:`_ours`)
        self.changes = (
            ChangeLog(names.changes, self._capacity_slots, options.file_mode)
            if change_log and not read_only
            else None
        )
        try:
            self.files.open(held_lock)
            if (why := self._claim() or self._load()) is not None:
                self._unloaded = True
                self.health.degrade(why)
            else:
                self._ours()
        except BaseException:
            self.close()  # its prober, and any files it opened
            raise

    # ---------------------------------------------------------- what it is

    @property
    def engine(self) -> IOEngine:
        return self.files.engine

    @engine.setter
    def engine(self, engine: IOEngine) -> None:
        """Run the tier's I/O on another engine over the same files (a
        wrapper that injects faults or delays)."""
        self.files.engine = engine

    @property
    def engine_name(self) -> str:
        return self.engine.name

    @property
    def direct_io(self) -> bool:
        return self.files.direct_io

    def register_buffers(self, regions: Sequence[memoryview]) -> bool:
        """Fixed buffers for the tier's engine, where it takes them."""
        engine = self.engine
        return engine.supports_fixed_buffers and engine.register_buffers(regions)

    @property
    def degraded(self) -> str | None:
        """Why the tier is degraded (None: healthy)."""
        return self.health.degraded

    @property
    def writes_refused(self) -> str | None:
        """Always None: a full file system stops the tier growing, it does
        not refuse writes into the slots it has."""
        return None

    @property
    def max_slots(self) -> int:
        return self.index.max_slots

    @property
    def slab_paths(self) -> list[str]:
        """The data files, one per device (a raw read of them is the
        ceiling for reading this tier)."""
        return self.files.names[: self.files.header_file]

    @property
    def header_path(self) -> str:
        """The header file: one per owner, so it names the owner's files."""
        return self.files.names[self.files.header_file]

    @property
    def used_bytes(self) -> int:
        """Bytes of disk this tier holds (slots preallocated so far)."""
        return self.index.allocated_slots * self.geometry.slot_disk_bytes

    def __len__(self) -> int:
        return len(self.index)

    # ---------------------------------------------------------------- index

    def touch(self, keys: Sequence[StoreKey], pin: bool = False) -> int:
        """Refresh the recency of the stored ``keys`` (pin them on request);
        returns how many are stored (see :meth:`SlotIndex.touch`). A
        degraded tier holds nothing."""
        with self._lock:
            if self.degraded is not None:
                return 0
            return self.index.touch(keys, pin)

    def header(self, key: StoreKey) -> RecordHeader | None:
        if self.degraded is not None:
            return None
        entry = self.index.get(key)
        return None if entry is None else entry.header

    def stored_keys(self) -> list[StoreKey]:
        with self._lock:
            if self.degraded is not None:
                return []
            return [e.header.key for e in self.index]

    def pin(self, key: StoreKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: StoreKey) -> bool:
        with self._lock:
            return self.index.unpin(key)

    def remove(self, key: StoreKey) -> bool:
        """Forget a record; its slot is reused once no read is using it."""
        with self._lock:
            return self.index.remove(key)

    def victims(self, count: int) -> list[StoreKey]:
        """The keys that storing ``count`` more chunks would evict now, in
        eviction order (for demotion to a lower tier before they go)."""
        with self._lock:
            if self.degraded is not None:
                return []
            return [e.header.key for e in self.index.victims(count)]

    # ---------------------------------------------------------------- reads

    def read(
        self, keys: Sequence[StoreKey], allocate: Allocator
    ) -> list[MemoryObj | None]:
        """Read every key in one batch; None for each miss or bad record.

        All stripe units of all records are in flight together. The caller
        owns the returned MemoryObjs (one reference each). A record that fails
        its checks is dropped from the tier; one that found no memory is not.
        """
        objs: list[MemoryObj | None] = [None] * len(keys)
        with self.health.in_use() as usable:
            if not usable:
                self.stats.misses += len(keys)
                return objs
            entries = self._begin_reads(keys)
            outcomes: list[bool | None] = [None] * len(keys)
            try:
                for i, entry in enumerate(entries):
                    if entry is not None:
                        objs[i] = allocate(entry.header)
                views = [None if o is None else payload_view(o) for o in objs]
                direct = [o is not None and o.data_ptr % ALIGN == 0 for o in objs]
                outcomes = self._read_into(entries, views, direct)
            except BaseException:
                # the caller never sees these: give their memory back
                for obj in objs:
                    if obj is not None:
                        obj.ref_count_down()
                raise
            finally:
                # a raising allocator or check must not leave the records
                # counted as being read: their slots could never be evicted
                self._end_reads(entries, outcomes)
        for i, ok in enumerate(outcomes):
            obj = objs[i]
            if not ok and obj is not None:
                obj.ref_count_down()
                objs[i] = None
        return objs

    def read_payloads(self, keys: Sequence[StoreKey]) -> list[Payload | None]:
        """Read records into fresh aligned buffers (tier-to-tier copies)."""
        with self.health.in_use() as usable:
            if not usable:
                self.stats.misses += len(keys)
                return [None] * len(keys)
            entries = self._begin_reads(keys)
            outcomes: list[bool | None] = [None] * len(keys)
            try:
                views = [
                    None
                    if e is None
                    else aligned_buffer(align_up(e.header.payload_size))
                    for e in entries
                ]
                outcomes = self._read_into(entries, views, [True] * len(keys))
            finally:  # see read: never leave a record counted as being read
                self._end_reads(entries, outcomes)
        return [
            Payload.read_back(e.header, v)
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
        device failed; the record stays). The caller ends the reads
        (:meth:`_end_reads`), whether this returns or raises.

        One engine batch per record, all handed over in one call and in flight
        at once; each record is checked on the verifier pool
        (:mod:`lmcache_tiered.storage.checks`) as soon as its own I/O lands,
        while the others still read: one core of CRC32C is slower than the disks.
        """
        transfers = [
            None
            if e is None or v is None
            else plan_transfer(self.geometry, e.slot, e.header.payload_size, v, d, True)
            for e, v, d in zip(entries, views, direct, strict=True)
        ]
        reads = [(i, t) for i, t in enumerate(transfers) if t is not None]
        checks: CheckBatch[bool | None] = CheckBatch(len(entries), len(reads))
        started = time.perf_counter()
        landings = self.files.submit_many([t.requests for _, t in reads], write=False)
        for (i, transfer), landing in zip(reads, landings, strict=True):
            entry, view = entries[i], views[i]
            assert entry is not None and view is not None
            landing.add_done_callback(
                partial(self._landed, checks, i, entry, transfer, view, started)
            )
        return checks.wait()

    def _landed(
        self,
        checks: CheckBatch[bool | None],
        index: int,
        entry: Entry,
        transfer: Transfer,
        view: memoryview,
        started: float,
        landing: Future[list[int]],
    ) -> None:
        """An engine's completion callback: the record's check goes straight to
        the verifier pool, with how long its read took."""
        took = time.perf_counter() - started
        checks.start(index, self._finish_read, entry, transfer, landing, view, took)

    def _begin_reads(self, keys: Sequence[StoreKey]) -> list[Entry | None]:
        with self._lock:
            entries = self.index.begin_reads(keys)
            self.stats.misses += entries.count(None)
        return entries

    def _finish_read(
        self,
        entry: Entry,
        transfer: Transfer,
        landing: Future[list[int]],
        view: memoryview,
        took: float,
    ) -> bool | None:
        """Check one record's transfers, copy bounce tails, verify its CRC.

        An I/O error is the device's fault, not the record's: a miss that
        keeps the record and counts towards degrading the tier. A short read
        (the slab ends inside the record) is a damaged record, like a bad
        checksum: dropped.
        """
        self.stats.read_latency.observe(took)
        results = landing.result()
        failure = self.files.first_error(transfer.requests, results)
        self.health.note_io(failure)
        if failure is not None:
            self.stats.io_errors += 1
            return None
        header = entry.header
        done = zip(results, transfer.requests, strict=True)
        if not all(n >= len(r.buffer) for n, r in done):
            return self.health.damaged(header, "is cut short on disk (truncated file)")
        for bounce, start, length in transfer.bounces:
            view[start : start + length] = bounce[:length]
        payload = view[: header.payload_size]
        if self.sealed is not None:
            if not self.sealed.passes(header, payload):
                return False
        elif (
            self.verify_reads or self.read_only or not entry.verified
        ) and not header.payload_matches(payload):
            return self.health.damaged(header, "failed its checksum")
        entry.verified = True
        return True

    def _end_reads(
        self, entries: Sequence[Entry | None], outcomes: Sequence[bool | None]
    ) -> None:
        """Count hits and misses, drop bad records, free slots of dead ones."""
        with self._lock:
            for entry, ok in zip(entries, outcomes, strict=True):
                if entry is None:
                    continue
                if ok:
                    self.stats.hits += 1
                    self.stats.bytes_read += entry.header.payload_size
                else:
                    self.stats.misses += 1
                self.index.end_read(entry, ok)

    # ------------------------------------------------------ load, recover

    def _load(self) -> str | None:
        """Rebuild the index from the files (see :meth:`TierFileSet.load`);
        why not, when they cannot be read."""
        if self._follower is not None:
            self._follower.mark()
        loaded = self.files.load(self.index.max_slots)
        if isinstance(loaded, str):
            return loaded
        records, slots = loaded
        if self.sealed is not None:
            records = self.sealed.sealed(records, itemgetter(1))
        with self._lock:
            self.index.load(records, slots)
        return None

    def _recover(self) -> str | None:
        """One probe of a degraded tier: how it serves again, or None.

        The same files answering again keep the index, each record to be
        CRC-checked on its next read (or load it, if start-up could not);
        files replaced at the tier's paths (or a path back after it was
        removed) are opened afresh, once no operation still uses the old ones.
        """
        if self.files.missing() is None:
            if (why := self._claim()) is not None:
                logger.debug("tier %s: still not ours: %s", self.name, why)
                return None
            if self._unloaded:
                if (why := self._load()) is not None:
                    logger.debug("tier %s: still unreadable: %s", self.name, why)
                    return None
                how = f"its files read again, {len(self.index)} chunks found"
            elif not self.files.probe_io():
                return None
            else:
                how = "its files answer again"
        else:
            with self._lock:
                if self.health.busy_locked():
                    return None
            self.files.close()
            self.index.max_slots = self._capacity_slots
            self.files.open()
            try:
                why = self._claim() or self._load()
            except BaseException:
                self.files.close()
                raise
            if why is not None:
                self._unloaded = True
                logger.debug("tier %s: still unreadable: %s", self.name, why)
                return None
            how = f"reopened its files, {len(self.index)} chunks found"
        self._unloaded = False
        with self._lock:
            self.index.forget_checks()
        self._ours()
        return how

    def _ours(self) -> None:
        """The files are ours and loaded (opened, or recovered): a new change
        log generation, since headers may have been written that the old one
        does not name (a crash between the two, another writer's)."""
        if self.changes is not None:
            self.changes.start()

    def _claim(self) -> str | None:
        """Make the files ours (see :mod:`lmcache_tiered.storage.ownership`);
        why not, while another writer's record stands."""
        lease = self.files.lease
        if lease is None:
            return None
        if (other := lease.rival()) is not None:
            return lease.conflict(other)
        lease.claim()
        return None

    def _renew_lease(self) -> None:
        """The prober's heartbeat, every period while the tier is healthy."""
        lease = self.files.lease
        if lease is not None and (other := lease.renew()) is not None:
            self._lost_files(other)

    def refresh(self) -> None:
        """Bring a read-only tier up to what its owner stored since: the
        header blocks its change log names, or all of them where the log
        cannot tell (:mod:`lmcache_tiered.storage.mirror`)."""
        assert self._follower is not None, "only another process's tier is refreshed"
        with self.health.in_use() as usable:
            if usable and not self._follower.catch_up():
                self._load()

    def close(self) -> None:
        """Stop the prober, release the engine and the files (idempotent)."""
        if self.health.close():
            self.files.close()
            if self.changes is not None:
                self.changes.close()
