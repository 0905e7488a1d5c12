"""A read-only tier kept in step with another owner's files by reading only
the header blocks its change log names (:mod:`lmcache_tiered.storage.changes`).

:class:`Follower` reads what the owner logged since the last refresh and
those slots' header blocks (one engine batch per 4 MiB of them), and
:class:`MirrorIndex` puts each block's record in place of what the slot held
before, keeping only what a rescan keeps (no damaged record, none past a
slab's end, under a fleet secret none without a MAC). Where the log cannot
tell (see the changes module), or the header file shrank, or a block read
fails, the tier rescans the whole header file as it did before logs.

The result is what a rescan finds, with one difference that costs only a
miss: a key the owner rewrote to a new slot and then evicted from it is
forgotten, as the owner forgets it, while a rescan would serve it again from
the older copy still on disk. A stale entry is harmless besides: every read
of another owner's record is checksum-checked, and a mismatch is a miss.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from operator import itemgetter

from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.io.base import IORequest
from lmcache_tiered.keys import key_digest
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage.changes import ChangeReader
from lmcache_tiered.storage.index import Entry, SlotIndex
from lmcache_tiered.storage.layout import (
    HEADER_SIZE,
    SCAN_BYTES,
    CorruptRecord,
    Geometry,
    RecordHeader,
    decode_header_blocks,
)
from lmcache_tiered.storage.seal import SealedRecords
from lmcache_tiered.storage.tierfiles import TierFileSet


class MirrorIndex(SlotIndex):
    """The index of a read-only tier, which also knows each record's slot,
    so that a rewritten slot replaces its record (:meth:`apply`)."""

    def __init__(self, max_slots: int) -> None:
        super().__init__(max_slots)
        #: slot -> the record it held when last read (a record dropped since,
        #: by a failed read, is no longer in the index: checked on use)
        self._by_slot: dict[int, Entry] = {}

    def load(self, records: Iterable[tuple[int, RecordHeader]], slots: int) -> None:
        super().load(records, slots)
        self._by_slot = {entry.slot: entry for entry in self}

    def apply(
        self, found: Sequence[tuple[int, RecordHeader | None]], slots: int
    ) -> None:
        """The slots of ``found`` were read again: each holds the record
        given (None: none). A key's highest sequence wins, as at load
        (:func:`lmcache_tiered.storage.layout.newest`). ``slots``: how many
        the header file holds now."""
        order = sorted(found, key=lambda f: -1 if f[1] is None else f[1].sequence)
        for slot, header in order:
            old = self._by_slot.pop(slot, None)
            if old is not None and self._is_live(old):
                if old.header == header:
                    self._by_slot[slot] = old  # unchanged: keeps its checks
                    continue
                del self._entries[key_digest(old.header.key)]
            if header is None:
                continue
            digest = key_digest(header.key)
            current = self._entries.get(digest)
            if current is not None:
                if current.header.sequence >= header.sequence:
                    continue  # an older copy of the key: not served
                del self._entries[digest]
                self._by_slot.pop(current.slot, None)
            entry = Entry(slot, header, verified=False)
            self._entries[digest] = entry
            self._by_slot[slot] = entry
            self.sequence = max(self.sequence, header.sequence)
        self.allocated_slots = slots
        # a read-only tier never takes a slot: records dropped by failed
        # reads must not pile up here between rescans
        self._free.clear()

    def _is_live(self, entry: Entry) -> bool:
        return self._entries.get(key_digest(entry.header.key)) is entry


class Follower:
    """Brings a read-only tier's :class:`MirrorIndex` up to its owner's
    files, under the tier's lock only to change the index. Under a fleet
    secret (``sealed``) a record without a MAC is refused, as at load."""

    def __init__(
        self,
        files: TierFileSet,
        changes: str,
        index: MirrorIndex,
        lock: threading.Lock,
        stats: TierStats,
        sealed: SealedRecords | None,
    ) -> None:
        self._files = files
        self._log = ChangeReader(changes, index.max_slots, files.options.owner_uids)
        self._index = index
        self._lock = lock
        self._stats = stats
        self._sealed = sealed
        #: the header file's size at the last rescan or refresh
        self._size = 0

    def mark(self) -> None:
        """Just before a rescan: later changes are read from here."""
        self._log.mark()
        self._size = self._header_stat().st_size

    def catch_up(self) -> bool:
        """Read again the slots logged since; False when the whole header
        file must be rescanned instead."""
        tail = self._log.since()
        if tail is None:
            return False
        info = self._header_stat()
        if info.st_size < self._size or not tail.covers(info.st_mtime_ns):
            return False
        slots = min(info.st_size // HEADER_SIZE - 1, self._index.max_slots)
        found = self._read(sorted({s for s in tail.slots if s < slots}))
        if found is None:
            return False
        self._size = info.st_size
        with self._lock:
            self._index.apply(found, slots)
        return True

    def _header_stat(self) -> os.stat_result:
        return os.fstat(self._files.fds[self._files.header_file])

    def _read(
        self, slots: Sequence[int]
    ) -> list[tuple[int, RecordHeader | None]] | None:
        """Each slot's record (None: none, or one a rescan would not keep);
        None if a read fails."""
        found: list[tuple[int, RecordHeader | None]] = []
        if not slots:
            return found
        per_read = SCAN_BYTES // HEADER_SIZE
        buffer = aligned_buffer(min(len(slots), per_read) * HEADER_SIZE)
        blocks = [
            buffer[i : i + HEADER_SIZE] for i in range(0, len(buffer), HEADER_SIZE)
        ]
        for first in range(0, len(slots), per_read):
            group = slots[first : first + per_read]
            requests = [
                IORequest(self._files.header_file, Geometry.header_offset(s), b)
                for s, b in zip(group, blocks, strict=False)
            ]
            results = self._files.submit(requests, write=False).result()
            if any(n < 0 for n in results):
                return None
            records = self._records(group, blocks, results)
            found += [(s, records.get(s)) for s in group]
        return found

    def _records(
        self, slots: Sequence[int], blocks: Sequence[memoryview], got: Sequence[int]
    ) -> dict[int, RecordHeader]:
        """The records that the blocks read for ``slots`` hold, kept as a
        rescan keeps them: damaged ones and ones running past a slab's end
        counted and left out, and under a fleet secret those without a MAC."""
        whole, bad = [], 0
        for slot, block, size in zip(slots, blocks, got, strict=False):
            # a block cut short (the file ends in it) holds no record
            for _, header in decode_header_blocks(
                block[:size], slot, self._files.geometry.max_payload
            ):
                if isinstance(header, CorruptRecord):
                    bad += 1
                else:
                    whole.append((slot, header))
        within = self._files.within_slabs(whole)
        self._stats.corrupt += bad + len(whole) - len(within)
        if self._sealed is not None:
            within = self._sealed.sealed(within, itemgetter(1))
        return dict(within)
