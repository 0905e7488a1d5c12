"""What one tier stores where: records by key, free slots, pins and readers,
recency, and which record to evict.

No I/O and no lock: :class:`lmcache_tiered.storage.tier.Tier` calls it under its own
lock and never holds that lock across I/O. Eviction is one choice,
:meth:`SlotIndex.candidates` (least recently used first, as cachetools'
``LRUCache.popitem``): a subclass that overrides it changes what
:meth:`SlotIndex.popitem` evicts and what :meth:`SlotIndex.victims` reports
for demotion, together.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.storage.layout import RecordHeader


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


class SlotIndex:
    """The records of a tier in recency order (least recent first), its free
    slots, and how many of its ``max_slots`` are allocated on disk.

    A slot is in exactly one place: a record, the free list, or a dead record
    still being read (freed when its last reader leaves).
    """

    def __init__(self, max_slots: int) -> None:
        #: slots the tier may grow to (lowered when its disk is full)
        self.max_slots = max_slots
        #: slots preallocated on disk so far
        self.allocated_slots = 0
        #: the highest sequence number given to a record
        self.sequence = 0
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        #: free slots, the next one taken last
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: StoreKey) -> bool:
        return key_digest(key) in self._entries

    def __iter__(self) -> Iterator[Entry]:
        """The records, least recently used first."""
        return iter(self._entries.values())

    def get(self, key: StoreKey) -> Entry | None:
        return self._entries.get(key_digest(key))

    @property
    def free_slots(self) -> tuple[int, ...]:
        """The free slots now (the next one taken last)."""
        return tuple(self._free)

    @property
    def spare(self) -> int:
        """Slots a write can take without evicting: free or still to grow."""
        return len(self._free) + self.max_slots - self.allocated_slots

    def load(self, records: Iterable[tuple[int, RecordHeader]], slots: int) -> None:
        """Start over with the records recovered from disk (in recency order,
        each CRC-checked on its first read) over ``slots`` allocated slots;
        the others are free."""
        self._entries = OrderedDict(
            (key_digest(h.key), Entry(slot, h, verified=False)) for slot, h in records
        )
        used = {e.slot for e in self._entries.values()}
        self.allocated_slots = slots
        self._free = sorted(set(range(slots)) - used, reverse=True)
        self.sequence = max((e.header.sequence for e in self), default=0)

    def forget_checks(self) -> None:
        """Check every record's CRC on its next read (the files were away)."""
        for entry in self._entries.values():
            entry.verified = False

    # ------------------------------------------------------------ recency

    def touch(self, keys: Sequence[StoreKey], pin: bool = False) -> int:
        """Make the stored ``keys`` most recent (pinning them on request);
        how many are stored.

        Keys come in prefix order and are touched tails first, so a chain's
        head is always more recent than its tail: eviction never leaves a
        tail whose head is gone.
        """
        found = 0
        for key in keys:
            if (entry := self.get(key)) is not None:
                found += 1
                entry.pins += pin
        for key in reversed(keys):
            digest = key_digest(key)
            if digest in self._entries:
                self._entries.move_to_end(digest)
        return found

    def unpin(self, key: StoreKey) -> bool:
        entry = self.get(key)
        if entry is None or entry.pins == 0:
            return False
        entry.pins -= 1
        return True

    # -------------------------------------------------------------- reads

    def begin_reads(self, keys: Sequence[StoreKey]) -> list[Entry | None]:
        """The entry of each key (None: not stored), each counted as being
        read until :meth:`end_read`; the keys become most recent."""
        entries = [self.get(key) for key in keys]
        for entry in entries:
            if entry is not None:
                entry.readers += 1
        self.touch(keys)
        return entries

    def end_read(self, entry: Entry, ok: bool | None) -> None:
        """One read of ``entry`` is over; ``ok`` False (a bad record) drops it.
        The slot of a dead record is freed when its last reader leaves."""
        entry.readers -= 1
        if ok is False:
            digest = key_digest(entry.header.key)
            if self._entries.get(digest) is entry:
                del self._entries[digest]
            entry.dead = True
        if entry.dead and entry.readers == 0:
            self._free.append(entry.slot)

    # ------------------------------------------------------------- writes

    def reserve_sequences(self, count: int) -> int:
        """Take ``count`` sequence numbers; returns the highest."""
        self.sequence += count
        return self.sequence

    def free_slot(self) -> int | None:
        """A free slot, taken; None if there is none."""
        return self._free.pop() if self._free else None

    def add_slots(self, count: int) -> int:
        """Count ``count`` more slots as allocated (the caller preallocated
        them); returns the first, taken, and frees the others."""
        first = self.allocated_slots
        self.allocated_slots = first + count
        self._free.extend(range(first + count - 1, first, -1))
        return first

    def give_back(self, slot: int) -> None:
        """Free a slot taken for a write that failed."""
        self._free.append(slot)

    def insert(self, entry: Entry) -> None:
        """Make a written record visible (most recent); an older record of
        the same key (a concurrent writer) loses its slot."""
        digest = key_digest(entry.header.key)
        if (old := self._entries.pop(digest, None)) is not None:
            self._release(old)
        self._entries[digest] = entry

    def remove(self, key: StoreKey) -> bool:
        """Forget a record; its slot is reused once no read is using it."""
        entry = self._entries.pop(key_digest(key), None)
        if entry is None:
            return False
        self._release(entry)
        return True

    def _release(self, entry: Entry) -> None:
        """Free an entry's slot now, or when its last reader leaves."""
        if entry.readers:
            entry.dead = True
        else:
            self._free.append(entry.slot)

    # ----------------------------------------------------------- eviction

    def candidates(self) -> Iterator[bytes]:
        """Digests of the records that may be evicted now, first victim
        first: least recently used, neither pinned nor being read.

        The one eviction choice: override it to change the policy."""
        for digest, entry in self._entries.items():
            if entry.pins == 0 and entry.readers == 0:
                yield digest

    def popitem(self, allowed: Collection[bytes] | None = None) -> Entry | None:
        """Remove and return the first candidate (whose digest is in
        ``allowed``, if given); None if none may go."""
        for digest in self.candidates():
            if allowed is None or digest in allowed:
                return self._entries.pop(digest)
        return None

    def victims(self, count: int) -> list[Entry]:
        """The records that taking ``count`` more slots would evict now, in
        eviction order."""
        need = count - self.spare
        if need <= 0:
            return []
        return [self._entries[d] for d in islice(self.candidates(), need)]
