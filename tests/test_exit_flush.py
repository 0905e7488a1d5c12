"""Puts still queued when the interpreter exits are written (vLLM 0.32 never
shuts LMCache down, so TieredCache.close() never runs there), and a close
waits for them only so long.

Each child process queues puts and returns from its main module without
close() or flush(), with a non-daemon thread that never ends, as LMCache's
storage-manager loop thread does under vLLM: the hook must run before Python
joins that thread. The child then hangs as vLLM does; the test kills it once
it has logged, then reopens the tier in this process.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import HeldStores, new_allocator
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered.cache import writer as writer_module
from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.config import TieredConfig
from lmcache_tiered.io import base as io_base
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.tier import Tier

SHAPE = torch.Size([2, 2, 64, 128])  # 64 KiB of bf16
CHUNKS = 64

CHILD = """
import logging, sys, threading, time
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache_tiered.cache import tiered_cache as cache_module
from lmcache_tiered.cache import writer as writer_module
from lmcache_tiered.config import TieredConfig

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
path, stuck = sys.argv[1], sys.argv[2] == "stuck"
config = TieredConfig.from_extra_config(
    {"tiered.warm.paths": [path], "tiered.warmup.policy": "none"}
)
shape = torch.Size(SHAPE)
allocator = MixedMemoryAllocator(64 << 20)
cache = cache_module.TieredCache(
    config, owner="kv-w0", max_payload=shape.numel() * 2, local_workers=1, hot=None
)
if stuck:  # a writer that never finishes: the exit wait must be bounded
    writer_module.EXIT_FLUSH_S = 1.0
    cache.store = lambda payloads: time.sleep(3600)
keys = [CacheEngineKey("m", 1, 0, i, torch.bfloat16, None) for i in range(CHUNKS)]
objs = []
for i in range(len(keys)):
    obj = allocator.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
    obj.tensor.fill_(i)
    objs.append(obj)
cache.put(keys, objs)
for obj in objs:
    obj.ref_count_down()
# LMCache's loop thread: not a daemon, never ends
threading.Thread(target=threading.Event().wait, daemon=False).start()
print("queued", flush=True)
""".replace("SHAPE", repr(tuple(SHAPE))).replace("CHUNKS", str(CHUNKS))


def run_child(path: Path, mode: str, expect: str) -> str:
    """Run the child until its log shows ``expect``, then kill it (it hangs
    on its never-ending thread, as vLLM does); its log."""
    log = path.parent / f"{mode}.log"
    with log.open("wb") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), mode], stderr=err
        )
        try:
            deadline = time.monotonic() + 60
            while expect not in log.read_text() and child.poll() is None:
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.05)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
    return log.read_text()


def open_tier(path: Path) -> Tier:
    config = TieredConfig.from_extra_config({"tiered.warm.paths": [str(path)]})
    return Tier(
        config.tier_options(config.warm),
        owner="kv-w0",
        max_payload=SHAPE.numel() * 2,
        capacity_bytes=config.warm.capacity_bytes,
    )


def test_queued_puts_are_written_at_interpreter_exit(tmp_path: Path) -> None:
    path = tmp_path / "warm"
    path.mkdir()
    log = run_child(path, "normal", f"at exit, wrote {CHUNKS} queued puts")
    tier = open_tier(path)
    try:
        stored = sorted(k.chunk_hash for k in tier.stored_keys())
    finally:
        tier.close()
    assert stored == list(range(CHUNKS)), log[-2000:]


def test_exit_wait_is_bounded_and_says_what_is_lost(tmp_path: Path) -> None:
    path = tmp_path / "warm"
    path.mkdir()
    started = time.monotonic()
    log = run_child(path, "stuck", "still queued after 1 s: lost")
    assert f"at exit, {CHUNKS} puts still queued" in log
    assert time.monotonic() - started < 30


def open_cache(path: Path) -> TieredCache:
    """A warm tier on ``path`` with no warm-up, slots of one :data:`SHAPE`."""
    config = TieredConfig.from_extra_config(
        {"tiered.warm.paths": [str(path)], "tiered.warmup.policy": "none"}
    )
    return TieredCache(
        config, owner="kv-w0", max_payload=SHAPE.numel() * 2, local_workers=1, hot=None
    )


def chunks(count: int) -> tuple[list[CacheEngineKey], list[Any]]:
    """``count`` keys and LMCache objects of :data:`SHAPE` to put."""
    allocator = new_allocator(16 << 20)
    keys = [CacheEngineKey("m", 1, 0, i, torch.bfloat16, None) for i in range(count)]
    objs = [
        allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD) for _ in keys
    ]
    return keys, objs


def test_close_writes_what_it_can_in_time_and_releases_the_rest(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A close on a slow drive: the batch being written is finished, what is
    queued behind it is dropped (counted, one WARNING) and its objects are
    released before close returns, since LMCache frees their memory next."""
    monkeypatch.setattr(writer_module, "EXIT_FLUSH_S", 0.2)
    cache = open_cache(tmp_path)
    writing = threading.Event()
    store = cache.store

    def slow_store(payloads: list[Payload]) -> list[bool]:
        writing.set()
        time.sleep(1.0)
        return store(payloads)

    cache.store = slow_store  # type: ignore[method-assign]
    keys, objs = chunks(8)
    cache.put(keys[:4], objs[:4])
    assert writing.wait(10)
    cache.put(keys[4:], objs[4:])  # queued behind the slow batch
    assert [o.get_ref_count() for o in objs] == [2] * 8  # ours + the writer's
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        cache.close()
    assert [o.get_ref_count() for o in objs] == [1] * 8
    for obj in objs:
        obj.ref_count_down()
    assert cache.writer.puts_dropped == 4
    dropped = [r for r in caplog.records if "still queued" in r.getMessage()]
    assert len(dropped) == 1 and "closing, 4 puts" in dropped[0].getMessage()
    tier = open_tier(tmp_path)
    try:
        assert sorted(k.chunk_hash for k in tier.stored_keys()) == [0, 1, 2, 3]
    finally:
        tier.close()


def test_queued_puts_are_written_and_released_a_bounded_batch_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog of puts goes to the tier in batches of at most
    WRITE_BATCH_BYTES: each batch's objects are released once it is written,
    not once the whole backlog is (LMCache cannot evict them until then)."""
    chunk_bytes = SHAPE.numel() * 2
    monkeypatch.setattr(writer_module, "WRITE_BATCH_BYTES", 2 * chunk_bytes)
    cache = open_cache(tmp_path)
    held = HeldStores(cache.store)
    cache.store = held  # type: ignore[method-assign]
    keys, objs = chunks(7)
    cache.put(keys[:1], objs[:1])
    assert held.entered.wait(10)
    for key, obj in zip(keys[1:], objs[1:], strict=True):
        cache.put([key], [obj])
    held.released.set()
    assert cache.writer.flush(10)
    assert held.batches == [1, 2, 2, 2]
    assert [o.get_ref_count() for o in objs] == [1] * 7
    cache.close()
    for obj in objs:
        obj.ref_count_down()


def test_close_on_a_hung_drive_returns_within_its_bound(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A drive that never completes a write (a stand-in store: a hung
    O_DIRECT write cannot be made here) held close() forever after the flush
    timed out; it now returns within EXIT_FLUSH_S + CLOSE_WAIT_S, with one
    WARNING, and the objects of the stuck batch are released if it returns."""
    monkeypatch.setattr(writer_module, "EXIT_FLUSH_S", 0.2)
    monkeypatch.setattr(io_base, "CLOSE_WAIT_S", 0.3, raising=False)
    cache = open_cache(tmp_path)
    writing, hung = threading.Event(), threading.Event()
    store = cache.store

    def hung_store(payloads: list[Payload]) -> list[bool]:
        writing.set()
        hung.wait(30)
        return store(payloads)

    cache.store = hung_store  # type: ignore[method-assign]
    keys, objs = chunks(2)
    cache.put(keys, objs)
    assert writing.wait(10)
    started = time.monotonic()
    closer = threading.Thread(target=cache.writer.close, daemon=True)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        closer.start()
        closer.join(10)
    try:
        assert not closer.is_alive(), "close() waits for a hung drive"
        assert time.monotonic() - started < 2
        assert any("hung drive" in r.getMessage() for r in caplog.records)
    finally:
        hung.set()
        cache.close()
    deadline = time.monotonic() + 10
    while any(o.get_ref_count() != 1 for o in objs):
        assert time.monotonic() < deadline, "the stuck batch kept its objects"
        time.sleep(0.01)
    for obj in objs:
        obj.ref_count_down()
