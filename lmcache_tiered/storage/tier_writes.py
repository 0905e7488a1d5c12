"""The write half of a tier's data path: slots taken (evicting the least
recently used), payloads then headers written in one engine batch each, the
index updated once they are on disk, the files grown as the tier fills.

:class:`TierWrites` is a part of :class:`lmcache_tiered.storage.tier.Tier`,
which owns the state it uses (declared here) and the read half.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from itertools import repeat

from lmcache.v1.memory_management import MemoryObj

from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.io.base import IORequest
from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage.changes import ChangeLog
from lmcache_tiered.storage.checks import VERIFIERS
from lmcache_tiered.storage.health import TierHealth
from lmcache_tiered.storage.index import Entry, SlotIndex
from lmcache_tiered.storage.layout import HEADER_SIZE, Geometry, payload_checksum
from lmcache_tiered.storage.ownership import OwnerRecord
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.seal import SealedRecords
from lmcache_tiered.storage.tierfiles import TierFileSet, Transfer, plan_transfer

logger = logging.getLogger("lmcache_tiered")

#: Slots preallocated on disk at a time as the tier fills up.
_GROW_SLOTS = 64
#: errnos of a full file system: the tier stops growing but is not degraded.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class TierWrites:
    """Writes of a tier (see the module docstring)."""

    name: str
    read_only: bool
    stats: TierStats
    health: TierHealth
    index: SlotIndex
    geometry: Geometry
    files: TierFileSet
    changes: ChangeLog | None
    on_evict: Callable[[list[StoreKey]], None] | None
    _lock: threading.Lock
    _slot_setting: str
    sealed: SealedRecords | None
    #: the index must be loaded from the files before the tier serves again
    _unloaded: bool

    def write(self, items: Sequence[tuple[StoreKey, MemoryObj]]) -> list[bool]:
        """Store LMCache MemoryObjs; see :meth:`write_payloads`."""
        return self.write_payloads([Payload.of(key, obj) for key, obj in items])

    def write_payloads(
        self,
        payloads: Sequence[Payload],
        evict_only: Collection[StoreKey] | None = None,
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
        with self.health.in_use() as usable:
            if usable:
                return self._write_payloads(payloads, allowed)
        self.stats.puts_dropped += len(payloads)
        return [False] * len(payloads)

    def _write_payloads(
        self, payloads: Sequence[Payload], allowed: set[bytes] | None
    ) -> list[bool]:
        """Whether each payload is stored."""
        stored = [False] * len(payloads)
        lease = self.files.lease
        if lease is not None and (other := lease.taken_by()) is not None:
            self._lost_files(other)
            self.stats.puts_dropped += len(payloads)
            return stored
        # heads get the higher sequence numbers: a restart, which orders the
        # index by sequence, keeps them more recent than their tails
        with self._lock:
            last_sequence = self.index.reserve_sequences(len(payloads))
        taken: list[tuple[int, int, Payload, Transfer]] = []
        evicted: list[StoreKey] = []
        #: digest -> the first copy of that key in this batch; a later copy
        #: (the MP adapter merges tasks' batches) shares that copy's result
        first_copy: dict[bytes, int] = {}
        copies: list[tuple[int, int]] = []
        #: chunks the tier already held
        kept: list[int] = []
        with self._lock:  # the records the tier holds now, once for the batch
            trusted = [
                (entry := self.index.get(p.key)) is not None and entry.verified
                for p in payloads
            ]
        for i, payload in enumerate(payloads):
            digest = key_digest(payload.key)
            if (first := first_copy.setdefault(digest, i)) != i:
                copies.append((i, first))
                continue
            if trusted[i]:
                # acknowledged if this batch's evictions leave it (below); a
                # record recovered after a crash and never read is no proof
                # its slot holds its payload: written anew instead
                kept.append(i)
                continue
            size = len(payload.view)
            if size > self.geometry.max_payload:
                logger.warning(
                    "tier %s: chunk of %d bytes exceeds the slot size %d; "
                    "set %s higher to store it",
                    self.name,
                    size,
                    self.geometry.max_payload,
                    self._slot_setting,
                )
                self.stats.puts_dropped += 1
                continue
            slot = self._take_slot(evicted, allowed)
            if slot is None:
                self.stats.puts_dropped += 1
                continue
            transfer = plan_transfer(
                self.geometry, slot, size, payload.view, payload.direct, False
            )
            taken.append((i, slot, payload, transfer))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        stored = self._write_taken(stored, taken, last_sequence)
        with self._lock:
            for i in kept:
                stored[i] = payloads[i].key in self.index
        for i, first in copies:
            stored[i] = stored[first]
        return stored

    def _lost_files(self, other: OwnerRecord) -> None:
        """Another writer's record replaced ours: stop writing (degraded), and
        read the files afresh once they are ours again."""
        assert self.files.lease is not None
        self._unloaded = True
        self.health.degrade(self.files.lease.conflict(other))

    def _write_taken(
        self,
        stored: list[bool],
        taken: list[tuple[int, int, Payload, Transfer]],
        last_sequence: int,
    ) -> list[bool]:
        """Write the payloads given slots, then their headers; ``stored``
        updated."""
        if not taken:
            return stored
        requests = [r for _, _, _, t in taken for r in t.requests]
        writing = self.files.submit(requests, write=True)
        # checksums (and MACs) on the verifier threads while the payloads are
        # in flight
        payloads = [p for _, _, p, _ in taken]
        checksums = VERIFIERS.map(payload_checksum, [p.view for p in payloads])
        sealed = self.sealed
        macs = repeat(b"") if sealed is None else VERIFIERS.map(sealed.sign, payloads)
        planned = [
            (i, Entry(slot, payload.header(crc, last_sequence - i, mac)), t)
            for (i, slot, payload, t), crc, mac in zip(
                taken, checksums, macs, strict=False
            )
        ]
        payload_ok = self._finish_writes(requests, writing, planned)
        headers = []
        for ok, (_, entry, _) in zip(payload_ok, planned, strict=True):
            if ok:
                block = aligned_buffer(HEADER_SIZE)
                block[:] = entry.header.encode()
                offset = Geometry.header_offset(entry.slot)
                headers.append(IORequest(self.files.header_file, offset, block))
        header_ok = iter(self._write_all(headers) if headers else ())
        if self.changes is not None:  # one append per batch, after its headers
            tried = zip(payload_ok, planned, strict=True)
            self.changes.append([entry.slot for ok, (_, entry, _) in tried if ok])
        done = [ok and next(header_ok) for ok in payload_ok]
        if any(done) and (gone := self.files.missing()) is not None:
            # written into a file no longer at its path: lost on restart
            self.health.degrade(f"{gone} was removed or replaced")
            done = [False] * len(done)
        with self._lock:
            # tails first, so the chain's head ends up the most recent
            for ok, (i, entry, _) in reversed(list(zip(done, planned, strict=True))):
                if ok:
                    self.index.insert(entry)
                    self.stats.puts += 1
                    self.stats.bytes_written += entry.header.payload_size
                    stored[i] = True
                else:
                    self.stats.io_errors += 1
                    self.index.give_back(entry.slot)
        return stored

    def _write_all(self, requests: list[IORequest]) -> list[bool]:
        """Write a batch (and fdatasync if configured); success per request."""
        return self._finish_writes(requests, self.files.submit(requests, write=True))

    def _finish_writes(
        self,
        requests: list[IORequest],
        writing: Future[list[int]],
        per_record: Sequence[tuple[int, Entry, Transfer]] | None = None,
    ) -> list[bool]:
        """Wait for a submitted batch (see :meth:`TierFileSet.written`);
        success per record, or per request when ``per_record`` is None."""
        written, failure = self.files.written(requests, writing)
        self.health.note_io(failure)
        if per_record is None:
            return written
        flags = iter(written)
        return [all([next(flags) for _ in t.requests]) for _, _, t in per_record]

    def _take_slot(
        self, evicted: list[StoreKey], allowed: set[bytes] | None
    ) -> int | None:
        """A free slot: a released one, a new one, or the first eviction
        candidate's (whose key is appended to ``evicted``); victims only from
        ``allowed`` if set."""
        with self._lock:
            if (slot := self.index.free_slot()) is not None:
                return slot
            if self.index.allocated_slots < self.index.max_slots:
                return self._grow()
            entry = self.index.popitem(allowed)
            if entry is None:
                return None
            self.stats.evictions += 1
            evicted.append(entry.header.key)
            return entry.slot

    def _grow(self) -> int | None:
        """Preallocate the next group of slots on every device (locked)."""
        first = self.index.allocated_slots
        count = min(_GROW_SLOTS, self.index.max_slots - first)
        try:
            self.files.preallocate(first, count)
        except OSError as exc:
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
            self.index.max_slots = first
            return None
        return self.index.add_slots(count)
