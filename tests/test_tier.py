"""The striped tier on real files: round trips, restart, corruption, capacity."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ENGINES, payload_offset, random_kv
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from lmcache_tiered.io.base import EngineWrapper, IORequest
from lmcache_tiered.storage import checks
from lmcache_tiered.storage.index import Entry
from lmcache_tiered.storage.layout import RecordHeader
from lmcache_tiered.storage.tier import Payload, Tier
from lmcache_tiered.testing.lmcache import MixedMemoryAllocator

SHAPE = torch.Size([2, 2, 64, 128])  # 64 KiB of bf16: one slot of the test tier
TierFactory = Callable[..., Tier]


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("test-model", 1, 0, 1000 + i, torch.bfloat16, None)


def make_obj(
    allocator: MixedMemoryAllocator, seed: int, shape: torch.Size = SHAPE
) -> MemoryObj:
    obj = allocator.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
    assert obj is not None and obj.tensor is not None
    obj.tensor.copy_(random_kv(shape, seed))
    return obj


def reader(allocator: MixedMemoryAllocator) -> Callable[[RecordHeader], MemoryObj]:
    def allocate(header: RecordHeader) -> MemoryObj:
        obj = allocator.allocate(header.shape, header.dtype, header.fmt)
        assert obj is not None
        return obj

    return allocate


@pytest.mark.parametrize("engine", ENGINES)
def test_round_trip_striped_over_devices(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator, engine: str
) -> None:
    tier = tier_factory(io_engine=engine, stripe_kb=16)
    assert tier.engine.name == engine
    objs = [make_obj(allocator, i) for i in range(10)]
    assert tier.write([(key(i), o) for i, o in enumerate(objs)]) == [True] * 10
    out = tier.read([key(i) for i in range(10)], reader(allocator))
    for got, want in zip(out, objs, strict=True):
        assert got is not None and torch.equal(got.tensor, want.tensor)
    assert tier.stats.hits == 10
    # every chunk touches both devices: each slab holds half of each chunk
    sizes = [os.path.getsize(p) for p in tier.paths]
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_partial_chunk_with_unaligned_size(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator, engine: str
) -> None:
    """A trailing partial chunk (size not a multiple of 4 KiB) goes through a
    bounce buffer and comes back exact."""
    tier = tier_factory(io_engine=engine)
    shape = torch.Size([2, 2, 7, 100])  # 5,600 bytes
    obj = make_obj(allocator, 3, shape)
    assert tier.write([(key(1), obj)]) == [True]
    (got,) = tier.read([key(1)], reader(allocator))
    assert got is not None and torch.equal(got.tensor, obj.tensor)


def test_restart_recovers_index_and_order(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    tier = tier_factory()
    objs = [make_obj(allocator, i) for i in range(5)]
    tier.write([(key(i), o) for i, o in enumerate(objs)])
    tier.close()
    again = tier_factory()
    assert sorted(k.chunk_hash for k in again.stored_keys()) == [
        1000 + i for i in range(5)
    ]
    out = again.read([key(i) for i in range(5)], reader(allocator))
    assert all(
        g is not None and torch.equal(g.tensor, o.tensor)
        for g, o in zip(out, objs, strict=True)
    )


def test_second_live_owner_is_refused(tier_factory: TierFactory) -> None:
    tier_factory()
    with pytest.raises(ValueError, match=f"held by live process {os.getpid()};"):
        tier_factory()


@pytest.mark.parametrize("verify_reads", [True, False])
def test_flipped_payload_byte_is_a_miss_and_dropped(
    tier_factory: TierFactory,
    allocator: MixedMemoryAllocator,
    verify_reads: bool,
) -> None:
    """Even with verify_reads off, records recovered after a restart are
    checked on first read, so bit rot or a torn write is never served."""
    tier = tier_factory()
    tier.write([(key(i), make_obj(allocator, i)) for i in range(3)])
    path, offset = payload_offset(tier, key(1))
    tier.close()
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    tier = tier_factory(verify_reads=verify_reads)
    out = tier.read([key(0), key(1), key(2)], reader(allocator))
    assert out[0] is not None and out[2] is not None
    assert out[1] is None
    assert tier.stats.corrupt == 1
    assert not tier.contains(key(1))  # dropped: the slot is free again


def test_truncated_slab_is_a_miss(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    tier = tier_factory()
    tier.write([(key(i), make_obj(allocator, i)) for i in range(4)])
    tier.close()
    for path in tier.paths:
        os.truncate(os.path.join(path, "kv-w0.slab"), 3 * tier.geometry.per_device // 2)
    tier = tier_factory()
    out = tier.read([key(i) for i in range(4)], reader(allocator))
    assert out[0] is not None
    assert out[2:] == [None, None]
    assert tier.stats.io_errors + tier.stats.corrupt >= 2


def test_damaged_header_is_skipped_on_restart(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    tier = tier_factory()
    tier.write([(key(i), make_obj(allocator, i)) for i in range(3)])
    tier.close()
    header_file = os.path.join(tier.paths[0], "kv-w0.hdr")
    with open(header_file, "r+b") as f:
        f.seek(2 * 4096 + 30)  # inside the header of slot 1
        f.write(b"\xff\xff")
    tier = tier_factory()
    assert len(tier) == 2
    assert tier.stats.corrupt == 1


def test_capacity_holds_and_lru_evicts(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    tier = tier_factory(capacity_bytes=6 * (64 << 10) + 6 * 4096)
    assert tier.max_slots == 6
    for i in range(6):
        tier.write([(key(i), make_obj(allocator, i))])
    tier.contains(key(0))  # touch: key 0 is now most recent
    tier.write([(key(10), make_obj(allocator, 10))])
    assert tier.contains(key(0))
    assert not tier.contains(key(1))  # the least recent went
    assert tier.stats.evictions == 1
    disk = (
        sum(
            os.path.getsize(os.path.join(p, f"kv-w0.{ext}"))
            for p in tier.paths
            for ext in ("slab",)
        )
        + os.path.getsize(os.path.join(tier.paths[0], "kv-w0.hdr"))
        - 4096
    )
    assert disk <= 6 * tier.geometry.slot_disk_bytes


def test_pinned_chunks_survive_and_full_tier_drops_puts(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    tier = tier_factory(capacity_bytes=2 * ((64 << 10) + 4096))
    tier.write([(key(0), make_obj(allocator, 0)), (key(1), make_obj(allocator, 1))])
    assert tier.pin(key(0)) and tier.pin(key(1))
    assert tier.write([(key(2), make_obj(allocator, 2))]) == [False]
    assert tier.stats.puts_dropped == 1
    assert tier.contains(key(0)) and tier.contains(key(1))
    tier.unpin(key(0))
    assert tier.write([(key(2), make_obj(allocator, 2))]) == [True]
    assert not tier.contains(key(0)) and tier.contains(key(1))


def test_oversized_chunk_is_dropped_not_truncated(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    tier = tier_factory(max_payload=16 << 10)
    assert tier.write([(key(0), make_obj(allocator, 0))]) == [False]
    assert tier.stats.puts_dropped == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_concurrent_writers_and_readers(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator, engine: str
) -> None:
    """Threads write and read overlapping keys under eviction pressure; every
    chunk served is byte-identical to what was written under its key."""
    tier = tier_factory(io_engine=engine, capacity_bytes=12 * ((64 << 10) + 4096))
    source = {i: random_kv(SHAPE, i) for i in range(24)}
    errors: list[str] = []
    allocate = reader(allocator)

    def writer(offset: int) -> None:
        for _ in range(6):
            batch = []
            for i in range(offset, 24, 3):
                obj = allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
                assert obj is not None and obj.tensor is not None
                obj.tensor.copy_(source[i])
                batch.append((key(i), obj))
            tier.write(batch)
            for _, obj in batch:
                obj.ref_count_down()

    writers_done = threading.Event()

    def read_loop() -> None:
        while not writers_done.is_set():
            keys = [key(i) for i in range(24)]
            for i, got in enumerate(tier.read(keys, allocate)):
                if got is not None:
                    if not torch.equal(got.tensor, source[i]):
                        errors.append(f"wrong data for key {i}")
                    got.ref_count_down()

    threads = [threading.Thread(target=writer, args=(o,)) for o in range(3)]
    threads += [threading.Thread(target=read_loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads[:3]:
        t.join(timeout=60)
    writers_done.set()
    read_loop()  # one last pass after the writers: all 12 stored keys hit
    for t in threads[3:]:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert tier.stats.hits > 0
    assert len(tier) <= 12
    slots = [e.slot for e in tier.index]
    assert len(slots) == len(set(slots))
    assert not set(slots) & set(tier.index.free_slots)


def test_odirect_is_really_used(tier_factory: TierFactory) -> None:
    tier = tier_factory(io_engine="uring")
    for fd in tier.files.fds:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            flags = int(
                next(line for line in f if line.startswith("flags")).split()[1], 8
            )
        assert flags & os.O_DIRECT
    links = [
        os.readlink(f"/proc/self/fd/{n}")
        for n in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{n}")
    ]
    assert "anon_inode:[io_uring]" in links


def test_direct_io_off_opens_buffered(
    tier_factory: TierFactory, tmp_path: Path
) -> None:
    tier = tier_factory(direct_io=False)
    with open(f"/proc/self/fdinfo/{tier.files.fds[0]}") as f:
        flags = int(next(line for line in f if line.startswith("flags")).split()[1], 8)
    assert not flags & os.O_DIRECT


def test_evict_only_spares_records_not_copied_elsewhere(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    """The writer demotes warm's victims, then writes with evict_only=victims:
    a read that touches a victim meanwhile cannot make the write evict a
    record never copied below; with nothing evictable the chunk is refused."""
    tier = tier_factory(capacity_bytes=2 * ((64 << 10) + 4096))
    tier.write([(key(0), make_obj(allocator, 0)), (key(1), make_obj(allocator, 1))])
    victims = tier.victims(1)
    assert victims == [key(1)]  # tails first: key 1 is the least recent
    tier.contains(key(1))  # a demand read touches it: key 0 is now the LRU
    stored = tier.write_payloads([Payload.of(key(2), make_obj(allocator, 2))], victims)
    assert stored == [True]
    assert tier.contains(key(0)) and not tier.contains(key(1))
    assert tier.write_payloads([Payload.of(key(3), make_obj(allocator, 3))], []) == [
        False
    ]


def test_an_engine_wrapper_hears_the_bytes_each_operation_moved(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    """What the bench's device models (and fault injectors) wrap: set through
    ``Tier.engine``, an :class:`EngineWrapper` sees every batch of real I/O
    of demand reads, payload reads and payload writes, with the bytes it
    moved; misses and keys already stored move none. (It replaces the
    tier's former ``after_io`` hook, which the bench alone used.)"""
    tier = tier_factory()
    heard: list[tuple[bool, int]] = []

    class Recording(EngineWrapper):
        def submit_many(
            self, batches: Sequence[Sequence[IORequest]], write: bool
        ) -> list[Future[list[int]]]:
            futures = self.inner.submit_many(batches, write)
            moved = sum(n for f in futures for n in f.result() if n > 0)
            heard.append((write, moved))
            return futures

    tier.engine = Recording(tier.engine)
    assert tier.engine.name == tier.engine.inner.name
    chunk = SHAPE.numel() * 2
    obj = make_obj(allocator, 0)
    assert tier.write([(key(0), obj)]) == [True]
    writes = list(heard)
    # the payload, then its header: both written, nothing read
    assert [w for w, _ in writes] == [True, True]
    assert writes[0][1] >= chunk and sum(n for _, n in writes) > chunk
    assert tier.write([(key(0), obj)]) == [True]  # already stored: no I/O
    assert heard == writes
    (got,) = tier.read([key(0)], reader(allocator))
    assert got is not None and torch.equal(got.tensor, obj.tensor)
    assert tier.read([key(1)], reader(allocator)) == [None]
    (payload,) = tier.read_payloads([key(0)])
    assert payload is not None
    assert tier.read_payloads([key(0), key(1)])[1] is None
    reads = [(w, n) for w, n in heard[len(writes) :] if n]
    # three reads of key 0; the miss of key 1 moved nothing
    assert [w for w, _ in reads] == [False] * 3
    assert all(n >= chunk for _, n in reads)


def test_a_failing_check_is_raised_once_every_read_landed(
    tier_factory: TierFactory,
    allocator: MixedMemoryAllocator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checks run on the verifier pool, started from the engine's completion
    thread; one that raises (a bug, not bad data) must reach the reader, and
    only after every other record's check ran (none still writes into the
    caller's buffers), instead of leaving the reader waiting forever."""
    tier = tier_factory()
    tier.write([(key(i), make_obj(allocator, i)) for i in range(4)])
    finish = Tier._finish_read
    checked: list[int] = []

    def failing(self: Tier, entry: Entry, *args: object) -> bool | None:
        checked.append(entry.header.key.chunk_hash)
        if entry.header.key == key(1):
            raise RuntimeError("a check broke")
        return finish(self, entry, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Tier, "_finish_read", failing)
    raised: list[BaseException] = []

    def read() -> None:
        try:
            tier.read([key(i) for i in range(4)], reader(allocator))
        except RuntimeError as exc:
            raised.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the reader never heard of its checks"
    assert [str(e) for e in raised] == ["a check broke"]
    assert sorted(checked) == [key(i).chunk_hash for i in range(4)]
    assert all(e.readers == 0 for e in tier.index)  # all evictable again
    monkeypatch.setattr(Tier, "_finish_read", finish)
    assert all(o is not None for o in tier.read([key(0), key(2)], reader(allocator)))


def test_checks_run_in_place_once_the_pool_takes_no_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At interpreter exit the verifier pool refuses work; a record that lands
    then is still checked (on the completion thread), never left unwaited."""
    closed = ThreadPoolExecutor(1)
    closed.shutdown()
    monkeypatch.setattr(checks, "VERIFIERS", closed)
    batch: checks.CheckBatch[int] = checks.CheckBatch(3, 2)
    batch.start(0, lambda n: n * 2, 21)
    batch.start(2, lambda: threading.get_ident())
    assert batch.wait() == [42, None, threading.get_ident()]


def test_a_read_that_raises_leaves_its_slots_evictable(
    tier_factory: TierFactory,
    allocator: MixedMemoryAllocator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LMCache's allocator (given another host's header shape), the bounce
    buffer or a check can raise mid-read; the read's records must stop
    counting as being read, or a full tier pins them forever and drops
    every later put."""
    tier = tier_factory(capacity_bytes=2 * ((64 << 10) + 4096))
    objs = [make_obj(allocator, i) for i in range(2)]
    assert tier.write([(key(i), o) for i, o in enumerate(objs)]) == [True, True]
    allocate = reader(allocator)
    handed: list[MemoryObj] = []

    def second_raises(header: RecordHeader) -> MemoryObj:
        if handed:
            raise ValueError("no such shape")
        handed.append(allocate(header))
        return handed[-1]

    with pytest.raises(ValueError, match="no such shape"):
        tier.read([key(0), key(1)], second_raises)
    assert tier.write([(key(2), make_obj(allocator, 2))]) == [True]
    assert handed[0].get_ref_count() == 0  # the first buffer was given back
    calls: list[int] = []

    def buffer_fails(size: int) -> memoryview:
        calls.append(size)
        raise MemoryError("no aligned memory")

    monkeypatch.setattr("lmcache_tiered.storage.tier.aligned_buffer", buffer_fails)
    stored = [k for k in (key(0), key(1), key(2)) if tier.contains(k)]
    with pytest.raises(MemoryError):
        tier.read_payloads(stored)
    assert calls
    monkeypatch.undo()
    assert tier.write([(key(3), make_obj(allocator, 3))]) == [True]
    assert tier.write([(key(4), make_obj(allocator, 4))]) == [True]
    assert tier.stats.puts_dropped == 0
    assert all(e.readers == 0 for e in tier.index)


class FailingWrites(EngineWrapper):
    """Fails every write of a tier's real engine with EIO (no dm-error in
    this container); reads go through."""

    def submit_many(
        self, batches: Sequence[Sequence[IORequest]], write: bool
    ) -> list[Future[list[int]]]:
        if not write:
            return self.inner.submit_many(batches, write)
        failed: list[Future[list[int]]] = [Future() for _ in batches]
        for future, requests in zip(failed, batches, strict=True):
            future.set_result([-errno.EIO] * len(requests))
        return failed


def test_a_key_twice_in_a_batch_shares_its_one_write_result(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> None:
    """The multi-process adapter merges several tasks' puts into one batch,
    so a key can come twice; its second copy must not be acknowledged before
    (or unless) the first copy's write succeeded."""
    tier = tier_factory()
    tier.engine = FailingWrites(tier.engine)
    obj = make_obj(allocator, 5)
    assert tier.write([(key(5), obj), (key(6), obj), (key(5), obj)]) == [False] * 3
    assert not tier.contains(key(5))
    tier.engine = tier.engine.inner  # type: ignore[attr-defined]
    assert tier.write([(key(5), obj), (key(6), obj), (key(5), obj)]) == [True] * 3
    assert len(tier) == 2 and tier.stats.puts == 2
    oversized = make_obj(allocator, 7, torch.Size([2, 2, 128, 128]))
    assert tier.write([(key(7), oversized), (key(7), oversized)]) == [False] * 2
