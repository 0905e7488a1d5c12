"""The tier's index on its own: slots, pins and readers, recency, eviction.

No files: :class:`SlotIndex` does no I/O, so these tests drive it directly
(the tier's data path over real files is in test_tier.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered.keys import key_digest
from lmcache_tiered.storage.index import Entry, SlotIndex
from lmcache_tiered.storage.layout import RecordHeader


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("test-model", 1, 0, 1000 + i, torch.bfloat16, None)


def header(i: int, sequence: int = 0) -> RecordHeader:
    return RecordHeader(
        key=key(i),
        shape=torch.Size([8]),
        dtype=torch.bfloat16,
        fmt=MemoryFormat.KV_2LTD,
        payload_size=16,
        payload_crc=0,
        sequence=sequence,
        created_ns=0,
    )


def filled(count: int, max_slots: int | None = None) -> SlotIndex:
    """An index with keys 0..count-1 in slots taken as a writer takes them
    (0 is the least recent)."""
    index = SlotIndex(max_slots or count)
    index.add_slots(index.max_slots)
    index.give_back(0)  # add_slots hands out the first slot: free it again
    for i in range(count):
        slot = index.free_slot()
        assert slot is not None
        index.insert(Entry(slot, header(i)))
    return index


def test_remove_while_reading_frees_slot_once() -> None:
    """Moved from test_tier.py (it reached into Tier._begin_reads/_free)."""
    index = filled(1, max_slots=4)
    entries = index.begin_reads([key(0)])
    entry = entries[0]
    assert entry is not None
    assert index.remove(key(0))
    assert entry.slot not in index.free_slots
    index.end_read(entry, True)
    assert index.free_slots.count(entry.slot) == 1


def test_slots_are_taken_in_order_and_each_once() -> None:
    index = SlotIndex(3)
    assert index.free_slot() is None and index.spare == 3
    assert index.add_slots(3) == 0
    assert [index.free_slot(), index.free_slot(), index.free_slot()] == [1, 2, None]
    assert index.allocated_slots == 3 and index.spare == 0


def test_eviction_takes_the_least_recent_unpinned_unread_record() -> None:
    index = filled(4)
    index.touch([key(0)], pin=True)  # most recent, and pinned
    readers = index.begin_reads([key(1)])  # being read
    assert [e.header.key for e in index.victims(2)] == [key(2), key(3)]
    assert index.popitem({key_digest(key(3))}).slot == 3
    assert index.popitem().header.key == key(2)
    assert index.popitem() is None  # only the pinned and the read one are left
    assert readers[0] is not None
    index.end_read(readers[0], True)
    assert index.unpin(key(0)) and not index.unpin(key(0))
    assert [e.header.key for e in index] == [key(0), key(1)]
    assert index.popitem().header.key == key(0)
    assert index.popitem().header.key == key(1)


def test_victims_only_when_the_spare_slots_run_out() -> None:
    index = filled(2, max_slots=4)
    assert index.spare == 2
    assert index.victims(2) == []
    assert [e.header.key for e in index.victims(3)] == [key(0)]


def test_touch_makes_a_chain_head_more_recent_than_its_tail() -> None:
    """Keys come in prefix order; the head ends up most recent, so eviction
    takes tails first."""
    index = filled(3)
    assert index.touch([key(0), key(1), key(9)]) == 2
    assert [e.header.key for e in index] == [key(2), key(1), key(0)]


def test_a_bad_read_drops_the_record_and_frees_its_slot() -> None:
    index = filled(2, max_slots=3)
    (entry,) = index.begin_reads([key(1)])
    assert entry is not None
    index.end_read(entry, False)
    assert key(1) not in index and entry.slot in index.free_slots
    (entry,) = index.begin_reads([key(0)])
    assert entry is not None
    index.end_read(entry, None)  # not read (a device error): the record stays
    assert key(0) in index and entry.slot not in index.free_slots


def test_a_rewritten_key_frees_the_older_slot() -> None:
    index = filled(1, max_slots=2)
    old = index.get(key(0))
    assert old is not None
    slot = index.free_slot()
    assert slot == 1
    index.insert(Entry(slot, header(0)))
    assert index.get(key(0)).slot == 1
    assert old.slot in index.free_slots


def test_load_keeps_the_given_records_and_frees_the_rest() -> None:
    index = SlotIndex(8)
    index.load([(5, header(1, sequence=7)), (2, header(0, sequence=9))], slots=6)
    assert [e.header.key for e in index] == [key(1), key(0)]
    assert all(not e.verified for e in index)
    assert index.sequence == 9 and index.allocated_slots == 6
    assert sorted(index.free_slots) == [0, 1, 3, 4]
    assert index.reserve_sequences(3) == 12


def test_overriding_candidates_changes_what_is_evicted() -> None:
    """One eviction choice: popitem and victims both follow it."""

    class MostRecentFirst(SlotIndex):
        def candidates(self) -> Iterator[bytes]:
            return reversed([d for d in super().candidates()])

    index = MostRecentFirst(3)
    index.add_slots(3)
    index.give_back(0)
    for i in range(3):
        slot = index.free_slot()
        assert slot is not None
        index.insert(Entry(slot, header(i)))
    assert [e.header.key for e in index.victims(1)] == [key(2)]
    assert index.popitem().header.key == key(2)
