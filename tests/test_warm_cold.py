"""Hot / warm / cold with a real LMCache engine: fall-through, promotion,
demotion, warm-up policies, demand-first ordering and metrics."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    cache_of,
    payload_offset,
    plugin_extra_config,
    store_chunks,
    wait_until,
)
from prometheus_client import generate_latest

from lmcache_tiered import testing
from lmcache_tiered.integration.backend import TieredBackend
from lmcache_tiered.metrics import collector
from lmcache_tiered.warmup import promoter as promoter_module
from lmcache_tiered.warmup.base import Plan
from lmcache_tiered.warmup.promoter import GUARD_MIN, GUARD_PROBE_EVERY, UNIT_KEYS

EngineFactory = Callable[..., Any]
CHUNK = 256
CHUNK_BYTES = 256 * 1024  # the harness's tiny model: 2 layers, 2 heads of 64
#: capacity (GiB) of a warm tier that holds exactly two chunks
TWO_CHUNKS_GB = 2 * (CHUNK_BYTES + 4096) / 2**30


def tiered_engine(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    *,
    cpu_gb: float | None = None,
    **settings: Any,
) -> tuple[Any, Any, Any]:
    """An engine with the plugin (``tiered.<settings>``) over ``device_dirs``
    and, if given, a CPU tier of ``cpu_gb``; its connector and cache."""
    config = {} if cpu_gb is None else {"max_local_cpu_size_gb": cpu_gb}
    extra = plugin_extra_config(device_dirs, **settings)
    engine, connector = engine_factory(extra, chunk_size=CHUNK, **config)
    return engine, connector, cache_of(engine)


def two_chunks_warm_over_cold(
    engine_factory: EngineFactory, device_dirs: list[Path], cold_dir: Path
) -> tuple[Any, Any, Any]:
    """An engine, its connector and cache: a warm tier of two chunks over cold."""
    return tiered_engine(
        engine_factory,
        device_dirs,
        **{
            "warm.capacity_gb": TWO_CHUNKS_GB,
            "cold.paths": [str(cold_dir)],
            "cold.capacity_gb": 0.1,
        },
    )


def test_warm_evictions_demote_to_cold_and_cold_hits_return_to_warm(
    engine_factory: EngineFactory, device_dirs: list[Path], cold_dir: Path
) -> None:
    engine, connector, cache = two_chunks_warm_over_cold(
        engine_factory, device_dirs, cold_dir
    )
    first, first_kv = store_chunks(engine, connector, 2, seed=1)
    second, _ = store_chunks(engine, connector, 2, seed=11)
    first_keys = testing.chunk_keys(engine, first)
    second_keys = testing.chunk_keys(engine, second)
    # warm holds two chunks: the second request's demoted the first's to cold
    assert [cache.tier_of(k) for k in first_keys + second_keys] == [
        "cold",
        "cold",
        "warm",
        "warm",
    ]
    assert cache.warm.stats.evictions == 2
    testing.clear_cpu_tier(engine)
    out, mask = testing.retrieve_tokens(engine, first, connector=connector)
    assert int(mask.sum()) == 2 * CHUNK and torch.equal(out, first_kv)
    assert cache.tiers["cold"].stats.hits == 2
    cache.flush()  # the cold hits were queued for a copy to warm
    assert [cache.tier_of(k) for k in first_keys] == ["warm", "warm"]
    # ... which demoted the second request's chunks: nothing was lost
    assert [cache.tier_of(k) for k in second_keys] == ["cold", "cold"]
    # a request bigger than warm: what warm cannot take goes straight to cold
    third, _ = store_chunks(engine, connector, 3, seed=21)
    assert all(cache.tier_of(k) for k in testing.chunk_keys(engine, third))


def test_write_through_puts_every_chunk_in_both(
    engine_factory: EngineFactory, device_dirs: list[Path], cold_dir: Path
) -> None:
    engine, connector, cache = tiered_engine(
        engine_factory,
        device_dirs,
        **{"cold.paths": str(cold_dir), "cold.write": "through"},
    )
    tokens, _ = store_chunks(engine, connector, 3, seed=2)
    for key in testing.chunk_keys(engine, tokens):
        assert cache.tiers["warm"].header(key) is not None
        assert cache.tiers["cold"].header(key) is not None


def test_prefix_eviction_drops_tails_before_heads(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    """A new chain evicts the old chain's tail first, never its head."""
    three = 3 * (CHUNK_BYTES + 4096) / 2**30
    engine, connector, cache = tiered_engine(
        engine_factory, device_dirs, **{"warm.capacity_gb": three}
    )
    old, _ = store_chunks(engine, connector, 3, seed=3)
    store_chunks(engine, connector, 1, seed=4)
    present = [cache.tier_of(k) for k in testing.chunk_keys(engine, old)]
    assert present == ["warm", "warm", None]


def test_lookahead_promotes_the_found_prefix_to_hot(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    engine, connector, cache = tiered_engine(
        engine_factory,
        device_dirs,
        **{"warmup.policy": "lookahead", "warmup.lookahead.promote_found": True},
    )
    tokens, kv = store_chunks(engine, connector, 4, seed=5)
    testing.clear_cpu_tier(engine)
    keys = testing.chunk_keys(engine, tokens)
    assert testing.lookup(engine, tokens) == 4 * CHUNK
    # The promoter counts bytes after the put made them visible: wait on both.
    wait_until(
        lambda: (
            cache.promoter.stats.bytes_promoted_hot >= 4 * CHUNK_BYTES
            and all(cache.where(k) == "hot" for k in keys)
        )
    )
    assert cache.promoter.stats.bytes_promoted_hot == 4 * CHUNK_BYTES
    reads = cache.warm.stats.hits
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 4 * CHUNK and torch.equal(out, kv)
    assert cache.warm.stats.hits == reads  # served from hot: no disk read
    # the retrieve took the promoted chunks from hot: counted as used
    assert cache.promoter.stats.timely == 4
    assert cache.promoter.stats.precision == 1.0


def test_no_hot_share_promotes_to_warm_only(
    engine_factory: EngineFactory, device_dirs: list[Path], cold_dir: Path
) -> None:
    """``warmup.hot_fraction: 0`` leaves LMCache's CPU tier to LMCache (as
    lmcache server's adapter has no hot tier below its L1): a plan for hot
    copies the chunks from cold to warm, and nothing is pinned in the CPU
    tier."""
    engine, connector, cache = tiered_engine(
        engine_factory,
        device_dirs,
        **{
            "cold.paths": str(cold_dir),
            "cold.write": "through",
            "warmup.policy": "lookahead",
            "warmup.lookahead.promote_found": True,
            "warmup.hot_fraction": 0,
        },
    )
    tokens, _ = store_chunks(engine, connector, 4, seed=5)
    keys = testing.chunk_keys(engine, tokens)
    testing.clear_cpu_tier(engine)
    for key in keys:
        cache.tiers["warm"].remove(key)
    assert [cache.where(k) for k in keys] == ["cold"] * 4
    assert testing.lookup(engine, tokens) == 4 * CHUNK
    wait_until(lambda: all(cache.where(k) == "warm" for k in keys))
    stats = cache.promoter.stats
    assert stats.bytes_promoted_warm == 4 * CHUNK_BYTES
    assert stats.bytes_promoted_hot == 0


def test_chunks_in_hot_past_the_lookups_hot_prefix_are_not_read_from_disk(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    # LMCache's lookup hands the plugin the rest of a prefix from the first
    # chunk its CPU tier lacks: chunks 1-3 below are still in memory
    engine, connector, cache = tiered_engine(engine_factory, device_dirs)
    tokens, kv = store_chunks(engine, connector, 4, seed=21)
    keys = testing.chunk_keys(engine, tokens)
    hot = testing.get_local_cpu_backend(engine)
    assert hot is not None and hot.remove(keys[0])
    reads = cache.warm.stats.hits
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 4 * CHUNK and torch.equal(out, kv)
    assert cache.warm.stats.hits == reads + 1  # chunk 0 only
    assert cache.snapshot()["reads_from_hot"] == 3


def test_a_promotion_past_the_lookups_hot_prefix_counts_as_used(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    engine, connector, cache = tiered_engine(engine_factory, device_dirs)
    tokens, kv = store_chunks(engine, connector, 3, seed=23)
    testing.clear_cpu_tier(engine)
    keys = testing.chunk_keys(engine, tokens)
    # promote chunks 1 and 2 only: the lookup's hot prefix is empty
    cache.promoter.submit([Plan(tuple(keys[1:]), "hot", cache.now() + 60)])
    wait_until(lambda: all(cache.where(k) == "hot" for k in keys[1:]))
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 3 * CHUNK and torch.equal(out, kv)
    stats = cache.promoter.stats
    assert stats.timely == 2 and stats.precision == 1.0


def test_a_promotion_that_vllm_does_not_load_is_not_counted_as_used(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    """vLLM's lookup finds (and pins) every cached chunk but loads only what
    lies past its GPU prefix cache: a promotion there bought nothing, so the
    benefit guard must not count it; the promoter keeps it pinned for a
    retrieve that does load it."""
    engine, connector, cache = tiered_engine(engine_factory, device_dirs)
    tokens, kv = store_chunks(engine, connector, 3, seed=24)
    testing.clear_cpu_tier(engine)
    keys = testing.chunk_keys(engine, tokens)
    cache.promoter.submit([Plan(tuple(keys[:2]), "hot", cache.now() + 60)])
    wait_until(lambda: all(cache.where(k) == "hot" for k in keys[:2]))
    hot = testing.get_local_cpu_backend(engine)
    assert hot is not None
    assert testing.lookup(engine, tokens, pin=True, lookup_id="gpu") == 3 * CHUNK
    past_gpu_prefix = torch.zeros(3 * CHUNK, dtype=torch.bool)
    past_gpu_prefix[2 * CHUNK :] = True  # the GPU holds chunks 0 and 1
    _, mask = testing.retrieve_tokens(
        engine, tokens, connector=connector, mask=past_gpu_prefix
    )
    engine.lookup_unpin("gpu")
    assert int(mask.sum()) == CHUNK
    assert cache.promoter.stats.timely == 0
    assert all(hot.hot_cache[k].is_pinned for k in keys[:2])
    # a request that loads them uses them
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 3 * CHUNK and torch.equal(out, kv)
    stats = cache.promoter.stats
    assert stats.timely == 2 and stats.precision == 1.0
    assert not any(hot.hot_cache[k].is_pinned for k in keys[:2])


def test_a_promotion_found_and_never_taken_was_the_gpus_and_is_not_promoted_again(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lookup pins every cached chunk, the retrieve takes only those past
    vLLM's GPU prefix cache: a promotion found and not taken within the grace
    was served by the GPU. Neither used nor wasted, it is let go, and the
    chunk is not promoted to hot again for a while."""
    monkeypatch.setattr(promoter_module, "FOUND_GRACE_S", 0.2)
    engine, connector, cache = tiered_engine(engine_factory, device_dirs)
    tokens, _ = store_chunks(engine, connector, 3, seed=25)
    testing.clear_cpu_tier(engine)
    keys = testing.chunk_keys(engine, tokens)
    stats = cache.promoter.stats
    cache.promoter.submit([Plan(tuple(keys[:2]), "hot", cache.now() + 60)])
    wait_until(lambda: all(cache.where(k) == "hot" for k in keys[:2]))
    assert testing.lookup(engine, tokens, pin=True, lookup_id="gpu") == 3 * CHUNK
    past_gpu_prefix = torch.zeros(3 * CHUNK, dtype=torch.bool)
    past_gpu_prefix[2 * CHUNK :] = True
    testing.retrieve_tokens(engine, tokens, connector=connector, mask=past_gpu_prefix)
    engine.lookup_unpin("gpu")
    wait_until(lambda: stats.gpu_served == 2)
    hot = testing.get_local_cpu_backend(engine)
    assert hot is not None
    assert not any(hot.hot_cache[k].is_pinned for k in keys[:2])
    assert stats.timely == 0 and stats.wasted == 0
    testing.clear_cpu_tier(engine)
    cache.promoter.submit([Plan(tuple(keys[:2]), "hot", cache.now() + 60)])
    wait_until(lambda: stats.gpu_skipped == 2)
    assert [cache.where(k) for k in keys[:2]] == ["warm", "warm"]


def test_a_requests_lookup_retires_its_plan(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan made for one request (an arrival hint's) is over once that
    request is looked up: what is still queued is dropped, and what was
    promoted is let go soon unless the retrieve takes it."""
    monkeypatch.setattr(promoter_module, "FOUND_GRACE_S", 0.2)
    engine, connector, cache = tiered_engine(engine_factory, device_dirs)
    promoter = cache.promoter
    first, _ = store_chunks(engine, connector, 2, seed=26)
    second, _ = store_chunks(engine, connector, 2, seed=27)
    testing.clear_cpu_tier(engine)
    hot = testing.get_local_cpu_backend(engine)
    assert hot is not None
    # promoted, then its request is looked up below the CPU tier: unpinned
    keys = testing.chunk_keys(engine, first)
    promoter.submit([Plan(tuple(keys), "hot", cache.now() + 60, keys[-1])])
    wait_until(lambda: all(cache.where(k) == "hot" for k in keys))
    assert all(hot.hot_cache[k].is_pinned for k in keys)
    cache.lookup(keys)
    wait_until(lambda: not any(hot.hot_cache[k].is_pinned for k in keys))
    # still queued when its request is looked up: dropped, nothing read
    keys = testing.chunk_keys(engine, second)
    with promoter.demand([]):  # no unit of warm-up starts meanwhile
        promoter.submit([Plan(tuple(keys), "hot", cache.now() + 60, keys[-1])])
        cache.lookup(keys)
    time.sleep(0.2)
    assert [cache.where(k) for k in keys] == ["warm", "warm"]
    assert promoter.stats.cancelled == 2


def test_chunks_already_hot_are_pinned_where_they_are(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan for hot pins what LMCache's CPU tier holds already (its LRU
    would drop it before the request is scheduled), and keeps the pinned
    chunks at the recent end of that LRU, where no eviction walks past them."""
    monkeypatch.setattr(promoter_module, "RECENCY_EVERY_S", 0.0)
    engine, connector, cache = tiered_engine(
        engine_factory, device_dirs, cpu_gb=8 * CHUNK_BYTES / 2**30
    )
    tokens, kv = store_chunks(engine, connector, 2, seed=28)
    keys = testing.chunk_keys(engine, tokens)
    hot = testing.get_local_cpu_backend(engine)
    assert hot is not None and all(k in hot.hot_cache for k in keys)
    cache.promoter.submit([Plan(tuple(keys), "hot", cache.now() + 60)])
    wait_until(lambda: all(hot.hot_cache[k].is_pinned for k in keys))
    assert cache.promoter.stats.pinned_in_place == 2
    assert cache.promoter.stats.bytes_promoted_hot == 0  # nothing read
    for seed in range(29, 32):  # 6 chunks through an 8-chunk CPU tier
        store_chunks(engine, connector, 2, seed=seed)
    wait_until(lambda: set(list(hot.hot_cache)[-2:]) == set(keys))
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 2 * CHUNK and torch.equal(out, kv)
    stats = cache.promoter.stats
    assert stats.timely == 2
    # kept, not read: precision (over what was read) stays unset
    assert stats.bytes_used_in_place == 2 * CHUNK_BYTES and stats.bytes_used == 0
    assert stats.precision is None


def test_lookahead_plans_nothing_for_unseen_random_lookups(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    engine, connector, cache = tiered_engine(
        engine_factory, device_dirs, **{"warmup.policy": "lookahead"}
    )
    store_chunks(engine, connector, 2, seed=6)
    for seed in range(10, 20):
        assert testing.lookup(engine, testing.make_tokens(2 * CHUNK, seed=seed)) == 0
    time.sleep(0.2)
    stats = cache.promoter.stats
    assert stats.plans == 0 and stats.bytes_promoted_hot == 0


def test_hint_over_loopback_promotes_before_lookup(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    from lmcache_tiered.warmup.hints import send_hint

    engine, connector, cache = tiered_engine(
        engine_factory,
        device_dirs,
        **{"warmup.policy": "hinted", "warmup.hint_port": 0},
    )
    backend = testing.get_backends(engine)["tiered"]
    assert isinstance(backend, TieredBackend) and backend.hint_server is not None
    tokens, _ = store_chunks(engine, connector, 3, seed=7)
    testing.clear_cpu_tier(engine)
    assert send_hint(backend.hint_server.url, tokens.tolist(), deadline_s=5.0)
    keys = testing.chunk_keys(engine, tokens)
    wait_until(lambda: all(cache.where(k) == "hot" for k in keys))


def test_promotions_stay_pinned_in_hot_until_used(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    """LMCache's CPU tier is an LRU that stores churn: an unpinned promotion
    would be gone before its request is scheduled."""
    engine, connector, cache = tiered_engine(
        engine_factory, device_dirs, cpu_gb=8 * CHUNK_BYTES / 2**30
    )
    tokens, kv = store_chunks(engine, connector, 2, seed=30)
    keys = testing.chunk_keys(engine, tokens)
    testing.clear_cpu_tier(engine)
    cache.promoter.submit([Plan(tuple(keys), "hot", cache.now() + 60)])
    wait_until(lambda: all(cache.where(k) == "hot" for k in keys))
    for seed in range(31, 37):  # 12 chunks through an 8-chunk CPU tier
        store_chunks(engine, connector, 2, seed=seed)
    assert all(cache.where(k) == "hot" for k in keys)
    reads = cache.warm.stats.hits
    # as vLLM: the scheduler's lookup pins, the worker retrieves, then unpins
    assert testing.lookup(engine, tokens, pin=True, lookup_id="req") == 2 * CHUNK
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    engine.lookup_unpin("req")
    assert int(mask.sum()) == 2 * CHUNK and torch.equal(out, kv)
    assert cache.warm.stats.hits == reads
    assert cache.promoter.stats.timely == 2
    # used: the promoter's pins are gone, LMCache may evict them again
    hot = testing.get_local_cpu_backend(engine)
    assert hot is not None
    assert not any(hot.hot_cache[k].is_pinned for k in keys)


def test_hot_budget_goes_to_the_earliest_deadline_and_the_rest_waits(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    engine, connector, cache = tiered_engine(engine_factory, device_dirs)
    soon, _ = store_chunks(engine, connector, 2, seed=40)
    later, _ = store_chunks(engine, connector, 2, seed=41)
    soon_keys = testing.chunk_keys(engine, soon)
    later_keys = testing.chunk_keys(engine, later)
    testing.clear_cpu_tier(engine)
    cache.promoter.hot_budget = 2 * CHUNK_BYTES
    now = cache.now()
    cache.promoter.submit([Plan(tuple(later_keys), "hot", now + 60)])
    wait_until(lambda: all(cache.where(k) == "hot" for k in later_keys))
    # needed sooner: takes the budget from the later request's promotions
    cache.promoter.submit([Plan(tuple(soon_keys), "hot", now + 30)])
    wait_until(lambda: all(cache.where(k) == "hot" for k in soon_keys))
    assert [cache.where(k) for k in later_keys] == ["warm", "warm"]
    # ... which wait in the queue, and come back once the budget frees
    testing.lookup(engine, soon, pin=True, lookup_id="soon")
    testing.retrieve_tokens(engine, soon, connector=connector)
    engine.lookup_unpin("soon")
    wait_until(lambda: all(cache.where(k) == "hot" for k in later_keys))
    assert cache.promoter.stats.timely == 2


def test_demand_reads_go_before_a_flood_of_warmup(
    engine_factory: EngineFactory, device_dirs: list[Path], cold_dir: Path
) -> None:
    """Ordering, not wall time: while a demand read runs no warm-up unit starts,
    and the flood's queued keys that the demand read serves are dropped."""
    engine, connector, cache = tiered_engine(
        engine_factory,
        device_dirs,
        **{"cold.paths": str(cold_dir), "warmup.bandwidth_mbps": 5},
    )
    tokens, kv = store_chunks(engine, connector, 12, seed=8)
    keys = testing.chunk_keys(engine, tokens)
    log: list[tuple[str, str]] = []
    cache.promoter.before_unit = lambda target, _: log.append(("warmup-start", target))
    # a flood: every key, to hot, at 5 MB/s so it takes a while
    testing.clear_cpu_tier(engine)
    cache.promoter.submit([Plan(tuple(keys), "hot", time.monotonic() + 60)])
    wait_until(lambda: ("warmup-start", "hot") in log)
    with cache.promoter.demand(keys):
        log.append(("demand-start", ""))
        time.sleep(0.3)  # the promoter must stay idle meanwhile
        log.append(("demand-end", ""))
    begin = log.index(("demand-start", ""))
    end = log.index(("demand-end", ""))
    assert all(event != "warmup-start" for event, _ in log[begin:end])
    assert cache.promoter.stats.late > 0


def test_unknown_policy_is_a_clear_error(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    extra = plugin_extra_config(device_dirs, **{"warmup.policy": "psychic"})
    with caplog.at_level(logging.ERROR, logger="lmcache_tiered"):
        engine, _ = engine_factory(extra)
    assert "tiered" not in testing.get_backends(engine)
    assert "tiered.warmup.policy" in caplog.text and "lookahead" in caplog.text


def test_metrics_snapshot_and_prometheus(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    engine, connector, cache = tiered_engine(engine_factory, device_dirs)
    tokens, _ = store_chunks(engine, connector, 2, seed=9)
    testing.clear_cpu_tier(engine)
    testing.retrieve_tokens(engine, tokens, connector=connector)
    snap = cache.snapshot()
    assert snap["tiers"]["warm"]["hits"] == 2
    assert snap["tiers"]["warm"]["bytes_written"] == 2 * CHUNK_BYTES
    assert snap["warmup"]["policy"] == "none"
    text = generate_latest().decode()
    assert 'lmcache_tiered_tier_hits_total{instance="w0",tier="warm"} 2.0' in text
    assert "lmcache_tiered_tier_read_seconds_bucket" in text
    assert 'lmcache_tiered_warmup_plans_total{instance="w0",policy="none"}' in text
    assert 'lmcache_tiered_tier_degraded{instance="w0",tier="warm"} 0.0' in text
    assert 'lmcache_tiered_reads_from_hot_total{instance="w0"} 0.0' in text
    # a degraded tier (see test_faults) shows as 1 while it is
    snap["tiers"]["warm"]["degraded"] = "Input/output error"
    label = collector().add_source("degraded", lambda: snap)
    try:
        text = generate_latest().decode()
        assert (
            f'lmcache_tiered_tier_degraded{{instance="{label}",tier="warm"}} 1.0'
            in text
        )
    finally:
        collector().remove_source(label)


def test_two_hosts_sharing_a_cold_tier_see_each_others_chunks(
    engine_factory: EngineFactory, tmp_path: Path, cold_dir: Path
) -> None:
    """Two "hosts" (two engines with their own warm directories and host ids)
    on one cold directory: B serves what A stored, byte for byte, and never a
    chunk A rewrote under it (every read of another host's record is
    CRC-checked)."""
    engines = []
    for host in ("host-a", "host-b"):
        warm = tmp_path / f"warm-{host}"
        warm.mkdir()
        settings = {"cold.paths": str(cold_dir), "cold.write": "through"}
        engines.append(tiered_engine(engine_factory, [warm], host_id=host, **settings))
    (engine_a, connector_a, _), (engine_b, connector_b, cache_b) = engines
    tokens, kv = store_chunks(engine_a, connector_a, 3, seed=31)
    assert testing.lookup(engine_b, tokens) == 0  # not seen yet
    cache_b.shared.refresh()  # what its background thread does every 2 s
    assert testing.lookup(engine_b, tokens) == 3 * CHUNK
    out, mask = testing.retrieve_tokens(engine_b, tokens, connector=connector_b)
    assert int(mask.sum()) == 3 * CHUNK and torch.equal(out, kv)
    # A rewrites a chunk's bytes behind B's back: B's next read is a miss
    (foreign,) = cache_b.shared.tiers()
    key = testing.chunk_keys(engine_b, tokens)[0]
    path, offset = payload_offset(foreign, key)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 16)
    cache_b.flush()  # B's copies of the chunks it read go to its warm tier
    testing.clear_cpu_tier(engine_b)
    for tier in cache_b.tiers.values():
        tier.remove(key)  # so the chunk can only come from A's files
    _, mask = testing.retrieve_tokens(engine_b, tokens, connector=connector_b)
    assert int(mask.sum()) == 0
    assert foreign.stats.corrupt == 1


def test_shared_cold_rereads_only_header_files_that_changed(
    engine_factory: EngineFactory,
    tmp_path: Path,
    cold_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = []
    for host in ("host-a", "host-b"):
        warm = tmp_path / f"warm-{host}"
        warm.mkdir()
        settings = {"cold.paths": str(cold_dir), "cold.write": "through"}
        engines.append(tiered_engine(engine_factory, [warm], host_id=host, **settings))
    (engine_a, connector_a, _), (engine_b, _, cache_b) = engines
    first, _ = store_chunks(engine_a, connector_a, 1, seed=61)
    shared = cache_b.shared
    shared.refresh()
    (foreign,) = shared.tiers()
    rereads: list[int] = []
    monkeypatch.setattr(foreign, "refresh", lambda: rereads.append(1))
    header = Path(foreign.header_path)
    old = header.stat().st_mtime - 60
    os.utime(header, (old, old))  # written well before our last read
    shared.refresh()  # a read at this stamp: the next one can skip it
    shared.refresh()
    assert len(rereads) == 1
    store_chunks(engine_a, connector_a, 1, seed=62)  # A writes again
    shared.refresh()
    assert len(rereads) == 2
    assert testing.lookup(engine_b, first) == CHUNK


def test_a_read_spanning_warm_and_cold_reads_both_at_once(
    engine_factory: EngineFactory, device_dirs: list[Path], cold_dir: Path
) -> None:
    engine, connector, cache = two_chunks_warm_over_cold(
        engine_factory, device_dirs, cold_dir
    )
    tokens, kv = store_chunks(engine, connector, 4, seed=5)
    where = [cache.tier_of(k) for k in testing.chunk_keys(engine, tokens)]
    assert sorted(where) == ["cold", "cold", "warm", "warm"]
    # each tier's read waits for the other's to start: read one after the
    # other, the first would wait in vain and break the barrier
    both_reading = threading.Barrier(2, timeout=10)
    readers: dict[str, str] = {}
    for name, tier in cache.tiers.items():

        def read(*args: Any, _name: str = name, _read: Any = tier.read) -> Any:
            readers[_name] = threading.current_thread().name
            both_reading.wait()
            return _read(*args)

        setattr(tier, "read", read)  # noqa: B010
    testing.clear_cpu_tier(engine)
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 4 * CHUNK and torch.equal(out, kv)
    assert set(readers) == {"warm", "cold"}
    assert readers["warm"] != readers["cold"]


def test_benefit_guard_holds_back_a_policy_whose_promotions_come_too_late(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    """A policy that plans for the request being scheduled now only races
    its demand reads: each demand read that finds its chunks still queued
    for hot counts as a promotion of no use, and the guard holds it back."""
    engine, connector, cache = tiered_engine(engine_factory, device_dirs)
    promoter = cache.promoter
    requests = [
        store_chunks(engine, connector, UNIT_KEYS, seed=300 + i)[0]
        for i in range(GUARD_MIN // UNIT_KEYS + 2)
    ]
    testing.clear_cpu_tier(engine)
    keys = [tuple(testing.chunk_keys(engine, tokens)) for tokens in requests]
    with promoter.demand([]):  # no unit of warm-up starts meanwhile
        for request_keys in keys[:-2]:
            promoter.submit([Plan(request_keys, "hot", cache.now() + 60)])
            with promoter.demand(request_keys):  # the request's read comes first
                pass
    assert promoter.stats.late == GUARD_MIN
    assert promoter.stats.bytes_promoted_hot == 0
    # judged: one unit in GUARD_PROBE_EVERY still runs (this first one), the
    # next is held back
    for request_keys in keys[-2:]:
        promoter.submit([Plan(request_keys, "hot", cache.now() + 60)])
    wait_until(lambda: promoter.stats.held_back == UNIT_KEYS)
    assert promoter.stats.bytes_promoted_hot == UNIT_KEYS * CHUNK_BYTES
    assert all(cache.where(k) == "warm" for k in keys[-1])


@pytest.mark.parametrize("min_precision", [0.25, 0.0])
def test_benefit_guard_holds_back_a_policy_whose_promotions_go_unused(
    engine_factory: EngineFactory, device_dirs: list[Path], min_precision: float
) -> None:
    engine, connector, cache = tiered_engine(
        engine_factory, device_dirs, **{"warmup.min_precision": min_precision}
    )
    stats = cache.promoter.stats
    # one unit of work (UNIT_KEYS chunks) per request
    judged = GUARD_MIN // UNIT_KEYS
    rounds = judged + 2 * GUARD_PROBE_EVERY
    requests = [
        store_chunks(engine, connector, UNIT_KEYS, seed=100 + i)[0]
        for i in range(rounds)
    ]
    testing.clear_cpu_tier(engine)

    def settled() -> int:
        promoted = stats.bytes_promoted_hot // CHUNK_BYTES
        return stats.held_back + stats.cancelled + promoted

    def promote_unused(tokens: Any) -> None:
        """Plan a request's chunks for hot; nothing looks them up."""
        before = settled()
        keys = tuple(testing.chunk_keys(engine, tokens))
        cache.promoter.submit([Plan(keys, "hot", cache.now() + 0.3)])
        wait_until(lambda: settled() >= before + UNIT_KEYS)

    for tokens in requests[:judged]:
        promote_unused(tokens)
        # unpinned at the deadline, then dropped by LMCache unused
        target = stats.wasted + UNIT_KEYS
        wait_until(
            lambda t=target: testing.clear_cpu_tier(engine) == 0 and stats.wasted >= t
        )
    assert stats.held_back == 0  # it takes GUARD_MIN misses to judge
    promoted = stats.bytes_promoted_hot
    for tokens in requests[judged:]:
        promote_unused(tokens)
    ran = (stats.bytes_promoted_hot - promoted) // CHUNK_BYTES // UNIT_KEYS
    assert stats.cancelled == 0
    if min_precision:
        # one unit in GUARD_PROBE_EVERY still runs and keeps measuring
        assert ran == 2
        assert stats.held_back == UNIT_KEYS * (2 * GUARD_PROBE_EVERY - 2)
    else:
        assert ran == 2 * GUARD_PROBE_EVERY and stats.held_back == 0


def test_a_victim_whose_copy_to_cold_fails_stays_in_warm(
    engine_factory: EngineFactory, device_dirs: list[Path], cold_dir: Path
) -> None:
    """Write-back: a warm victim is evicted only once cold holds it. Cold
    refusing writes (a read-only tier here, as a shared tier of another
    host is), the stored chunks stay and the new ones are refused."""
    engine, connector, cache = two_chunks_warm_over_cold(
        engine_factory, device_dirs, cold_dir
    )
    first, first_kv = store_chunks(engine, connector, 2, seed=1)
    cold = cache.tiers["cold"]
    cold.read_only = True
    second, _ = store_chunks(engine, connector, 2, seed=11)
    first_keys = testing.chunk_keys(engine, first)
    assert [cache.tier_of(k) for k in first_keys] == ["warm", "warm"]
    assert [cache.tier_of(k) for k in testing.chunk_keys(engine, second)] == [
        None,
        None,
    ]
    testing.clear_cpu_tier(engine)
    out, mask = testing.retrieve_tokens(engine, first, connector=connector)
    assert int(mask.sum()) == 2 * CHUNK and torch.equal(out, first_kv)
    # cold writable again: the next store demotes them as before
    cold.read_only = False
    store_chunks(engine, connector, 2, seed=21)
    assert [cache.tier_of(k) for k in first_keys] == ["cold", "cold"]
