"""Shared fixtures: a real LMCache engine on CPU with the tiered plugin."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

from lmcache_tiered import testing
from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.config import TieredConfig
from lmcache_tiered.config import plugin_extra_config as loading_config
from lmcache_tiered.integration.backend import TieredBackend
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.testing.lmcache import MixedMemoryAllocator

ENGINES = ["uring", "threads"]

# Property tests check correctness, not speed: on a loaded 2-core machine one
# example can take longer than hypothesis' default 200 ms deadline.
settings.register_profile("no-deadline", deadline=None)
settings.load_profile("no-deadline")


def plugin_extra_config(paths: list[Path], **settings: Any) -> dict[str, Any]:
    """LMCache extra_config that loads TieredBackend over ``paths``."""
    extra = loading_config(
        {
            "tiered.warm.paths": [str(p) for p in paths],
            "tiered.warm.capacity_gb": 0.25,
            # deterministic reads unless a test asks for a warm-up policy
            "tiered.warmup.policy": "none",
        }
    )
    extra.update({f"tiered.{k}": v for k, v in settings.items()})
    return extra


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def cache_of(engine: Any) -> TieredCache:
    """The TieredCache behind an engine's tiered plugin."""
    backend = testing.get_backends(engine)["tiered"]
    assert isinstance(backend, TieredBackend) and backend.cache is not None
    return backend.cache


class HeldStores:
    """Stands in for a cache's ``store``: records each call's payload count
    and holds every call until ``released`` is set (``entered`` once one has
    begun), so that work queues up behind it."""

    def __init__(self, store: Callable[[list[Any]], list[bool]]) -> None:
        self.store = store
        self.batches: list[int] = []
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self, payloads: list[Any]) -> list[bool]:
        self.batches.append(len(payloads))
        self.entered.set()
        assert self.released.wait(20)
        return self.store(payloads)


@pytest.fixture
def cold_dir(tmp_path: Path) -> Path:
    """A directory for the cold tier."""
    path = tmp_path / "cold"
    path.mkdir()
    return path


@pytest.fixture
def device_dirs(tmp_path: Path) -> list[Path]:
    """Two directories standing in for two NVMe devices."""
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in dirs:
        d.mkdir()
    return dirs


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Any]]:
    """Builds real LMCache engines; destroys all of them after the test."""

    def build(
        extra_config: dict[str, Any],
        *,
        async_loading: bool = False,
        plugins: tuple[str, ...] = ("tiered",),
        **config: Any,
    ) -> tuple[Any, testing.CPUConnector]:
        cfg = testing.build_config(
            extra_config=extra_config,
            storage_plugins=list(plugins),
            enable_async_loading=async_loading,
            **config,
        )
        return testing.build_engine(cfg, require_plugins=False)

    yield build
    testing.destroy_all_engines()


#: allocators made by the running test, closed after it (see new_allocator)
_ALLOCATORS: list[MixedMemoryAllocator] = []


def new_allocator(size: int) -> MixedMemoryAllocator:
    """LMCache's own CPU allocator (4 KiB-aligned MemoryObjs), closed when
    the test ends: its arena is freed only by ``close()``, so each one left
    open kept its bytes for the rest of the run (the suite grew to 9 GB)."""
    allocator = MixedMemoryAllocator(size)
    _ALLOCATORS.append(allocator)
    return allocator


@pytest.fixture(autouse=True)
def _close_allocators() -> Iterator[None]:
    """Autouse, so set up first and torn down last: every tier and cache a
    test opened (other fixtures) is closed before the memory it read goes."""
    yield
    while _ALLOCATORS:
        _ALLOCATORS.pop().close()


@pytest.fixture
def allocator() -> MixedMemoryAllocator:
    """LMCache's own CPU allocator, 128 MiB, closed after the test."""
    return new_allocator(128 << 20)


@pytest.fixture
def tier_factory(device_dirs: list[Path]) -> Iterator[Callable[..., Tier]]:
    """Opens Tiers over ``device_dirs``; closes them after the test."""
    opened: list[Tier] = []

    def open_tier(
        *, max_payload: int = 64 << 10, capacity_bytes: int = 8 << 20, **settings: Any
    ) -> Tier:
        extra = {"tiered.warm.paths": [str(d) for d in device_dirs]}
        extra.update({f"tiered.{k}": v for k, v in settings.items()})
        config = TieredConfig.from_extra_config(extra)
        tier = Tier(
            config.tier_options(config.warm),
            owner="kv-w0",
            max_payload=max_payload,
            capacity_bytes=capacity_bytes,
        )
        opened.append(tier)
        return tier

    yield open_tier
    for tier in opened:
        tier.close()


def random_kv(shape: torch.Size, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def payload_offset(tier: Tier, key: Any) -> tuple[str, int]:
    """The slab file and offset where ``key``'s payload starts in ``tier``."""
    entry = tier.index.get(key)
    assert entry is not None
    extent = tier.geometry.extents(entry.slot, entry.header.payload_size)[0]
    return tier.slab_paths[extent.device], extent.offset


def store_chunks(
    engine: Any, connector: Any, n_chunks: int, seed: int, chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store ``n_chunks`` chunks of ``chunk`` tokens (tokens from ``seed``, KV
    from ``seed + 1``) and flush the plugin's writer."""
    tokens = testing.make_tokens(n_chunks * chunk, seed=seed)
    kv = testing.make_kv(connector, n_chunks * chunk, seed=seed + 1)
    testing.store_tokens(engine, tokens, kv)
    cache_of(engine).flush()
    return tokens, kv


def store_request(
    engine: Any, connector: Any, n_tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store a request of ``n_tokens`` (tokens from ``seed``, KV from
    ``seed + 1``) and wait until every lower tier holds it durably."""
    tokens = testing.make_tokens(n_tokens, seed=seed)
    kv = testing.make_kv(connector, n_tokens, seed=seed + 1)
    testing.store_tokens(engine, tokens, kv)
    testing.wait_for_puts(engine, tokens)
    return tokens, kv
