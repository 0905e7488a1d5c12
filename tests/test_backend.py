"""TieredBackend inside a real LMCache engine on CPU (sync and async loading)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ENGINES, plugin_extra_config, store_request

import lmcache_tiered.io as io_pkg
from lmcache_tiered import testing
from lmcache_tiered.integration.backend import TieredBackend, registrable_pool
from lmcache_tiered.io import probe
from lmcache_tiered.storage.tier import Tier

EngineFactory = Callable[..., Any]


def warm_tier(backend: TieredBackend) -> Tier:
    assert backend.cache is not None
    return backend.cache.warm


def tiered(engine: Any) -> TieredBackend:
    backend = testing.get_backends(engine).get("tiered")
    assert isinstance(backend, TieredBackend), "plugin did not load"
    return backend


@pytest.mark.parametrize("io_engine", ENGINES)
@pytest.mark.parametrize("async_loading", [False, True], ids=["sync", "async"])
def test_store_clear_cpu_retrieve_identical(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    io_engine: str,
    async_loading: bool,
) -> None:
    engine, connector = engine_factory(
        plugin_extra_config(device_dirs, io_engine=io_engine),
        async_loading=async_loading,
        save_unfull_chunk=True,
    )
    backend = tiered(engine)
    assert warm_tier(backend).engine.name == io_engine
    # 3 full chunks + a partial one
    tokens, kv = store_request(engine, connector, 1000, seed=1)
    assert len(backend.get_keys()) == 4
    assert testing.clear_cpu_tier(engine) == 0
    if async_loading:
        assert testing.async_lookup(engine, tokens, "req-1") == 1000
        out, mask = testing.retrieve_tokens(
            engine, tokens, connector=connector, req_id="req-1"
        )
    else:
        assert testing.lookup(engine, tokens) == 1000
        out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 1000
    assert torch.equal(out, kv)
    assert warm_tier(backend).stats.hits == 4


def test_engine_survives_a_probe_child_killed_by_sigill(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where io_uring code would die of SIGILL (a binding built for AVX-512
    on a CPU without it), a live LMCache engine loads the plugin on the
    thread engine, says why at ERROR, and serves exact data."""
    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    monkeypatch.setattr(probe, "PROBE_COMMAND", (sys.executable, "-c", suicide))
    monkeypatch.setattr(io_pkg, "_fallback_reported", False)
    probe.forget_verdict()
    caplog.set_level(logging.INFO, logger="lmcache_tiered")
    try:
        engine, connector = engine_factory(plugin_extra_config(device_dirs))
        backend = tiered(engine)
        assert warm_tier(backend).engine.name == "threads"
        tokens, kv = store_request(engine, connector, 512, seed=4)
        assert testing.clear_cpu_tier(engine) == 0
        out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
        assert int(mask.sum()) == 512 and torch.equal(out, kv)
    finally:
        probe.forget_verdict()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("SIGILL" in e and "tiered.io_engine: threads" in e for e in errors)


def test_bad_setting_is_logged_and_plugin_absent(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """LMCache only logs a plugin's constructor error: ours says what to fix."""
    extra = plugin_extra_config(device_dirs, queue_depth="deep")
    with caplog.at_level(logging.ERROR, logger="lmcache_tiered"):
        engine, _ = engine_factory(extra)
    assert "tiered" not in testing.get_backends(engine)
    assert "tiered.queue_depth: expected a number, got 'deep'" in caplog.text


def test_scheduler_role_without_cpu_backend(
    device_dirs: list[Path], tmp_path: Path
) -> None:
    """In the scheduler role LMCache passes no CPU tier: the backend opens no
    files (workers on the host keep theirs) and reports no hits."""
    config = testing.build_config(extra_config=plugin_extra_config(device_dirs))
    backend = TieredBackend(config=config, metadata=None, local_cpu_backend=None)
    try:
        key = harness_key(7)
        assert backend.contains(key) is False
        assert backend.get_blocking(key) is None
        assert backend.batched_get_blocking([key]) == [None]
        assert list(device_dirs[0].iterdir()) == []
        with pytest.raises(RuntimeError, match="no LocalCPUBackend"):
            backend.get_allocator_backend()
    finally:
        backend.close()


def harness_key(i: int) -> Any:
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey("m", 1, 0, i, torch.bfloat16, None)


def test_put_skips_stored_and_queued_keys_and_keeps_refcounts(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    engine, connector = engine_factory(plugin_extra_config(device_dirs))
    backend = tiered(engine)
    tokens, kv = store_request(engine, connector, 512, seed=3)
    puts = warm_tier(backend).stats.puts
    testing.store_tokens(engine, tokens, kv)  # the same chunks again
    backend.flush()
    assert warm_tier(backend).stats.puts == puts
    cpu = testing.get_local_cpu_backend(engine)
    assert cpu is not None
    for key in testing.chunk_keys(engine, tokens):
        obj = cpu.hot_cache[key]
        assert obj.get_ref_count() == 1  # our write released its reference


def test_close_drains_pending_writes(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    engine, connector = engine_factory(plugin_extra_config(device_dirs))
    backend = tiered(engine)
    tokens = testing.make_tokens(2048, seed=5)
    testing.store_tokens(engine, tokens, testing.make_kv(connector, 2048, seed=6))
    backend.close()
    assert warm_tier(backend).stats.puts == 8
    backend.close()  # idempotent


RESTART_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from lmcache_tiered import testing
    paths, mode = sys.argv[1].split(","), sys.argv[2]
    extra = {
        "storage_plugin.tiered.module_path": "lmcache_tiered.backend",
        "storage_plugin.tiered.class_name": "TieredBackend",
        "tiered.warm.paths": paths,
        "tiered.warm.capacity_gb": 0.25,
        "tiered.warmup.policy": "none",
    }
    cfg = testing.build_config(extra_config=extra, storage_plugins=["tiered"])
    engine, conn = testing.build_engine(cfg)
    tokens = testing.make_tokens(768, seed=11)
    kv = testing.make_kv(conn, 768, seed=12)
    if mode == "store":
        testing.store_tokens(engine, tokens, kv)
        testing.wait_for_puts(engine, tokens)
        print("stored")
    else:
        print("lookup", testing.lookup(engine, tokens))
        out, mask = testing.retrieve_tokens(engine, tokens, connector=conn)
        print("retrieved", int(mask.sum()), torch.equal(out, kv))
    testing.destroy_all_engines()
    """
)


def test_restart_in_a_new_process_serves_the_same_data(device_dirs: list[Path]) -> None:
    """Process 1 stores and exits; process 2 (same paths) serves every chunk.

    PYTHONHASHSEED is fixed as in production: LMCache's token hash without
    vLLM is Python's hash(), which changes per process otherwise.
    """
    env = dict(os.environ, PYTHONHASHSEED="0")
    paths = ",".join(str(d) for d in device_dirs)

    def run(mode: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", RESTART_SCRIPT, paths, mode],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout

    assert "stored" in run("store")
    out = run("load")
    assert "lookup 768" in out
    assert "retrieved 768 True" in out


def test_get_non_blocking_returns_a_future_of_the_chunk(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    engine, connector = engine_factory(plugin_extra_config(device_dirs))
    backend = tiered(engine)
    tokens, _ = store_request(engine, connector, 256, seed=21)
    (key,) = testing.chunk_keys(engine, tokens)
    future = backend.get_non_blocking(key)
    assert future is not None
    obj = future.result(timeout=10)
    cpu = testing.get_local_cpu_backend(engine)
    assert cpu is not None and obj is not None
    assert torch.equal(obj.tensor, cpu.hot_cache[key].tensor)
    obj.ref_count_down()
    assert backend.get_non_blocking(harness_key(999)) is None


def test_a_pageable_cpu_pool_is_registered_only_when_asked(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    """On a CPU-only host LMCache's pool is pageable: pinning all of it for
    io_uring would commit it at start-up, so ``auto`` leaves it alone and
    ``always`` takes it whole."""
    engine, _ = engine_factory(plugin_extra_config(device_dirs, io_engine="uring"))
    hot = testing.get_local_cpu_backend(engine)
    assert hot is not None
    assert registrable_pool(hot, "auto") is None
    assert registrable_pool(hot, "never") is None
    buffer = hot.memory_allocator.buffer
    assert registrable_pool(hot, "always") == (
        buffer.data_ptr(),
        buffer.numel() * buffer.element_size(),
    )


def test_registered_cpu_pool_serves_reads_as_fixed_buffers(
    engine_factory: EngineFactory, device_dirs: list[Path]
) -> None:
    """LMCache's pool is page-locked on GPU hosts (pinned host memory needs
    CUDA); ``register_cpu_pool: always`` registers the pageable one here."""
    engine, connector = engine_factory(
        plugin_extra_config(device_dirs, io_engine="uring", register_cpu_pool="always"),
        max_local_cpu_size_gb=0.1,
    )
    ring = warm_tier(tiered(engine)).engine
    tokens, kv = store_request(engine, connector, 3 * 256, seed=5)
    assert testing.clear_cpu_tier(engine) == 0
    fixed = ring.stats()["fixed"]
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 3 * 256 and torch.equal(out, kv)
    assert ring.stats()["fixed"] > fixed  # the reads went out as READ_FIXED
