"""TieredL2Adapter in LMCache's multi-process mode, on CPU.

End to end through LMCache's own MP components: ``StorageManager`` (L1
manager, store controller, prefetch controller) built from the same
``--l2-adapter`` JSON as ``lmcache server`` (``parse_args_to_l2_adapters_config``,
lmcache/v1/distributed/config.py:1065; adapter built by
storage_manager.py:1473 -> plugin_l2_adapter.py:154-176).

The other tests drive the adapter through its interface the way LMCache does,
and as LMCache's own adapter check does (lmcache/v1/check/
check_mode_test_l2_adapter.py:101-138): submit, poll the operation's event fd,
consume it, then query. Callers in LMCache 0.5.6:

- store: storage_controllers/store_controller.py:663 (submit_store_task),
  :712 (pop_completed_store_tasks), :299 (store event fd);
- lookup-and-lock: storage_controllers/prefetch_controller.py:1049 (submit),
  :1170 (query), :507 (event fd);
- unlock: prefetch_controller.py:1143, :1264, :1443, :1624;
- load: prefetch_controller.py:1305 (submit), :1419 (query), :510 (event fd).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ENGINES, HeldStores, wait_until
from lmcache.lmcache_native import Bitmap
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.platform import consume_fd
from prometheus_client import REGISTRY

from lmcache_tiered._lmcache import object_key_to_string
from lmcache_tiered.cache import writer
from lmcache_tiered.cache.tiered_cache import TieredCache, tier_owner
from lmcache_tiered.config import GIB, ConfigError, TieredConfig
from lmcache_tiered.integration import mp as mp_module
from lmcache_tiered.integration.mp import OWNER, TieredL2Adapter, TieredL2AdapterConfig
from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.io.uring import UringEngine
from lmcache_tiered.keys import key_digest, key_from_string, key_text
from lmcache_tiered.storage.files import try_lock
from lmcache_tiered.storage.layout import TierNames
from lmcache_tiered.storage.tierfiles import TierFileSet
from lmcache_tiered.warmup import promoter as promoter_module

#: Two object groups, as vLLM's MP connector lays out hybrid models.
LAYOUT = MemoryLayoutDesc(
    [torch.Size([2, 4, 1000]), torch.Size([3, 7])], [torch.bfloat16, torch.float32]
)
CHUNK = 64 << 10  # bytes of one chunk in the direct-interface tests
SLOT = CHUNK + 4096  # bytes of its slot on disk (one 4 KiB header block)
TIMEOUT_MS = 20_000


def okey(i: int, model: str = "org/model") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name=model, kv_rank=0)


def plugin_json(params: dict[str, Any]) -> str:
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "lmcache_tiered.mp",
            "class_name": "TieredL2Adapter",
            "adapter_params": params,
        }
    )


def params(dirs: list[Path], **settings: Any) -> dict[str, Any]:
    return {"warm.paths": [str(d) for d in dirs], "warm.capacity_gb": 0.25, **settings}


# --------------------------------------------------------------- helpers


class Caller:
    """Drives an adapter as LMCache's controllers do (see the module doc)."""

    def __init__(self, adapter: TieredL2Adapter) -> None:
        self.adapter = adapter

    @staticmethod
    def _wait(fd: int) -> None:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        assert poll.poll(TIMEOUT_MS), "no completion signalled"
        consume_fd(fd)

    def store(self, keys: list[ObjectKey], objs: list[TensorMemoryObj]) -> bool:
        task = self.adapter.submit_store_task(keys, objs)
        while True:
            self._wait(self.adapter.get_store_event_fd())
            done = self.adapter.pop_completed_store_tasks()
            if task in done:
                return done[task].is_successful()

    def lookup(self, keys: list[ObjectKey]) -> list[int]:
        task = self.adapter.submit_lookup_and_lock_task(keys, {0: LAYOUT})
        return self._result(
            self.adapter.get_lookup_and_lock_event_fd(),
            lambda: self.adapter.query_lookup_and_lock_result(task),
        )

    def load(self, keys: list[ObjectKey], objs: list[TensorMemoryObj]) -> list[int]:
        task = self.adapter.submit_load_task(keys, objs)
        return self._result(
            self.adapter.get_load_event_fd(),
            lambda: self.adapter.query_load_result(task),
        )

    def _result(self, fd: int, query: Callable[[], Bitmap | None]) -> list[int]:
        while (bitmap := query()) is None:
            self._wait(fd)
        return list(bitmap.get_indices_list())


def memory_obj(nbytes: int = CHUNK, seed: int | None = None) -> TensorMemoryObj:
    """A caller-owned buffer like LMCache's L1 objects (4 KiB aligned), as
    check_mode_test_l2_adapter.py:45-74 builds them."""
    data = torch.frombuffer(aligned_buffer(nbytes), dtype=torch.uint8)
    if seed is not None:
        data.copy_(
            torch.randint(
                0,
                256,
                (nbytes,),
                dtype=torch.uint8,
                generator=torch.Generator().manual_seed(seed),
            )
        )
    meta = MemoryObjMetadata(
        shape=torch.Size([nbytes]),
        dtype=torch.uint8,
        address=data.data_ptr(),
        phy_size=nbytes,
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(data, meta, parent_allocator=None)


class Recorder:
    """An L2 listener (as LMCache's L2 eviction controller registers)."""

    def __init__(self) -> None:
        self.stored: list[ObjectKey] = []
        self.deleted: list[ObjectKey] = []
        self.accessed: list[ObjectKey] = []

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        self.stored += keys

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        self.deleted += keys

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        self.accessed += keys


@pytest.fixture
def adapter_factory(
    device_dirs: list[Path],
) -> Iterator[Callable[..., TieredL2Adapter]]:
    opened: list[TieredL2Adapter] = []

    def open_adapter(
        dirs: list[Path] | None = None, **settings: Any
    ) -> TieredL2Adapter:
        """An adapter on ``dirs`` (default: the device directories)."""
        settings.setdefault("slot_mb", CHUNK / 2**20)
        adapter = TieredL2Adapter(params(dirs or device_dirs, **settings))
        opened.append(adapter)
        return adapter

    yield open_adapter
    for adapter in opened:
        adapter.close()


# ------------------------------------------------------------------ keys


def test_object_key_text_is_lmcache_raw_block_encoding() -> None:
    """The tiers name an ObjectKey as LMCache's raw-block adapter does, and
    read it back; CacheEngineKeys keep their own form."""
    keys = [
        okey(7),
        ObjectKey(b"\x00\xff" * 8, "meta-llama/Llama 3", 5, 3, "user-1"),
    ]
    for key in keys:
        assert key_text(key) == object_key_to_string(key)
        assert key_from_string(key_text(key)) == key
    legacy = CacheEngineKey("model", 4, 1, 0xABC, torch.bfloat16, None)
    assert key_from_string(key_text(legacy)) == legacy
    assert key_digest(legacy) != key_digest(okey(0xABC, "model"))


# ---------------------------------------------------------------- config


def test_adapter_params_are_the_yaml_settings_without_prefix(
    device_dirs: list[Path],
) -> None:
    """The server's --l2-adapter JSON builds our config class (found by name)
    and the adapter, with the same settings as the YAML keys."""
    settings = {"warm.capacity_gb": 10, "io_engine": "threads", "stripe_kb": 256}
    parsed = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[plugin_json(params(device_dirs, **settings))])
    )
    adapter = create_l2_adapter(parsed.adapters[0])
    try:
        assert isinstance(adapter, TieredL2Adapter)
        yaml = {f"tiered.{k}": v for k, v in params(device_dirs, **settings).items()}
        assert adapter.settings == TieredConfig.from_extra_config(yaml)
        assert adapter.get_usage().total_capacity_bytes == 10 * GIB
    finally:
        adapter.close()
    # names copied from the YAML, prefix and all, mean the same
    copied = TieredL2AdapterConfig.from_dict(yaml)
    assert copied.settings == adapter.settings


def test_bad_setting_stops_the_adapter_with_a_clear_error(
    device_dirs: list[Path],
) -> None:
    parsed = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[plugin_json(params(device_dirs, queue_depht=8))])
    )
    with pytest.raises(
        ConfigError, match="setting queue_depht. Did you mean queue_depth"
    ):
        create_l2_adapter(parsed.adapters[0])


# ------------------------------------------------- LMCache's storage manager


def storage_manager(dirs: list[Path], **settings: Any) -> StorageManager:
    """LMCache's MP storage manager with our adapter, built like the server's."""
    l2 = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[plugin_json(params(dirs, **settings))])
    )
    memory = L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False)
    return StorageManager(
        StorageManagerConfig(
            l1_manager_config=L1ManagerConfig(memory_config=memory),
            eviction_config=EvictionConfig("LRU"),
            l2_adapter_config=l2,
        )
    )


def adapter_of(manager: StorageManager) -> TieredL2Adapter:
    ((_, adapter),) = manager.l2_adapters()
    assert isinstance(adapter, TieredL2Adapter)
    return adapter


def prefetch(manager: StorageManager, keys: list[ObjectKey]) -> dict[ObjectKey, bytes]:
    """What the server does for a lookup, then a retrieve
    (multiprocess/modules/lookup.py:302, server_transfer.py:295-316)."""
    handle = manager.submit_prefetch_task(
        PrefetchTaskSpec([GroupedObjectKeys(keys, 0, LAYOUT)])
    )
    assert manager.wait_prefetch_status(handle, TIMEOUT_MS / 1000)
    result = manager.query_prefetch_status(handle)
    assert result is not None and result.l2_hit_count == len(keys)
    with manager.read_prefetched_results(keys, result.l1_owners) as objs:
        assert objs is not None
        data = {k: bytes(o.byte_array) for k, o in zip(keys, objs, strict=True)}
    manager.finish_read_prefetched(keys, l1_owners=result.l1_owners)
    return data


def write_through_l1(
    manager: StorageManager, keys: list[ObjectKey]
) -> dict[ObjectKey, bytes]:
    """Write ``keys`` into L1 (random bytes), wait until the store controller
    has put them in our adapter, then drop them from L1; their bytes."""
    adapter = adapter_of(manager)
    objs = manager.reserve_write(keys, LAYOUT)
    gen = torch.Generator().manual_seed(1)
    for obj in objs.values():
        obj.raw_data[: obj.get_size()].copy_(
            torch.randint(0, 256, (obj.get_size(),), dtype=torch.uint8, generator=gen)
        )
    want = {k: bytes(o.byte_array) for k, o in objs.items()}
    manager.finish_write(keys)
    # the store controller releases its L1 read locks once we report
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    deleted = 0
    while deleted < len(keys):
        assert time.monotonic() < deadline, "store never reached the adapter"
        time.sleep(0.02)
        if adapter.tiers and len(adapter.tiers[0]) == len(keys):
            deleted += manager.delete_l1_keys(keys)[0]
    return want


@pytest.mark.parametrize("io_engine", ENGINES)
def test_storage_manager_round_trip_and_restart(
    device_dirs: list[Path], io_engine: str
) -> None:
    """L1 write -> store controller -> adapter; L1 dropped; prefetch loads
    the bytes back from NVMe; a new server over the same paths serves them."""
    keys = [okey(i) for i in range(6)]
    manager = storage_manager(device_dirs, io_engine=io_engine)
    try:
        adapter = adapter_of(manager)
        assert adapter.tiers == []  # slot size unknown until the first store
        want = write_through_l1(manager, keys)
        assert adapter.tiers[0].engine.name == io_engine
        assert prefetch(manager, keys) == want
    finally:
        manager.close()
    manager = storage_manager(device_dirs, io_engine=io_engine)  # no slot_mb
    try:
        assert len(adapter_of(manager).tiers[0]) == len(keys)
        assert prefetch(manager, keys) == want
    finally:
        manager.close()


@pytest.mark.skipif(
    not hasattr(StorageManager, "touch_cached_keys"),
    reason="lmcache 0.5.6 has no memory tags and sends no touches",
)
def test_storage_manager_filters_by_our_tags_and_touches_us(
    device_dirs: list[Path], cold_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lmcache 0.5.7: a prefetch that admits only local L2 media skips us once
    a cold tier is set; one that admits remote loads from us; the server's
    touch of L1-held keys reaches our tiers as a lookup without pins."""
    from lmcache.v1.distributed.api import (
        MemoryResidency,
        MemorySegment,
        MemoryTags,
    )

    keys = [okey(i) for i in range(3)]
    manager = storage_manager(device_dirs, **{"cold.paths": [str(cold_dir)]})
    try:
        want = write_through_l1(manager, keys)

        def hits(residency: MemoryResidency) -> int:
            allowed = frozenset({MemoryTags(MemorySegment.STORAGE, residency)})
            handle = manager.submit_prefetch_task(
                PrefetchTaskSpec(
                    [GroupedObjectKeys(keys, 0, LAYOUT)],
                    allowed_l2_memory_tags=allowed,
                )
            )
            assert manager.wait_prefetch_status(handle, TIMEOUT_MS / 1000)
            result = manager.query_prefetch_status(handle)
            assert result is not None
            if result.l2_hit_count:
                manager.finish_read_prefetched(keys, l1_owners=result.l1_owners)
            return int(result.l2_hit_count)

        assert hits(MemoryResidency.LOCAL) == 0
        assert hits(MemoryResidency.REMOTE) == len(keys)
        cache = adapter_cache(adapter_of(manager))
        seen: list[tuple[list[ObjectKey], bool]] = []
        lookup = cache.lookup

        def spy(row: list[ObjectKey], pin: bool = False, **kw: Any) -> list[bool]:
            seen.append((list(row), pin))
            return lookup(row, pin, **kw)

        monkeypatch.setattr(cache, "lookup", spy)
        manager.touch_cached_keys(keys)
        wait_until(lambda: (keys, False) in seen)
        assert prefetch(manager, keys) == want
    finally:
        manager.close()


# ------------------------------------------------------ direct interface


def test_lookup_lock_load_and_unlock(
    adapter_factory: Callable[..., TieredL2Adapter],
) -> None:
    adapter = adapter_factory()
    recorder = Recorder()
    adapter.register_listener(recorder)
    caller = Caller(adapter)
    keys = [okey(i) for i in range(4)]
    src = [memory_obj(seed=i) for i in range(4)]
    assert caller.lookup(keys) == []
    adapter.submit_unlock(keys)  # LMCache's check unlocks misses too
    assert caller.store(keys, src)
    assert caller.lookup(keys + [okey(99)]) == [0, 1, 2, 3]
    dst = [memory_obj() for _ in keys]
    assert caller.load(keys, dst) == [0, 1, 2, 3]
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(src, dst, strict=True))
    assert recorder.stored == keys and recorder.accessed == keys
    slot = adapter.tiers[0].geometry.slot_disk_bytes
    assert adapter.get_usage().bytes_by_cache_salt == {"": 4 * slot}
    adapter.submit_unlock(keys)
    assert caller.lookup([]) == []  # unlocks ran before this lookup
    warm = adapter.tiers[0]
    assert not any(warm.unpin(k) for k in keys)  # every lock was released
    # a buffer of another size is a miss; the record stays
    assert caller.load([keys[0]], [memory_obj(CHUNK // 2)]) == []
    assert caller.lookup([keys[0]]) == [0]


def test_list_l2_keys_pages_through_what_is_stored(
    adapter_factory: Callable[..., TieredL2Adapter],
) -> None:
    """The server's key-listing API (cache_control/object_service.py:122)."""
    adapter = adapter_factory()
    caller = Caller(adapter)
    keys = [okey(i) for i in range(5)] + [okey(i, model="org/other") for i in range(2)]
    assert caller.store(keys, [memory_obj(seed=i) for i in range(len(keys))])
    listed, cursor, pages = [], None, 0
    while True:
        page = adapter.list_l2_keys("org/model", page_size=2, cursor=cursor)
        listed += [entry.key for entry in page.entries]
        assert all(entry.size_bytes == CHUNK for entry in page.entries)
        pages += 1
        cursor = page.next_page_token
        if cursor is None:
            break
    assert pages == 3
    assert sorted(map(str, listed)) == sorted(
        str(k.to_encoded_object_key()) for k in keys[:5]
    )
    assert len(adapter.list_l2_keys().entries) == 7
    with pytest.raises(ValueError, match="cursor"):
        adapter.list_l2_keys(cursor="not hex")
    with pytest.raises(ValueError, match="page_size"):
        adapter.list_l2_keys(page_size=0)


def test_locked_chunks_survive_eviction_until_unlocked(
    adapter_factory: Callable[..., TieredL2Adapter],
) -> None:
    """The tier's LRU evicts on its own when full, never a locked chunk;
    LMCache's listeners hear of every eviction."""
    probe = adapter_factory()
    slot = probe.tiers[0].geometry.slot_disk_bytes
    probe.close()
    adapter = adapter_factory(**{"warm.capacity_gb": 4 * slot / GIB})
    recorder = Recorder()
    adapter.register_listener(recorder)
    caller = Caller(adapter)
    first = [okey(i) for i in range(4)]
    assert caller.store(first, [memory_obj(seed=i) for i in range(4)])
    assert caller.lookup(first[:2]) == [0, 1]  # locks 0 and 1
    assert caller.store([okey(10), okey(11)], [memory_obj(), memory_obj()])
    assert caller.lookup(first) == [0, 1]  # 2 and 3 were evicted; 0, 1 locked twice
    adapter.submit_unlock(first[:2])
    adapter.submit_unlock(first[:2])
    # unlocks run on the lookup thread, stores on their own: wait for them
    assert caller.lookup([]) == []
    later = [okey(i) for i in range(12, 16)]
    assert caller.store(later, [memory_obj() for _ in later])
    assert caller.lookup(first) == []
    assert set(first) | {okey(10), okey(11)} == set(recorder.deleted)
    assert adapter.get_usage().total_bytes_used == 4 * slot


def test_store_of_a_full_tier_of_locked_chunks_fails(
    adapter_factory: Callable[..., TieredL2Adapter],
) -> None:
    probe = adapter_factory()
    slot = probe.tiers[0].geometry.slot_disk_bytes
    probe.close()
    adapter = adapter_factory(**{"warm.capacity_gb": 2 * slot / GIB})
    caller = Caller(adapter)
    assert caller.store([okey(0), okey(1)], [memory_obj(), memory_obj()])
    assert caller.lookup([okey(0), okey(1)]) == [0, 1]
    assert not caller.store([okey(2)], [memory_obj()])
    assert caller.store([okey(0)], [memory_obj()])  # already stored: success


def test_corrupted_record_is_a_miss(
    adapter_factory: Callable[..., TieredL2Adapter],
) -> None:
    adapter = adapter_factory()
    recorder = Recorder()
    adapter.register_listener(recorder)
    caller = Caller(adapter)
    keys = [okey(i) for i in range(3)]
    src = [memory_obj(seed=i) for i in range(3)]
    assert caller.store(keys, src)
    warm = adapter.tiers[0]
    entry = warm.index.get(keys[1])
    assert entry is not None
    slot = entry.slot
    extent = warm.geometry.extents(slot, CHUNK)[0]
    fd = os.open(os.path.join(warm.paths[extent.device], f"{OWNER}.slab"), os.O_RDWR)
    try:
        byte = os.pread(fd, 1, extent.offset + 100)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), extent.offset + 100)
        os.fsync(fd)
    finally:
        os.close(fd)
    dst = [memory_obj() for _ in keys]
    assert caller.load(keys, dst) == [0, 2]
    assert torch.equal(dst[2].tensor, src[2].tensor)
    assert caller.lookup(keys) == [0, 2]  # dropped from the index
    assert recorder.deleted == [keys[1]]
    assert warm.stats.corrupt == 1


def test_two_controller_threads_at_once(
    adapter_factory: Callable[..., TieredL2Adapter],
) -> None:
    """A store thread and a lookup/load thread, as LMCache runs its store and
    prefetch controllers, share the adapter."""
    adapter = adapter_factory()
    caller = Caller(adapter)
    ready = [okey(1000 + i) for i in range(8)]
    ready_src = [memory_obj(seed=1000 + i) for i in range(8)]
    assert caller.store(ready, ready_src)
    errors: list[BaseException] = []

    def storer() -> None:
        try:
            for r in range(6):
                keys = [okey(r * 4 + i) for i in range(4)]
                assert caller.store(keys, [memory_obj(seed=r) for _ in keys])
        except BaseException as exc:
            errors.append(exc)

    def prefetcher() -> None:
        try:
            for _ in range(6):
                assert caller.lookup(ready) == list(range(8))
                dst = [memory_obj() for _ in ready]
                assert caller.load(ready, dst) == list(range(8))
                adapter.submit_unlock(ready)
                for a, b in zip(ready_src, dst, strict=True):
                    assert torch.equal(a.tensor, b.tensor)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=storer), threading.Thread(target=prefetcher)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert caller.lookup([okey(i) for i in range(24)]) == list(range(24))


def test_queued_stores_are_written_and_reported_a_bounded_batch_at_a_time(
    adapter_factory: Callable[..., TieredL2Adapter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LMCache keeps a store task's L1 objects locked until it is reported: a
    backlog of stores goes out in batches of at most WRITE_BATCH_BYTES, each
    reported once written, not as one batch reported at its end."""
    monkeypatch.setattr(writer, "WRITE_BATCH_BYTES", 2 * CHUNK)
    adapter = adapter_factory()
    caller = Caller(adapter)
    assert caller.store([okey(0)], [memory_obj()])  # opens the tiers
    cache = adapter_cache(adapter)
    held = HeldStores(cache.store)
    monkeypatch.setattr(cache, "store", held)
    first = adapter.submit_store_task([okey(1)], [memory_obj()])
    assert held.entered.wait(TIMEOUT_MS / 1000)
    backlog = [
        adapter.submit_store_task([okey(10 + i)], [memory_obj(seed=i)])
        for i in range(7)
    ]
    held.released.set()
    done: dict[int, Any] = {}
    while len(done) < 8:
        Caller._wait(adapter.get_store_event_fd())
        done.update(adapter.pop_completed_store_tasks())
    assert all(done[task].is_successful() for task in [first, *backlog])
    assert held.batches == [1, 2, 2, 2, 1]


# --------------------------------------------------- warm, cold, warm-up


def slots(count: int) -> float:
    """``warm.capacity_gb`` (or ``cold.``) of a tier of ``count`` chunk slots."""
    return count * SLOT / GIB


def adapter_cache(adapter: TieredL2Adapter) -> TieredCache:
    assert adapter.cache is not None
    return adapter.cache


def test_write_back_demotes_warm_victims_to_cold_without_deleting_them(
    adapter_factory: Callable[..., TieredL2Adapter], cold_dir: Path
) -> None:
    """A warm tier of two slots: each store demotes warm's victims to cold,
    where they load byte-identical; LMCache never hears them deleted, and
    counts each chunk once."""
    adapter = adapter_factory(
        **{
            "warm.capacity_gb": slots(2),
            "cold.paths": [str(cold_dir)],
            "cold.capacity_gb": slots(16),
        }
    )
    assert adapter.tiers[0].geometry.slot_disk_bytes == SLOT
    recorder = Recorder()
    adapter.register_listener(recorder)
    caller = Caller(adapter)
    keys = [okey(i) for i in range(6)]
    src = [memory_obj(seed=i) for i in range(6)]
    for i in range(0, 6, 2):
        assert caller.store(keys[i : i + 2], src[i : i + 2])
    cache = adapter_cache(adapter)
    assert [cache.tier_of(k) for k in keys] == ["cold"] * 4 + ["warm"] * 2
    assert cache.warm.stats.evictions == 4
    assert caller.lookup(keys) == list(range(6))
    dst = [memory_obj() for _ in keys]
    assert caller.load(keys, dst) == list(range(6))
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(src, dst, strict=True))
    adapter.submit_unlock(keys)
    cache.flush()  # the cold hits' copies to warm
    assert recorder.deleted == []
    assert sorted(recorder.stored, key=key_text) == sorted(keys, key=key_text)
    assert recorder.accessed == keys
    assert adapter.get_usage().total_bytes_used == 6 * SLOT


def test_a_chunk_that_leaves_its_last_tier_is_deleted(
    adapter_factory: Callable[..., TieredL2Adapter], cold_dir: Path
) -> None:
    """Warm and cold of two slots each: the third store's demotion makes cold
    evict the first two chunks, now in neither tier: those are deleted for
    LMCache, and so is a chunk ``delete`` removes."""
    adapter = adapter_factory(
        **{
            "warm.capacity_gb": slots(2),
            "cold.paths": [str(cold_dir)],
            "cold.capacity_gb": slots(2),
        }
    )
    recorder = Recorder()
    adapter.register_listener(recorder)
    caller = Caller(adapter)
    keys = [okey(i) for i in range(6)]
    for i in range(0, 6, 2):
        assert caller.store(keys[i : i + 2], [memory_obj(seed=i), memory_obj()])
    cache = adapter_cache(adapter)
    assert [cache.tier_of(k) for k in keys] == [None] * 2 + ["cold"] * 2 + ["warm"] * 2
    assert sorted(recorder.deleted, key=key_text) == keys[:2]
    assert adapter.get_usage().total_bytes_used == 4 * SLOT
    adapter.delete([keys[2], keys[4], okey(99)])
    assert sorted(recorder.deleted, key=key_text) == keys[:3] + [keys[4]]
    assert caller.lookup(keys) == [3, 5]
    assert adapter.get_usage().total_bytes_used == 2 * SLOT


def test_write_through_puts_every_chunk_in_both_tiers(
    adapter_factory: Callable[..., TieredL2Adapter], cold_dir: Path
) -> None:
    settings = {
        "cold.paths": [str(cold_dir)],
        "cold.write": "through",
        "cold.capacity_gb": 1,
    }
    adapter = adapter_factory(**settings)
    recorder = Recorder()
    adapter.register_listener(recorder)
    keys = [okey(i) for i in range(3)]
    assert Caller(adapter).store(keys, [memory_obj(seed=i) for i in range(3)])
    warm, cold = adapter.tiers
    assert cold.name == "cold" and list(cold.paths) == [str(cold_dir)]
    for key in keys:
        assert warm.header(key) is not None and cold.header(key) is not None
    # in both tiers, but one chunk each for LMCache, after a restart too
    assert recorder.stored == keys
    assert adapter.get_usage().total_bytes_used == 3 * SLOT
    assert adapter.get_usage().total_capacity_bytes == GIB  # warm only copies
    adapter.close()
    again = adapter_factory(**settings)
    recovered = Recorder()
    again.register_listener(recovered)
    assert sorted(recovered.stored, key=key_text) == keys
    assert again.get_usage().total_bytes_used == 3 * SLOT


def test_cold_hit_is_copied_to_warm_before_the_callers_buffer_is_reused(
    adapter_factory: Callable[..., TieredL2Adapter], cold_dir: Path
) -> None:
    """The copy of a cold hit to warm is written after the load reported
    (the writer is held back here) and LMCache has reused the buffer: warm
    must still get the right bytes."""
    adapter = adapter_factory(
        **{"warm.capacity_gb": slots(2), "cold.paths": [str(cold_dir)]}
    )
    recorder = Recorder()
    adapter.register_listener(recorder)
    caller = Caller(adapter)
    keys = [okey(i) for i in range(4)]
    src = [memory_obj(seed=i) for i in range(4)]
    assert caller.store(keys[:2], src[:2])
    assert caller.store(keys[2:], src[2:])
    cache = adapter_cache(adapter)
    assert [cache.tier_of(k) for k in keys] == ["cold"] * 2 + ["warm"] * 2
    dst = [memory_obj() for _ in range(2)]
    with cache.stores_held():  # no write, the copies' included, until released
        assert caller.load(keys[:2], dst) == [0, 1]
        for obj, want in zip(dst, src, strict=False):
            assert torch.equal(obj.tensor, want.tensor)
        for obj in dst:
            obj.tensor.fill_(0xAB)  # LMCache's L1 reuses the buffers
    cache.flush()
    assert [cache.tier_of(k) for k in keys] == ["warm"] * 2 + ["cold"] * 2
    copies = cache.warm.read_payloads(keys[:2])
    for payload, obj in zip(copies, src[:2], strict=True):
        assert payload is not None
        assert bytes(payload.view) == obj.tensor.numpy().tobytes()
    assert cache.tiers["cold"].stats.hits == 2
    assert recorder.deleted == []


def test_two_servers_sharing_a_cold_tier(
    adapter_factory: Callable[..., TieredL2Adapter], tmp_path: Path, cold_dir: Path
) -> None:
    """Two servers (own warm directories, own host ids) on one cold
    directory: B finds, pins and loads what A wrote through to cold, then
    holds its own copy in warm, which its listeners count as stored."""
    adapters = []
    for host in ("host-a", "host-b"):
        warm = tmp_path / f"warm-{host}"
        warm.mkdir()
        adapters.append(
            adapter_factory(
                [warm],
                **{
                    "cold.paths": [str(cold_dir)],
                    "cold.write": "through",
                    "host_id": host,
                },
            )
        )
    a, b = adapters
    keys = [okey(i) for i in range(3)]
    src = [memory_obj(seed=i) for i in range(3)]
    assert Caller(a).store(keys, src)
    assert sorted(os.listdir(cold_dir)) == [
        f"kv-mp-{h}.{ext}"
        for h in ("host-a", "host-b")
        for ext in ("changes", "hdr", "lock", "slab")
    ]
    recorder = Recorder()
    b.register_listener(recorder)
    caller = Caller(b)
    assert caller.lookup(keys) == []  # not seen yet
    adapter_cache(b).shared.refresh()  # what its background thread does every 2 s
    assert caller.lookup(keys) == [0, 1, 2]
    dst = [memory_obj() for _ in keys]
    assert caller.load(keys, dst) == [0, 1, 2]
    assert all(torch.equal(x.tensor, y.tensor) for x, y in zip(src, dst, strict=True))
    cache_b = adapter_cache(b)
    cache_b.flush()  # the copies to B's warm tier (write-through: and cold)
    assert all(cache_b.warm.header(k) is not None for k in keys)
    assert recorder.stored == keys and recorder.accessed == keys
    assert b.get_usage().total_bytes_used == 3 * SLOT
    b.submit_unlock(keys)


def store_two_chains(
    adapter: TieredL2Adapter, length: int = 4
) -> tuple[list[ObjectKey], list[ObjectKey]]:
    """Chain A, then chain B, of ``length`` chunks each, through a warm tier
    of as many slots: A is demoted to cold, B is in warm."""
    caller = Caller(adapter)
    first = [okey(i) for i in range(length)]
    second = [okey(i) for i in range(10, 10 + length)]
    assert caller.store(first, [memory_obj(seed=i) for i in range(length)])
    assert caller.store(second, [memory_obj() for _ in second])
    cache = adapter_cache(adapter)
    tiers = [cache.tier_of(k) for k in first + second]
    assert tiers == ["cold"] * length + ["warm"] * length
    return first, second


def test_lookahead_promotes_a_looked_up_chain_from_cold_to_warm(
    adapter_factory: Callable[..., TieredL2Adapter], cold_dir: Path
) -> None:
    """A lookup of chain A's head (in cold) makes lookahead (asked to promote
    what it finds) plan the head for "hot", which the adapter has not (so:
    warm), and A's continuation, learned when A was stored, for warm; the
    promoter copies them from cold, demoting chain B to make room. Nothing
    leaves L2."""
    adapter = adapter_factory(
        **{
            "warm.capacity_gb": slots(4),
            "cold.paths": [str(cold_dir)],
            "warmup.policy": "lookahead",
            "warmup.lookahead.promote_found": True,
        }
    )
    recorder = Recorder()
    adapter.register_listener(recorder)
    first, second = store_two_chains(adapter)
    cache = adapter_cache(adapter)
    assert Caller(adapter).lookup(first[:1]) == [0]
    stats = cache.promoter.stats
    # The promoter counts bytes after the store made them visible: wait on both.
    wait_until(
        lambda: (
            stats.bytes_promoted_warm >= 4 * CHUNK
            and all(cache.tier_of(k) == "warm" for k in first)
        )
    )
    assert [cache.tier_of(k) for k in second] == ["cold"] * 4
    assert stats.plans == 2 and stats.keys_planned == 4
    assert stats.bytes_promoted_warm == 4 * CHUNK and stats.bytes_promoted_hot == 0
    assert adapter.report_status()["warmup"]["bytes_promoted_warm"] == 4 * CHUNK
    # the same on the server's Prometheus port (the process's registry)
    exported = {"instance": adapter._metrics_label, "policy": "lookahead"}
    assert exported["instance"].startswith(OWNER)
    promoted = "lmcache_tiered_warmup_bytes_promoted_warm_total"
    assert REGISTRY.get_sample_value(promoted, exported) == 4 * CHUNK
    dst = [memory_obj() for _ in first]
    assert Caller(adapter).load(first, dst) == [0, 1, 2, 3]
    for i, obj in enumerate(dst):
        assert torch.equal(obj.tensor, memory_obj(seed=i).tensor)
    assert recorder.deleted == []
    adapter.submit_unlock(first[:1])
    adapter.close()
    assert REGISTRY.get_sample_value(promoted, exported) is None


def test_copies_to_warm_not_yet_read_hold_at_most_half_the_warm_tier(
    adapter_factory: Callable[..., TieredL2Adapter],
    cold_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan bigger than half the warm tier copies until the copies not yet
    read hold half of it (one unit of work past), then waits; a load of the
    copies (used, counted) makes room and the rest follows. Units of two
    chunks here, so the bound shows on a tier of eight."""
    monkeypatch.setattr(promoter_module, "UNIT_KEYS", 2)
    adapter = adapter_factory(
        **{
            "warm.capacity_gb": slots(8),
            "cold.paths": [str(cold_dir)],
            "warmup.policy": "lookahead",
            "warmup.lookahead.window_s": 60,
            "warmup.lookahead.promote_found": True,
        }
    )
    caller = Caller(adapter)
    chain, _ = store_two_chains(adapter, 8)
    cache = adapter_cache(adapter)
    stats = cache.promoter.stats
    assert caller.lookup(chain[:1]) == [0]
    # 1 + 2 + 2 chunks copied: 3 held were under the budget (about 4), 5 are not
    wait_until(lambda: cache.promoter.copies.held_bytes == 5 * CHUNK)
    time.sleep(0.5)
    assert stats.bytes_promoted_warm == 5 * CHUNK
    assert [cache.tier_of(k) for k in chain[5:]] == ["cold"] * 3
    dst = [memory_obj() for _ in chain[:5]]
    assert caller.load(chain[:5], dst) == [0, 1, 2, 3, 4]
    assert stats.warm_used == 5 and stats.bytes_used_warm == 5 * CHUNK
    wait_until(lambda: all(cache.tier_of(k) == "warm" for k in chain))
    assert stats.bytes_promoted_warm == 8 * CHUNK and stats.warm_wasted == 0
    assert adapter.report_status()["warmup"]["warm_used"] == 5
    adapter.submit_unlock(chain[:1])


def test_a_store_of_several_requests_chunks_is_their_chains_apart(
    adapter_factory: Callable[..., TieredL2Adapter],
) -> None:
    """LMCache's server stores the new chunks of several requests in one
    task, in one row. Their lookups named each request's chain: the policy
    sees two stores, and the next turn of the first extends its own chain,
    not one that ends in the other request's chunks."""
    adapter = adapter_factory(**{"warmup.policy": "session"})
    caller = Caller(adapter)
    first = [okey(i) for i in range(3)]
    second = [okey(i) for i in range(10, 12)]
    assert caller.lookup(first) == [] and caller.lookup(second) == []
    both = first + second
    assert caller.store(both, [memory_obj() for _ in both])
    cache = adapter_cache(adapter)
    assert cache.chains.continuation(first[-1], 4) == []
    assert cache.chains.continuation(first[0], 4) == first[1:]
    policy = cache.policy
    assert policy.tracked_sessions == 2  # type: ignore[attr-defined]
    # the next turn: a lookup that ends the first session (its gap is learned)
    assert caller.lookup([*first, okey(3)]) == [0, 1, 2]
    assert policy.tracked_sessions == 1  # type: ignore[attr-defined]
    adapter.submit_unlock(first)


def test_touch_keeps_chunks_recent_without_locking_them(
    adapter_factory: Callable[..., TieredL2Adapter],
) -> None:
    """A touch (0.5.7: LMCache's L1 holds these) refreshes recency in our
    tiers, so the next store evicts the untouched chunks; it locks nothing,
    and listeners hear of it at once, as from LMCache's base class."""
    adapter = adapter_factory(**{"warm.capacity_gb": slots(4)})
    recorder = Recorder()
    adapter.register_listener(recorder)
    caller = Caller(adapter)
    first = [okey(i) for i in range(4)]
    assert caller.store(first, [memory_obj(seed=i) for i in range(4)])
    adapter.submit_touch(first[:2])
    assert recorder.accessed == first[:2]
    assert caller.lookup([]) == []  # the touch ran before this lookup
    assert caller.store([okey(10), okey(11)], [memory_obj(), memory_obj()])
    cache = adapter_cache(adapter)
    assert [cache.tier_of(k) for k in first] == ["warm", "warm", None, None]
    assert not any(cache.unpin(k) for k in first[:2])  # nothing was locked


def test_touch_never_waits_for_the_lookup_thread(
    adapter_factory: Callable[..., TieredL2Adapter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LMCache calls submit_touch on its lookup path: it only queues, even
    while a lookup holds the adapter's lookup thread."""
    adapter = adapter_factory()
    caller = Caller(adapter)
    assert caller.store([okey(0)], [memory_obj()])
    cache = adapter_cache(adapter)
    release, entered = threading.Event(), threading.Event()
    lookup = cache.lookup

    def slow_lookup(*args: Any, **kwargs: Any) -> list[bool]:
        entered.set()
        assert release.wait(TIMEOUT_MS / 1000)
        return lookup(*args, **kwargs)

    monkeypatch.setattr(cache, "lookup", slow_lookup)
    task = adapter.submit_lookup_and_lock_task([okey(0)], {0: LAYOUT})
    assert entered.wait(TIMEOUT_MS / 1000)
    start = time.monotonic()
    adapter.submit_touch([okey(0)])
    assert time.monotonic() - start < 0.5
    release.set()
    assert caller._result(
        adapter.get_lookup_and_lock_event_fd(),
        lambda: adapter.query_lookup_and_lock_result(task),
    ) == [0]
    adapter.submit_unlock([okey(0)])


def test_touch_feeds_the_warmup_policy(
    adapter_factory: Callable[..., TieredL2Adapter], cold_dir: Path
) -> None:
    """A touch of chain A's head (in cold) reaches lookahead as a lookup
    does: A is promoted to warm; nothing stays locked."""
    adapter = adapter_factory(
        **{
            "warm.capacity_gb": slots(4),
            "cold.paths": [str(cold_dir)],
            "warmup.policy": "lookahead",
            "warmup.lookahead.promote_found": True,
        }
    )
    first, _ = store_two_chains(adapter)
    cache = adapter_cache(adapter)
    adapter.submit_touch(first[:1])
    # The promoter counts bytes after the store made them visible: wait on both.
    wait_until(
        lambda: (
            cache.promoter.stats.bytes_promoted_warm >= 4 * CHUNK
            and all(cache.tier_of(k) == "warm" for k in first)
        )
    )
    assert cache.promoter.stats.bytes_promoted_warm == 4 * CHUNK
    assert not any(cache.unpin(k) for k in first)


def test_memory_tags_say_storage_local_or_remote_with_a_cold_tier(
    adapter_factory: Callable[..., TieredL2Adapter], cold_dir: Path
) -> None:
    first = adapter_factory()
    warm_only = first.get_memory_tags()
    assert (warm_only.segment, warm_only.residency) == ("storage", "local")
    first.close()  # the next one opens the same directories
    tiered = adapter_factory(**{"cold.paths": [str(cold_dir)]}).get_memory_tags()
    assert (tiered.segment, tiered.residency) == ("storage", "remote")


def test_no_warmup_policy_leaves_cold_chunks_in_cold(
    adapter_factory: Callable[..., TieredL2Adapter], cold_dir: Path
) -> None:
    adapter = adapter_factory(
        **{
            "warm.capacity_gb": slots(4),
            "cold.paths": [str(cold_dir)],
            "warmup.policy": "none",
        }
    )
    first, _ = store_two_chains(adapter)
    cache = adapter_cache(adapter)
    assert Caller(adapter).lookup(first[:1]) == [0]
    time.sleep(0.3)
    assert [cache.tier_of(k) for k in first] == ["cold"] * 4
    assert cache.promoter.stats.plans == 0
    assert cache.promoter.stats.bytes_promoted_warm == 0


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        ({"warmup.policy": "psychic"}, "warmup.policy: no warm-up policy named"),
        (
            {"warmup.policy": "lookahead", "warmup.lookahead.window_z": 1},
            "warmup.lookahead.window_z: policy 'lookahead' has no parameter",
        ),
        ({"warmup.lookahead.window_s": 0}, "warmup.lookahead.window_s: must be"),
    ],
)
def test_bad_warmup_setting_stops_the_adapter(
    device_dirs: list[Path], setting: dict[str, Any], error: str
) -> None:
    """Checked at start-up although the policy only runs once the slot size
    is known (no slot_mb here: at the first store)."""
    setting = {"warmup.policy": "lookahead", **setting}
    parsed = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[plugin_json(params(device_dirs, **setting))])
    )
    with pytest.raises(ConfigError, match="TieredL2Adapter adapter_params: ") as info:
        create_l2_adapter(parsed.adapters[0])
    assert error in str(info.value) and "tiered.warmup." not in str(info.value)


def test_event_fds_and_close(adapter_factory: Callable[..., TieredL2Adapter]) -> None:
    adapter = adapter_factory()
    fds = {
        adapter.get_store_event_fd(),
        adapter.get_lookup_and_lock_event_fd(),
        adapter.get_load_event_fd(),
    }
    assert len(fds) == 3
    task = adapter.submit_store_task([okey(1)], [memory_obj(seed=1)])
    adapter.close()  # finishes what was accepted
    assert adapter.pop_completed_store_tasks()[task].is_successful()
    assert not adapter.report_status()["is_healthy"]
    with pytest.raises(RuntimeError, match="closed"):
        adapter.submit_lookup_and_lock_task([okey(1)], {})
    adapter.submit_unlock([okey(1)])  # ignored, never raises
    adapter.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_l1_arena_is_registered_with_io_uring(device_dirs: list[Path]) -> None:
    """When LMCache declares its L1 arena stable, reads land in it through
    io_uring registered buffers."""
    arena = torch.frombuffer(aligned_buffer(1 << 20), dtype=torch.uint8)
    desc = L1MemoryDesc(arena.data_ptr(), arena.numel(), 4096, arena.numel())
    adapter = TieredL2Adapter(
        params(device_dirs, io_engine="uring", slot_mb=CHUNK / 2**20), desc
    )
    try:
        caller = Caller(adapter)
        src = memory_obj(seed=3)
        assert caller.store([okey(1)], [src])
        view = arena[:CHUNK]
        meta = MemoryObjMetadata(torch.Size([CHUNK]), torch.uint8, 0, CHUNK, 1)
        dst = TensorMemoryObj(view, meta, parent_allocator=None)
        assert caller.load([okey(1)], [dst]) == [0]
        assert torch.equal(view, src.tensor)
        engine = adapter.tiers[0].engine
        assert isinstance(engine, UringEngine)
        assert engine.stats()["fixed"] > 0  # READ_FIXED into the arena
    finally:
        adapter.close()


def test_a_second_adapter_on_the_same_directories_is_refused_at_start(
    device_dirs: list[Path],
) -> None:
    """With no slot_mb and empty directories the tiers open only at the first
    store; the directories are held from the start all the same, so a second
    server is refused when it starts (naming the directory and the holder),
    and the first keeps serving exact bytes."""
    first = TieredL2Adapter(params(device_dirs, io_engine="threads"))
    try:
        assert first.tiers == []  # not open yet: the slot size is unknown
        with pytest.raises(ConfigError) as refused:
            TieredL2Adapter(params(device_dirs, io_engine="threads"))
        message = str(refused.value)
        assert message.startswith("tiered.warm.paths: ")
        assert str(device_dirs[0]) in message
        assert f"by live process {os.getpid()}" in message
        caller = Caller(first)
        src = memory_obj(seed=5)
        assert caller.store([okey(1)], [src])  # the tiers take over the lock
        dst = memory_obj()
        assert caller.load([okey(1)], [dst]) == [0]
        assert torch.equal(dst.tensor, src.tensor)
        with pytest.raises(ConfigError, match="by live process"):
            TieredL2Adapter(params(device_dirs, io_engine="threads"))
    finally:
        first.close()
    TieredL2Adapter(params(device_dirs, io_engine="threads")).close()  # free again


def test_the_tiers_adopt_the_held_lock_with_no_gap(
    device_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directories held from the start are handed to the tiers as they
    open: the lock file is never free in between, so no second server can
    take it there (issue 51: the adapter released its locks just before its
    tiers took them again)."""
    first = TieredL2Adapter(params(device_dirs, io_engine="threads"))
    settings = first.settings
    lock = TierNames(settings.warm.paths, tier_owner("warm", OWNER, settings)).lock
    free_when_opening: list[bool] = []
    opening = TierFileSet.open

    def probe_then_open(self: TierFileSet, *args: Any) -> None:
        fd = os.open(lock, os.O_RDWR)  # another open file: another server
        try:
            free_when_opening.append(try_lock(fd))
        finally:
            os.close(fd)
        opening(self, *args)

    monkeypatch.setattr(TierFileSet, "open", probe_then_open)
    try:
        assert Caller(first).store([okey(1)], [memory_obj(seed=1)])
        assert free_when_opening == [False]
        with pytest.raises(ConfigError, match="by live process"):
            TieredL2Adapter(params(device_dirs, io_engine="threads"))
    finally:
        first.close()


def test_servers_of_two_hosts_share_a_cold_tier_from_the_start(
    tmp_path: Path, cold_dir: Path
) -> None:
    """Held early, the cold tier's lock is its host's (files named per host):
    a second host on the same cold directory is not refused."""
    adapters = []
    try:
        for host in ("host-a", "host-b"):
            warm = tmp_path / f"warm-{host}"
            warm.mkdir()
            settings = {"cold.paths": [str(cold_dir)], "host_id": host}
            adapters.append(TieredL2Adapter(params([warm], **settings)))
        assert all(a.tiers == [] for a in adapters)  # both started, not yet open
    finally:
        for adapter in adapters:
            adapter.close()


def test_close_is_bounded_when_a_store_hangs(
    adapter_factory: Callable[..., TieredL2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store stuck in I/O (a hung drive) delays the server's shutdown by
    the writer's flush time at most, with one line naming the thread,
    instead of forever (issue 51: close was not bounded)."""
    monkeypatch.setattr(writer, "EXIT_FLUSH_S", 0.2)
    monkeypatch.setattr(mp_module, "CLOSE_WAIT_S", 0.2)
    adapter = adapter_factory()
    assert adapter.cache is not None
    stuck, release = threading.Event(), threading.Event()

    def hung_store(payloads: list[Any]) -> list[bool]:
        stuck.set()
        release.wait(30)
        return [False] * len(payloads)

    monkeypatch.setattr(adapter.cache, "store", hung_store)
    adapter.submit_store_task([okey(1)], [memory_obj(seed=1)])
    assert stuck.wait(10)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        adapter.close()
    took = time.monotonic() - began
    release.set()
    assert took < 0.2 + 0.2 + 5.0  # the bounds, and the cache's own close
    assert any(
        "lmcache-tiered-l2-store still busy" in r.getMessage() for r in caplog.records
    )


def test_a_batch_stuck_in_io_is_reported_once_with_every_threads_stack(
    adapter_factory: Callable[..., TieredL2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store stuck in I/O past the stall time is logged once, with the
    stack of every thread (the stuck frame among them), so a hang in the
    server can be placed from its log; a load on another thread goes on."""
    monkeypatch.setattr(writer, "STALL_S", 0.3)
    monkeypatch.setattr(writer, "STALL_CHECK_S", 0.05)
    adapter = adapter_factory()
    cache = adapter_cache(adapter)
    stuck, release = threading.Event(), threading.Event()

    def hung_store(payloads: list[Any]) -> list[bool]:
        stuck.set()
        release.wait(30)
        return [False] * len(payloads)

    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        assert Caller(adapter).store([okey(1)], [memory_obj(seed=1)])
        monkeypatch.setattr(cache, "store", hung_store)
        adapter.submit_store_task([okey(2)], [memory_obj(seed=2)])
        assert stuck.wait(10)
        time.sleep(1.0)  # several looks of the watch past the stall time
        dst = [memory_obj()]
        assert Caller(adapter).load([okey(1)], dst) == [0]
        release.set()
    stalls = [
        r.getMessage() for r in caplog.records if "inside one batch" in r.getMessage()
    ]
    assert len(stalls) == 1, stalls
    assert stalls[0].startswith("lmcache_tiered: lmcache-tiered-l2-store has been")
    assert "in hung_store" in stalls[0] and "--- lmcache-tiered-l2-load" in stalls[0]
