"""Every reach into LMCache beyond its plugin contracts, for lmcache 0.5.6
and 0.5.7, in one place.

The contracts are imported where they are used: the in-process plugin's
(``StoragePluginInterface`` and the types in its signatures: ``CacheEngineKey``,
``MemoryObj`` and its metadata, ``LMCacheEngineConfig``, ``LMCacheMetadata``,
``LocalCPUBackend``) and the multi-process L2 adapter's
(``L2AdapterInterface``, ``lmcache.v1.distributed.api``/``internal_api``,
``Bitmap``, ``create_event_notifier``). They sit at the same paths in both
versions.

Everything else the product needs lives here, each with the reason we need
it; what only the test harness and the benchmarks reach for lives in
:mod:`lmcache_tiered.testing.lmcache`, built on :func:`first_module`. LMCache 0.5.7
moved the in-process engine under ``lmcache.inprocess.v1`` ("Deprecated
in-process LMCache implementation") with no shims at the 0.5.6 paths: each
moved name is imported from the 0.5.7 path first, then the 0.5.6 one. Private
attributes are read here only, so a release that renames one fails here, with
an error naming the field, the installed release and the range we support.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)

__all__ = [
    "ChunkedTokenDatabase",
    "before_cpu_pool_frees",
    "build_l2_adapter",
    "cpu_pool_buffer",
    "cpu_pool_bytes",
    "first_module",
    "lazy_name",
    "flat_memory_obj",
    "l2_memory_tags",
    "log_with_lmcache",
    "native_connector",
    "object_key_to_string",
    "seed_l2_usage",
    "unsupported",
    "watch_use",
    "move_to_recent",
]


def _moved(exc: ModuleNotFoundError, package: str) -> bool:
    """True when ``exc`` says ``package`` itself is absent (the other
    version's layout), not a module it imports."""
    name = exc.name or ""
    return bool(name) and (package == name or package.startswith(name + "."))


def unsupported(what: str) -> ImportError:
    """The error for an LMCache release whose layout we do not know."""
    try:
        version = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    try:
        wanted = next(
            (
                r
                for r in importlib.metadata.requires("lmcache-tiered") or []
                if r.startswith("lmcache")
            ),
            "see pyproject.toml",
        )
    except importlib.metadata.PackageNotFoundError:
        wanted = "see pyproject.toml"
    return ImportError(
        f"lmcache_tiered: {what} not found in lmcache {version}; "
        f"install a supported release ({wanted})"
    )


# ------------------------------------------------------ imported on first use
# name: the modules that define it, the 0.5.7 layout first. Imported when
# first asked for, so the multi-process server, which loads this module with
# the adapter, never loads the deprecated in-process engine nor what it pulls
# in (transformers: seconds of start-up).
_LAZY: dict[str, tuple[str, ...]] = {
    # the backend maps hint tokens to chunk keys with LMCache's own token
    # database, so a hint names exactly the keys the engine stores
    "ChunkedTokenDatabase": (
        "lmcache.inprocess.v1.token_database",
        "lmcache.v1.token_database",
    ),
    # LMCache's raw-block adapter names an ObjectKey by this text; the tests
    # hold our key text to it, so a chunk keeps its name across the two stores
    "object_key_to_string": (
        "lmcache.v1.distributed.l2_adapters.raw_block.key_codec",
        "lmcache.v1.storage_backend.raw_block.key_codec",
    ),
}

if TYPE_CHECKING:  # lmcache ships no types: all of these are Any to mypy
    from lmcache.inprocess.v1.token_database import ChunkedTokenDatabase
    from lmcache.v1.distributed.l2_adapters.raw_block.key_codec import (
        object_key_to_string,
    )


def first_module(paths: tuple[str, ...]) -> ModuleType:
    """The first of ``paths`` this LMCache has; an error naming the release
    when none (a missing module they import is raised as it is)."""
    for path in paths:
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if not _moved(exc, path):
                raise
    raise unsupported(paths[0])


def lazy_name(
    module: str, table: dict[str, tuple[str, ...]], names: dict[str, Any], name: str
) -> Any:
    """A module's ``__getattr__`` over ``table`` (name: the modules defining
    it, the 0.5.7 layout first): imported on first use, then kept in the
    module's ``names`` (its globals)."""
    paths = table.get(name)
    if paths is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    value = getattr(first_module(paths), name)
    names[name] = value
    return value


def __getattr__(name: str) -> Any:
    return lazy_name(__name__, _LAZY, globals(), name)


def log_with_lmcache() -> None:
    """Give the package's logger LMCache's handler, format and level
    (``LMCACHE_LOG_LEVEL``, or ``LMCACHE_TIERED_LOG_LEVEL`` for ours alone),
    unless the host configured logging itself.

    LMCache's loggers do not propagate and neither it nor vLLM configures the
    root logger, so in its server or inside vLLM our INFO lines (what
    read-time admission did, stalls, plans) would otherwise go nowhere.
    """
    ours = logging.getLogger("lmcache_tiered")
    if ours.handlers or logging.getLogger().handlers:
        return
    from lmcache.logging import init_logger

    init_logger(ours.name)
    name = os.environ.get("LMCACHE_TIERED_LOG_LEVEL", "").upper()
    if not name:
        return
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        ours.warning(
            "lmcache_tiered: LMCACHE_TIERED_LOG_LEVEL=%s is not a log level "
            "(DEBUG, INFO, WARNING, ERROR): LMCache's level is kept",
            name,
        )
        return
    ours.setLevel(level)
    for handler in ours.handlers:
        handler.setLevel(level)


# ---------------------------------------------------------- the CPU tier


def cpu_pool_buffer(hot: Any) -> torch.Tensor | None:
    """The tensor behind LMCache's CPU tier (``memory_allocator.buffer``), or
    None for an allocator without one (paged, lazy): registering it as
    io_uring fixed buffers lets reads land in any of its MemoryObjs without
    pinning pages per request, and LMCache offers no other way to learn where
    the pool is."""
    buffer = getattr(getattr(hot, "memory_allocator", None), "buffer", None)
    return buffer if isinstance(buffer, torch.Tensor) else None


def cpu_pool_bytes(hot: Any) -> int:
    """Capacity of LMCache's CPU tier in bytes (``memory_allocator.size``; 0
    if it cannot be told): the promoter's hot-tier budget. LocalCPUBackend
    reports no capacity of its own."""
    try:
        return int(hot.memory_allocator.size)
    except (AttributeError, TypeError):
        return 0


def before_cpu_pool_frees(hot: Any, callback: Callable[[], None]) -> None:
    """Call ``callback`` just before LMCache frees its CPU tier's memory (its
    ``memory_allocator.close``, wrapped on the instance). LMCache's
    StorageManager closes LocalCPUBackend, which frees the arena, before any
    plugin, while our writer may still be reading queued MemoryObjs in it (a
    SIGSEGV at engine destroy); LMCache has no hook for it."""
    allocator: Any = getattr(hot, "memory_allocator", None)
    close = getattr(allocator, "close", None)
    if not callable(close):
        raise unsupported("LocalCPUBackend.memory_allocator.close")

    def close_after_callback() -> None:
        try:
            callback()
        finally:
            close()

    allocator.close = close_after_callback


class _WatchedObj(TensorMemoryObj):
    """A CPU-tier chunk whose first hand-out and first pin are reported.
    LMCache's CPU tier takes a reference for the caller of every get (a
    retrieve, or the plugin's own read of hot) and for nothing a lookup
    does, which pins instead: a chunk a lookup found and no retrieve took
    was served by vLLM's GPU prefix cache (its connector loads nothing the
    GPU holds)."""

    on_first_use: Callable[[], None] | None = None
    on_found: Callable[[], None] | None = None

    def ref_count_up(self) -> None:
        super().ref_count_up()  # first, so the caller's reference is taken
        callback, self.on_first_use = self.on_first_use, None
        if callback is not None:
            callback()

    def pin(self) -> bool:
        pinned = bool(super().pin())
        callback, self.on_found = self.on_found, None
        if callback is not None:
            callback()
        return pinned


def watch_use(
    obj: Any, on_use: Callable[[], None], on_found: Callable[[], None]
) -> bool:
    """Call ``on_use`` on ``obj``'s next ``ref_count_up()`` (arm it after the
    put into the CPU tier, which takes one too) and ``on_found`` on its next
    ``pin()`` (a lookup finding it), each once, by swapping its class for a
    subclass (LocalCPUBackend keeps the object itself, so a wrapper would
    never be handed out); an object watched before is armed again. False,
    and nothing done, for any object that is not a plain ``TensorMemoryObj``."""
    if type(obj) not in (TensorMemoryObj, _WatchedObj):
        return False
    obj.__class__ = _WatchedObj
    assert isinstance(obj, _WatchedObj)
    obj.on_found = on_found
    obj.on_first_use = on_use
    return True


def move_to_recent(hot: Any, keys: Sequence[Any]) -> None:
    """Count ``keys`` as just used in LMCache's CPU-tier eviction order (its
    ``cache_policy.update_on_hit`` under ``cpu_lock``, as its own
    ``touch_cache`` does); keys no longer there are skipped. A pinned chunk
    is never evicted, but LMCache's LRU walks past each one from its old end
    on every eviction: pins left to drift there slow every store down."""
    try:
        lock, policy, cache = hot.cpu_lock, hot.cache_policy, hot.hot_cache
    except AttributeError:
        raise unsupported("LocalCPUBackend.cache_policy") from None
    with lock:
        for key in keys:
            if key in cache:
                policy.update_on_hit(key, cache)


# ------------------------------------------------------ the L2 adapter base


def seed_l2_usage(adapter: Any, salts: Sequence[str], charge: int) -> None:
    """Count chunks recovered from disk in ``L2AdapterInterface``'s usage
    (``_total_bytes_used``, ``_bytes_by_cache_salt`` under ``_usage_lock``),
    ``charge`` bytes each, without telling listeners: they hear of them when
    they register. LMCache's raw-block adapter seeds the same fields on
    recovery; the base class has no public way to."""
    try:
        lock = adapter._usage_lock
    except AttributeError:
        raise unsupported("L2AdapterInterface._usage_lock") from None
    with lock:
        try:
            by_salt: dict[str, int] = adapter._bytes_by_cache_salt
            adapter._total_bytes_used += charge * len(salts)
        except AttributeError as exc:
            raise unsupported(f"L2AdapterInterface.{exc.name}") from None
        for salt in salts:
            by_salt[salt] = by_salt.get(salt, 0) + charge


# ------------------------------------------------------------- memory tags
# lmcache 0.5.7 asks every L2 adapter for the medium it stores on
# (``L2AdapterInterface.get_memory_tags``); 0.5.6 has no such types and never
# asks, so there the same answer is a plain pair of strings (LMCache's enums
# are ``str`` enums with these values: either compares equal to the text).
try:  # lmcache 0.5.7
    from lmcache.v1.distributed.api import (
        MemoryResidency,
        MemorySegment,
        MemoryTags,
    )

    def l2_memory_tags(remote: bool) -> Any:
        """LMCache's tags for a storage medium, local or remote."""
        residency = MemoryResidency.REMOTE if remote else MemoryResidency.LOCAL
        return MemoryTags(MemorySegment.STORAGE, residency)

except ImportError:  # lmcache 0.5.6

    @dataclass(frozen=True)
    class _MemoryTags:
        segment: str
        residency: str

    def l2_memory_tags(remote: bool) -> Any:
        """LMCache's tags for a storage medium, local or remote."""
        return _MemoryTags("storage", "remote" if remote else "local")


# ------------------------------------------------------ LMCache's L2 adapters


def parse_l2_adapter(spec: str) -> Any:
    """The config LMCache's own parser makes of ``spec``, the JSON ``lmcache
    server --l2-adapter`` takes; ValueError for a spec LMCache refuses."""
    import argparse
    import warnings

    with warnings.catch_warnings():
        # the parser imports the clients of all adapter types (google-cloud
        # among them), whose FutureWarnings are about Python versions
        warnings.simplefilter("ignore", FutureWarning)
        from lmcache.v1.distributed.l2_adapters.config import (
            parse_args_to_l2_adapters_config,
        )

        parsed = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    return parsed.adapters[0]


def build_l2_adapter(spec: str) -> Any:
    """An L2 adapter built from ``spec`` (:func:`parse_l2_adapter`) by
    LMCache's own factory (the cold tier on a store,
    :mod:`lmcache_tiered.storage.adapter_tier`). ValueError for a spec LMCache
    refuses; the adapter's own errors (an unreachable S3 endpoint, a missing
    client library) as raised."""
    config = parse_l2_adapter(spec)  # imports the factory's package, quietly
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter

    return create_l2_adapter(config, None)


def native_connector(adapter: Any) -> Any:
    """The connector object a ``native_plugin`` adapter wraps (LMCache's
    ``NativeConnectorL2Adapter`` keeps it as ``_client``), or None for any
    other adapter. The wrapper's completions carry one bool per key, so a
    connector of ours (Mooncake's) says there why its store failed: lost, or
    refusing writes, which the cold tier treats differently."""
    try:
        from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
            NativeConnectorL2Adapter,
        )
    except ImportError:
        return None
    if not isinstance(adapter, NativeConnectorL2Adapter):
        return None
    client = getattr(adapter, "_client", None)
    if client is None:
        raise unsupported("NativeConnectorL2Adapter._client")
    return client


def flat_memory_obj(data: torch.Tensor) -> TensorMemoryObj:
    """A MemoryObj over a flat ``uint8`` CPU tensor with no allocator (never
    freed by LMCache): the buffer an L2 adapter reads or writes."""
    meta = MemoryObjMetadata(
        shape=torch.Size([data.numel()]),
        dtype=torch.uint8,
        address=0,
        phy_size=data.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(data, meta, parent_allocator=None)
