"""The CPU harness drives a real LMCache engine: CPU tier, stock disk tier, async."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered import testing as h

CHUNK = 256
NUM_TOKENS = 3 * CHUNK

LMCACHE_THREADS = ("storage-manager-event-loop", "stats-logger-thread", "asyncio_")


def _lmcache_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if any(t.name.startswith(prefix) for prefix in LMCACHE_THREADS)
    ]


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    """Every test destroys its engines: no LMCache thread outlives it."""
    yield
    h.destroy_all_engines()
    assert _lmcache_threads() == []


def test_cpu_tier_roundtrip() -> None:
    config = h.build_config(chunk_size=CHUNK, max_local_cpu_size_gb=0.05)
    with h.engine_session(config) as (engine, connector):
        assert list(h.get_backends(engine)) == [h.CPU_TIER]
        tokens = h.make_tokens(NUM_TOKENS, seed=1)
        kv = h.make_kv(connector, NUM_TOKENS, seed=1)

        h.store_tokens(engine, tokens, kv)
        assert h.lookup(engine, tokens) == NUM_TOKENS

        out, hit = h.retrieve_tokens(engine, tokens)
        assert int(hit.sum()) == NUM_TOKENS
        assert torch.equal(out, kv)

        cpu = h.get_local_cpu_backend(engine)
        assert cpu is not None
        objs = [cpu.hot_cache[k] for k in h.chunk_keys(engine, tokens)]
        for obj in objs:
            assert obj.get_memory_format() == MemoryFormat.KV_2LTD
            assert obj.get_shape() == h.kv_chunk_shape(CHUNK)
            assert obj.get_size() == h.kv_chunk_bytes(CHUNK)
            assert obj.data_ptr % 4096 == 0

        # A different prefix misses.
        assert h.lookup(engine, h.make_tokens(NUM_TOKENS, seed=2)) == 0


def test_local_disk_roundtrip(tmp_path: Path) -> None:
    config = h.build_config(
        chunk_size=CHUNK,
        max_local_cpu_size_gb=0.05,
        local_disk=f"file://{tmp_path}",
        max_local_disk_size_gb=0.05,
        extra_config={"use_odirect": True},
    )
    with h.engine_session(config) as (engine, connector):
        assert list(h.get_backends(engine)) == [h.CPU_TIER, h.DISK_TIER]
        tokens = h.make_tokens(NUM_TOKENS, seed=3)
        kv = h.make_kv(connector, NUM_TOKENS, seed=3)

        h.store_tokens(engine, tokens, kv)
        h.wait_for_puts(engine, tokens)
        assert len(list(tmp_path.glob("*.pt"))) == 3

        assert h.clear_cpu_tier(engine) == 0
        assert h.lookup(engine, tokens, search_range=[h.CPU_TIER]) == 0
        assert h.lookup(engine, tokens, search_range=[h.DISK_TIER]) == NUM_TOKENS

        out, hit = h.retrieve_tokens(engine, tokens)
        assert int(hit.sum()) == NUM_TOKENS
        assert torch.equal(out, kv)


def test_async_loading_from_disk(tmp_path: Path) -> None:
    config = h.build_config(
        chunk_size=CHUNK,
        max_local_cpu_size_gb=0.05,
        local_disk=str(tmp_path),
        max_local_disk_size_gb=0.05,
        enable_async_loading=True,
    )
    with h.engine_session(config) as (engine, connector):
        tokens = h.make_tokens(NUM_TOKENS, seed=4)
        kv = h.make_kv(connector, NUM_TOKENS, seed=4)
        h.store_tokens(engine, tokens, kv)
        h.wait_for_puts(engine, tokens)
        assert h.clear_cpu_tier(engine) == 0

        assert h.async_lookup(engine, tokens, "req-1") == NUM_TOKENS
        out, hit = h.retrieve_tokens(engine, tokens, req_id="req-1")
        h.release_async_lookup(engine, "req-1")
        assert int(hit.sum()) == NUM_TOKENS
        assert torch.equal(out, kv)

        # Async hits are not written back to the CPU tier.
        assert h.lookup(engine, tokens, search_range=[h.CPU_TIER]) == 0
        # A miss answers 0 without a loading event.
        assert h.async_lookup(engine, h.make_tokens(CHUNK, seed=5), "req-2") == 0
