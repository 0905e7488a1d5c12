"""Build and destroy real in-process LMCache engines on CPU (lmcache 0.5.6, 0.5.7).

May touch: LMCache's config, engine builder, StorageManager and its loop,
the process's LMCache log levels and telemetry variables; no tier's files.

Facts this module relies on (paths under ``site-packages/lmcache/`` in 0.5.6;
0.5.7 moved the engine's modules, ``v1/cache_engine.py`` and the rest, under
``inprocess/v1/`` unchanged, see :mod:`lmcache_tiered._lmcache`):

Lifecycle. ``LMCacheEngineBuilder`` caches engines by instance id
(``v1/cache_engine.py:2122``); ``destroy`` (2181) closes the stats logger and the
StorageManager (backends in dict order, then stops and joins its loop thread).
:func:`destroy_engine` also closes the CPU tier last where LMCache's own
disk tier is present (closing it frees the arena that tier may still be
writing from), shuts the stopped loop's default
executor (``asyncio_N`` threads) and, after the last engine, the PinMonitor
singleton. An engine never destroyed hangs interpreter exit (non-daemon
``storage-manager-event-loop`` and ``stats-logger-thread``): leftovers are
destroyed from ``threading._register_atexit``, hooked by the first
:func:`build_engine` (never by an import: a vLLM process importing this module
must exit as vLLM does). Telemetry (a phone-home thread per
engine) is disabled with ``LMCACHE_TRACK_USAGE=false``; LMCache loggers read
``LMCACHE_LOG_LEVEL`` at import and do not propagate (:func:`set_lmcache_log_level`).

Stock disk tier. ``local_disk: "file:///dir"`` (or a bare path; comma-separated
for several, ``v1/config_base.py:50``) plus ``max_local_disk_size`` (GB) > 0
(``v1/storage_backend/__init__.py:217-220``); ``extra_config: {use_odirect: true}``
(``local_disk_backend.py:170``) is used only when the chunk size is a multiple of
the file system block size (lines 781, 802); ``disk_io_threads`` (default 4).
One ``<model>@<world>@<worker>@<hash>@<dtype>.pt`` file per chunk; index in
memory. Read it with ``batched_get(keys, location="LocalDiskBackend")``; a plugin's
location is its name in ``storage_plugins`` (``__init__.py:104``).

RustRawBlockBackend (``pip install --pre lmcache-rust-raw-block-io``, 0.5.7rc2
wheel) runs on a regular pre-sized file: ``storage_plugins: [rrb]``,
``storage_plugin.rrb.module_path:
lmcache.v1.storage_backend.plugins.rust_raw_block_backend``, ``class_name:
RustRawBlockBackend``, ``rust_raw_block.device_path: <file>``, ``capacity_bytes``,
``meta_total_bytes`` (default 128 MiB, must fit), ``use_odirect``, ``io_engine``
(``posix`` default or ``io_uring``), ``block_align``/``header_bytes`` (4096). With
``io_uring`` LocalCPUBackend switches to a paged allocator (``local_cpu_backend.py:
519``). Its index is checkpointed on the file and reloaded by the next engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered.testing.lmcache import (
    LMCacheEngine,
    LMCacheEngineBuilder,
    PinMonitor,
    StorageManager,
    engine_instances,
    mock_up_broadcast_fn,
    mock_up_broadcast_object_fn,
)
from lmcache_tiered.testing.standins import CPUConnector, RecordingLookupServer

CPU_TIER = "LocalCPUBackend"
DISK_TIER = "LocalDiskBackend"


def set_lmcache_log_level(level: int | str = logging.WARNING) -> None:
    """Set the level of every ``lmcache`` logger, present and future.

    LMCache loggers do not propagate and read ``LMCACHE_LOG_LEVEL`` when they are
    created (at import), so both the live loggers and the variable are set.
    """
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    assert isinstance(level, int)
    os.environ["LMCACHE_LOG_LEVEL"] = logging.getLevelName(level)
    for name in list(logging.Logger.manager.loggerDict):
        if name == "lmcache" or name.startswith("lmcache."):
            logging.getLogger(name).setLevel(level)


def _disable_telemetry() -> None:
    """Stop LMCache's phone-home usage report (it runs at engine creation)."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def build_config(
    *,
    chunk_size: int = 256,
    local_cpu: bool = True,
    max_local_cpu_size_gb: float = 0.25,
    extra_config: dict[str, Any] | None = None,
    storage_plugins: list[str] | None = None,
    enable_async_loading: bool = False,
    local_disk: str | None = None,
    max_local_disk_size_gb: float = 0,
    **overrides: Any,
) -> LMCacheEngineConfig:
    """An ``LMCacheEngineConfig`` built like LMCache builds one from YAML.

    ``local_disk`` is a directory (``/path`` or ``file:///path``; comma-separated
    for several); it only takes effect with ``max_local_disk_size_gb > 0``.
    ``overrides`` are any other LMCache config fields (checked by name).
    """
    fields: dict[str, Any] = {
        "chunk_size": chunk_size,
        "local_cpu": local_cpu,
        "max_local_cpu_size": max_local_cpu_size_gb,
        "extra_config": extra_config,
        "storage_plugins": storage_plugins,
        "enable_async_loading": enable_async_loading,
        "local_disk": local_disk,
        "max_local_disk_size": max_local_disk_size_gb,
    }
    known = set(LMCacheEngineConfig.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown LMCache config field(s): {unknown}")
    fields.update(overrides)
    config = LMCacheEngineConfig.from_dict(fields)
    config.validate()
    return config


#: The model name in the keys of every engine built here, unless told.
MODEL_NAME = "tiny"


def build_engine(
    config: LMCacheEngineConfig,
    *,
    model_name: str = MODEL_NAME,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    worker_id: int = 0,
    world_size: int = 1,
    instance_id: str | None = None,
    log_level: int | str | None = logging.WARNING,
    require_plugins: bool = True,
) -> tuple[LMCacheEngine, CPUConnector]:
    """Build and post-init a real ``LMCacheEngine`` with a :class:`CPUConnector`.

    Goes through ``LMCacheEngineBuilder.get_or_create`` (cached by
    ``instance_id``, default: a fresh id). Tear down with :func:`destroy_engine`.
    With ``enable_async_loading`` a :class:`RecordingLookupServer` stands in for
    vLLM's lookup server (see :func:`async_lookup`). ``require_plugins`` raises
    when a backend named in ``config.storage_plugins`` is absent.
    """
    _disable_telemetry()
    _register_exit_cleanup()
    if log_level is not None:
        set_lmcache_log_level(log_level)
    if instance_id is None:
        instance_id = f"lmcache-tiered-{uuid.uuid4().hex[:12]}"
    metadata = LMCacheMetadata(
        model_name=model_name,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=dtype,
        kv_shape=(num_layers, 2, config.chunk_size, num_kv_heads, head_size),
        role="worker",
        chunk_size=config.chunk_size,
    )
    connector = CPUConnector(num_layers, num_kv_heads, head_size, dtype)
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id,
        config,
        metadata,
        connector,
        mock_up_broadcast_fn,
        mock_up_broadcast_object_fn,
    )
    if not engine.post_inited:
        server = RecordingLookupServer() if config.enable_async_loading else None
        engine.post_init(async_lookup_server=server)
    if require_plugins:
        # LMCache only logs a plugin whose import or constructor raised.
        missing = [
            name
            for name in config.storage_plugins or []
            if name not in get_backends(engine)
        ]
        if missing:
            destroy_engine(instance_id)
            raise RuntimeError(
                f"storage plugin(s) {missing} failed to load (see LMCache's log)"
            )
    return engine, connector


def destroy_engine(engine_or_id: LMCacheEngine | str) -> None:
    """Close an engine built by :func:`build_engine` and drop it from the builder.

    Stops the StorageManager loop thread and its backends (a disk tier drains its
    queued writes first). When no engine is left, also stops LMCache's PinMonitor
    singleton thread, so a test leaves no LMCache thread behind.
    """
    if isinstance(engine_or_id, str):
        instance_id = engine_or_id
    else:
        instance_id = next(
            (k for k, v in engine_instances().items() if v is engine_or_id),
            "",
        )
    engine = engine_instances().get(instance_id)
    if engine is not None:
        manager = engine.storage_manager
        backends: OrderedDict[str, Any] = (
            OrderedDict() if manager is None else manager.storage_backends
        )
        if CPU_TIER in backends and DISK_TIER in backends:
            # StorageManager.close() closes backends in dict order, and closing
            # the CPU tier frees its arena while LMCache's own disk tier still
            # writes from it. Our plugin closes itself first (see
            # integration/backend.py); the stock one needs the CPU tier last.
            backends.move_to_end(CPU_TIER)
        LMCacheEngineBuilder.destroy(instance_id)
        if manager is not None:
            _close_loop(manager)
    if not engine_instances():
        PinMonitor.DestroyInstance()


def _close_loop(manager: StorageManager) -> None:
    """Shut down the stopped StorageManager loop's default executor, then close it.

    ``StorageManager.close`` only stops the loop: the ``asyncio_N`` threads of its
    default executor (used by ``asyncio.to_thread`` in disk/plugin backends) would
    outlive the engine.
    """
    manager.thread.join(timeout=10.0)
    loop = manager.loop
    if manager.thread.is_alive() or loop.is_running() or loop.is_closed():
        return
    try:
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


def destroy_all_engines() -> None:
    """Destroy every engine the builder knows (e.g. in a session fixture)."""
    for instance_id in list(engine_instances()):
        destroy_engine(instance_id)
    PinMonitor.DestroyInstance()


_exit_cleanup_registered = False


def _register_exit_cleanup() -> None:
    """Destroy leftover engines before the interpreter joins non-daemon threads
    (registered once).

    The StorageManager loop and the stats logger are non-daemon threads: an engine
    that is never destroyed (e.g. a test that raised) would hang interpreter exit.
    ``atexit`` runs too late (after the join), so this uses the hook that
    ``concurrent.futures`` uses, ``threading._register_atexit``.
    """
    global _exit_cleanup_registered
    register = getattr(threading, "_register_atexit", None)
    if register is not None and not _exit_cleanup_registered:
        register(destroy_all_engines)
        _exit_cleanup_registered = True


def get_storage_manager(engine: LMCacheEngine) -> StorageManager:
    """The engine's StorageManager (exists after ``post_init``)."""
    manager = engine.storage_manager
    if manager is None:
        raise RuntimeError("engine has no storage manager (post_init not run?)")
    return manager


def get_backends(
    engine: LMCacheEngine,
) -> OrderedDict[str, StorageBackendInterface]:
    """``StorageManager.storage_backends``: name -> backend, in lookup order."""
    return get_storage_manager(engine).storage_backends


def get_local_cpu_backend(engine: LMCacheEngine) -> LocalCPUBackend | None:
    """The CPU tier (None when ``max_local_cpu_size <= 0``)."""
    backend = get_backends(engine).get(CPU_TIER)
    return backend if isinstance(backend, LocalCPUBackend) else None


@contextlib.contextmanager
def engine_session(
    config: LMCacheEngineConfig, **kwargs: Any
) -> Iterator[tuple[LMCacheEngine, CPUConnector]]:
    """:func:`build_engine` ... :func:`destroy_engine`, as a context manager."""
    engine, connector = build_engine(config, **kwargs)
    try:
        yield engine, connector
    finally:
        destroy_engine(engine)
