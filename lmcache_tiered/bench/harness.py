"""A real LMCache engine on CPU, for tests and benchmarks (lmcache 0.5.6, 0.5.7).

Usage::

    config = build_config(local_disk=str(tmp), max_local_disk_size_gb=1)
    with engine_session(config) as (engine, connector):
        tokens, kv = make_tokens(768), make_kv(connector, 768)
        store_tokens(engine, tokens, kv)      # CPU tier inline, disk queued
        wait_for_puts(engine, tokens)         # lower tiers durable
        clear_cpu_tier(engine)                # next read must come from disk
        out, hit = retrieve_tokens(engine, tokens)

Facts this module relies on (paths under ``site-packages/lmcache/`` in 0.5.6;
0.5.7 moved the engine's modules, ``v1/cache_engine.py`` and the rest, under
``inprocess/v1/`` unchanged, see :mod:`lmcache_tiered._lmcache`):

Connector. ``EngineType.MOCK`` builds ``MockGPUConnector``
(``v1/gpu_connector/__init__.py:258``, ``mock_gpu_connector.py:31-46``) whose
to/from_gpu are no-ops: stores write uninitialised bytes and retrieves copy
nothing, so data cannot be checked. :class:`CPUConnector` copies for real.
``store``/``retrieve`` hand their own kwargs to ``batched_from_gpu(objs, starts,
ends, **kw)`` / ``batched_to_gpu(...)`` (``v1/cache_engine.py:569, 935``); here
``kvcaches`` (+ optional ``slot_mapping``). Chunk MemoryObjs are ``KV_2LTD``,
shape ``[2, num_layers, tokens, kv_heads * head_size]`` (``v1/metadata.py:87``),
bytes = 2*L*T*H*D*itemsize (256 KiB for the defaults), 4096-aligned
(``AddressManager.ALIGN_BYTES``, ``v1/memory_management.py:1338``), partial chunks
too (physical size rounded up to 4096).

Lifecycle. ``LMCacheEngineBuilder`` caches engines by instance id
(``v1/cache_engine.py:2122``); ``destroy`` (2181) closes the stats logger and the
StorageManager (backends in dict order, then stops and joins its loop thread).
:func:`destroy_engine` also closes the CPU tier last (closing it frees the
arena other tiers may still be writing from), shuts the stopped loop's default
executor (``asyncio_N`` threads) and, after the last engine, the PinMonitor
singleton. An engine never destroyed hangs interpreter exit (non-daemon
``storage-manager-event-loop`` and ``stats-logger-thread``): leftovers are
destroyed from ``threading._register_atexit``, hooked by the first
:func:`build_engine` (never by an import: a vLLM process importing this module
must exit as vLLM does). Telemetry (a phone-home thread per
engine) is disabled with ``LMCACHE_TRACK_USAGE=false``; LMCache loggers read
``LMCACHE_LOG_LEVEL`` at import and do not propagate (:func:`set_lmcache_log_level`).

Sync read path (``enable_async_loading: false``), all on the caller's thread:
``lookup`` -> ``batched_contains(keys, pin)`` per tier in order
(``storage_manager.py:972``); ``retrieve`` -> ``get_block_mapping`` ->
``batched_get(keys, location=tier)`` -> ``backend.batched_get_blocking``; a full
hit from a non-CPU tier is written back into the CPU tier (``storage_manager.py:
494-513``). ``lookup_unpin`` calls ``unpin(key)`` per pinned key. ``touch_cache``
reaches only LocalCPU/LocalDisk (``storage_manager.py:1042``). Puts:
``batched_submit_put_task`` on the caller's thread with each object at ref count
2 (allocator + CPU tier); StorageManager drops one right after (line 435).

Async read path (``enable_async_loading: true``). vLLM's scheduler asks its
``LMCacheAsyncLookupServer`` (ZMQ; needs ``metadata.engine_id`` and a scheduler
peer), which calls ``engine.async_lookup_and_prefetch(lookup_id, hashes, offsets,
pin=True)`` (``v1/lookup_client/lmcache_async_lookup_client.py:369``). That
schedules ``StorageManager.async_lookup_and_prefetch`` on the StorageManager loop
(the ``loop`` given to plugin constructors, thread ``storage-manager-event-loop``)
via ``run_coroutine_threadsafe`` and drops the future (``cache_engine.py:1397``).
Per tier in order: ``await batched_async_contains(lookup_id, keys, pin)`` (line
733), then ``batched_get_non_blocking(lookup_id, hit_keys, {"cum_chunk_lengths":
[...]})`` as a task behind one ``AsyncSingleSerializer`` lock shared by all tiers
and requests (lines 197-214, 765); results are gathered into an EventManager
LOADING event and ``async_lookup_server.send_response_to_scheduler(lookup_id,
tokens)`` (line 653; it asserts a server exists, 573). The worker then calls
``retrieve(..., req_id=lookup_id)``, which takes the objects from the event
(``cache_engine.py:1695``; AssertionError if there is none, i.e. 0 hits), copies,
unpins and releases them; nothing is written back to the CPU tier. On CPU this
runs for real: ``post_init(async_lookup_server=RecordingLookupServer())`` stands in
for the ZMQ server and :func:`async_lookup` drives it. LMCache pitfalls seen here:
a tier whose ``batched_async_contains`` raises loses the lookup silently (no log,
no response: the scheduler times out); one whose ``batched_get_non_blocking``
raises logs "Exception in callback" and never responds. ``lookup_unpin(lookup_id)``
after an async retrieve (what vLLM's ``wait_for_save`` does) runs
``cleanup_memory_objs`` and releases the objects a second time; for CPU-tier hits
that frees objects still cached. LocalDiskBackend pins its entries in
``batched_async_contains(pin=True)`` (``local_disk_backend.py:669``) and nothing
unpins them after the load: a plugin must drop such pins itself when its
``batched_get_non_blocking`` for that lookup finishes.

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

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered._lmcache import (
    EventStatus,
    EventType,
    GPUConnectorInterface,
    LMCacheEngine,
    LMCacheEngineBuilder,
    PinMonitor,
    StorageManager,
    engine_instances,
    mock_up_broadcast_fn,
    mock_up_broadcast_object_fn,
)

__all__ = [
    "CPU_TIER",
    "DISK_TIER",
    "KV_LAYOUT",
    "CPUConnector",
    "RecordingLookupServer",
    "abort_async_lookup",
    "async_lookup",
    "build_config",
    "build_engine",
    "chunk_keys",
    "clear_cpu_tier",
    "destroy_all_engines",
    "destroy_engine",
    "engine_session",
    "get_chunks",
    "get_backends",
    "get_local_cpu_backend",
    "get_storage_manager",
    "kv_chunk_bytes",
    "kv_chunk_shape",
    "lookup",
    "make_kv",
    "make_tokens",
    "release_async_lookup",
    "retrieve_tokens",
    "set_lmcache_log_level",
    "store_tokens",
    "wait_for_puts",
]

CPU_TIER = "LocalCPUBackend"
DISK_TIER = "LocalDiskBackend"

# The connector's KV layout: one request's KV, token-contiguous.
# [num_layers, 2 (K/V), num_tokens, num_kv_heads, head_size]
KV_LAYOUT = "[num_layers, 2, num_tokens, num_kv_heads, head_size]"


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


class CPUConnector(GPUConnectorInterface):
    """GPU connector whose "GPU" is a CPU tensor.

    ``kvcaches`` (a kwarg of ``store``/``retrieve``) is one tensor laid out as
    ``[num_layers, 2, num_slots, num_kv_heads, head_size]``. Token ``t`` of the
    request lives in slot ``slot_mapping[t]`` when ``slot_mapping`` is given, else
    in slot ``t``. MemoryObjs are ``KV_2LTD``: ``[2, num_layers, tokens, heads *
    head_size]``, the layout LMCache allocates when no layer-group manager is
    registered (``LMCacheMetadata.get_shapes``).
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.kvcaches: torch.Tensor | None = None

    def _kv(self, kwargs: dict[str, Any]) -> torch.Tensor:
        kv = kwargs.get("kvcaches")
        if not isinstance(kv, torch.Tensor):
            raise TypeError("CPUConnector needs kvcaches=<torch.Tensor> " + KV_LAYOUT)
        if kv.dim() != 5 or kv.shape[0] != self.num_layers or kv.shape[1] != 2:
            raise ValueError(f"kvcaches shape {tuple(kv.shape)} is not {KV_LAYOUT}")
        return kv

    @staticmethod
    def _slots(kwargs: dict[str, Any], start: int, end: int) -> slice | torch.Tensor:
        slot_mapping = kwargs.get("slot_mapping")
        if slot_mapping is None:
            return slice(start, end)
        return torch.as_tensor(slot_mapping, dtype=torch.long)[start:end]

    def _obj_view(self, memory_obj: MemoryObj, num_tokens: int) -> torch.Tensor:
        """The MemoryObj as [num_layers, 2, tokens, heads, head_size] (a view)."""
        tensor = memory_obj.tensor
        if tensor is None:
            raise RuntimeError("MemoryObj has no tensor (invalidated?)")
        fmt = memory_obj.get_memory_format()
        if fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"CPUConnector supports KV_2LTD only, got {fmt}")
        return tensor.view(
            2, self.num_layers, num_tokens, self.num_kv_heads, self.head_size
        ).transpose(0, 1)

    def from_gpu(
        self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any
    ) -> None:
        """Copy tokens [start, end) of ``kvcaches`` into ``memory_obj``."""
        kv = self._kv(kwargs)
        self._obj_view(memory_obj, end - start).copy_(
            kv[:, :, self._slots(kwargs, start, end)]
        )

    def to_gpu(
        self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any
    ) -> None:
        """Copy ``memory_obj`` into tokens [start, end) of ``kvcaches``."""
        kv = self._kv(kwargs)
        kv[:, :, self._slots(kwargs, start, end)] = self._obj_view(
            memory_obj, end - start
        )

    def batched_from_gpu(
        self,
        memory_objs: list[list[MemoryObj]] | list[MemoryObj],
        starts: list[int],
        ends: list[int],
        **kwargs: Any,
    ) -> None:
        """Per-chunk ``from_gpu``."""
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            assert isinstance(obj, MemoryObj), "layerwise lists are not supported"
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: list[list[MemoryObj]] | list[MemoryObj] | list[int] | None = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        """Per-chunk ``to_gpu``."""
        assert memory_objs is not None and starts is not None and ends is not None
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            assert isinstance(obj, MemoryObj), "layerwise lists are not supported"
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of a KV_2LTD MemoryObj holding ``num_tokens`` tokens."""
        return torch.Size(
            [2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size]
        )

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        """Remember the last ``kvcaches`` (no pointer tables on CPU)."""
        if "kvcaches" in kwargs:
            self.kvcaches = kwargs["kvcaches"]


def build_config(
    *,
    chunk_size: int = 256,
    local_cpu: bool = True,
    max_local_cpu_size_gb: float = 1.0,
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


def build_engine(
    config: LMCacheEngineConfig,
    *,
    model_name: str = "tiny",
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
        if manager is not None and CPU_TIER in manager.storage_backends:
            # StorageManager.close() closes backends in dict order, and closing
            # the CPU tier frees its arena: lower tiers still writing from CPU
            # MemoryObjs must drain first, so close the CPU tier last.
            manager.storage_backends.move_to_end(CPU_TIER)
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


def kv_chunk_shape(
    num_tokens: int, *, num_layers: int = 2, num_kv_heads: int = 2, head_size: int = 64
) -> torch.Size:
    """Shape of the KV_2LTD MemoryObj LMCache allocates for one chunk."""
    return torch.Size([2, num_layers, num_tokens, num_kv_heads * head_size])


def kv_chunk_bytes(
    num_tokens: int,
    *,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Bytes of one chunk's MemoryObj (``MemoryObj.get_size()``)."""
    elems = 2 * num_layers * num_tokens * num_kv_heads * head_size
    return elems * torch.empty((), dtype=dtype).element_size()


def make_tokens(num_tokens: int, *, seed: int = 0, vocab: int = 32000) -> torch.Tensor:
    """Random int64 token ids (a distinct prefix per seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_tokens,), generator=gen, dtype=torch.long)


def make_kv(
    connector: CPUConnector, num_tokens: int, *, seed: int | None = 0
) -> torch.Tensor:
    """KV for ``num_tokens`` tokens in the connector's layout; random or zeros."""
    shape = (
        connector.num_layers,
        2,
        num_tokens,
        connector.num_kv_heads,
        connector.head_size,
    )
    if seed is None:
        return torch.zeros(shape, dtype=connector.dtype)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(connector.dtype)


def chunk_keys(
    engine: LMCacheEngine, tokens: torch.Tensor | Sequence[int]
) -> list[CacheEngineKey]:
    """The CacheEngineKeys LMCache uses for the chunks of ``tokens``."""
    keys = []
    for _start, _end, key in engine.token_database.process_tokens(tokens=tokens):
        assert isinstance(key, CacheEngineKey)
        keys.append(key)
    return keys


def store_tokens(
    engine: LMCacheEngine,
    tokens: torch.Tensor,
    kv: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """``engine.store`` for a request whose KV is ``kv`` (connector layout).

    Writes to the CPU tier happen inline; writes to other tiers are queued
    (use :func:`wait_for_puts`). Without ``save_unfull_chunk`` a trailing partial
    chunk is not stored.
    """
    engine.store(tokens, mask=mask, kvcaches=kv, **kwargs)


def retrieve_tokens(
    engine: LMCacheEngine,
    tokens: torch.Tensor,
    *,
    kv: torch.Tensor | None = None,
    connector: CPUConnector | None = None,
    mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``engine.retrieve``; returns ``(kv, hit_mask)``.

    ``kv`` defaults to zeros shaped like the connector's layout. ``hit_mask`` is a
    bool tensor over tokens; ``int(hit_mask.sum())`` is the tokens retrieved. With
    async loading pass ``req_id=<lookup_id>`` of a finished :func:`async_lookup`.
    """
    if kv is None:
        conn = connector or engine.gpu_connector
        if not isinstance(conn, CPUConnector):
            raise TypeError("pass kv= or connector= (a CPUConnector)")
        kv = make_kv(conn, len(tokens), seed=None)
    hit_mask = engine.retrieve(tokens, mask=mask, kvcaches=kv, **kwargs)
    return kv, hit_mask


def lookup(
    engine: LMCacheEngine,
    tokens: torch.Tensor,
    *,
    search_range: list[str] | None = None,
    pin: bool = False,
    lookup_id: str | None = None,
) -> int:
    """``engine.lookup``: tokens of the longest stored prefix.

    With ``pin=True`` pass a ``lookup_id`` and release with
    ``engine.lookup_unpin(lookup_id)``.
    """
    if pin and lookup_id is None:
        raise ValueError("pin=True needs a lookup_id")
    return engine.lookup(
        tokens, search_range=search_range, lookup_id=lookup_id, pin=pin
    )


def wait_for_puts(
    engine: LMCacheEngine,
    tokens: torch.Tensor | Sequence[int],
    *,
    locations: Iterable[str] | None = None,
    timeout: float = 30.0,
    poll_s: float = 0.005,
) -> None:
    """Block until every chunk of ``tokens`` is durably in each lower tier.

    "Durable" = ``contains(key)`` is true and ``exists_in_put_tasks(key)`` false.
    ``locations`` defaults to every backend except the CPU tier.
    Raises TimeoutError (e.g. a tier refused the put for lack of room).
    """
    backends = get_backends(engine)
    names = (
        [n for n in backends if n != CPU_TIER] if locations is None else list(locations)
    )
    keys = chunk_keys(engine, tokens)
    deadline = time.monotonic() + timeout
    for name in names:
        backend = backends[name]
        pending = list(keys)
        while pending:
            pending = [
                k
                for k in pending
                if backend.exists_in_put_tasks(k) or not backend.contains(k)
            ]
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name}: {len(pending)}/{len(keys)} chunks not stored "
                    f"after {timeout}s"
                )
            time.sleep(poll_s)


def clear_cpu_tier(engine: LMCacheEngine) -> int:
    """Drop every chunk from the CPU tier so reads must come from lower tiers.

    Uses ``LocalCPUBackend.clear()``, which skips objects still referenced
    (pinned, or held by an in-flight write): call :func:`wait_for_puts` first.
    Returns the number of chunks left behind (0 when fully cleared).
    """
    cpu = get_local_cpu_backend(engine)
    if cpu is None:
        return 0
    if cpu.use_hot:
        cpu.clear()
    else:
        # With local_cpu=False the tier is allocator-only and clear() is a no-op.
        cpu.batched_remove(cpu.get_keys())
    return len(cpu.get_keys())


class RecordingLookupServer:
    """Stands in for ``LMCacheAsyncLookupServer`` (which needs vLLM's ZMQ peers).

    StorageManager calls ``send_response_to_scheduler(lookup_id, num_hit_tokens)``
    on its event loop when an async lookup+prefetch finished; this records it.
    """

    def __init__(self) -> None:
        self._results: dict[str, int] = {}
        self._cond = threading.Condition()

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        """Record the number of prefix tokens the prefetch made ready."""
        with self._cond:
            self._results[lookup_id] = int(num_hit_tokens)
            self._cond.notify_all()

    def poll(self, lookup_id: str, timeout: float = 0.0) -> int | None:
        """Pop the response for ``lookup_id``, waiting up to ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: lookup_id in self._results, timeout)
            return self._results.pop(lookup_id, None)

    def close(self) -> None:
        """Nothing to release."""


def _lookup_server(engine: LMCacheEngine) -> RecordingLookupServer:
    server = get_storage_manager(engine).async_lookup_server
    if not isinstance(server, RecordingLookupServer):
        raise RuntimeError("engine was not built with enable_async_loading=True")
    return server


def _done_loading_task(engine: LMCacheEngine, lookup_id: str) -> Any:
    done = engine.event_manager.events[EventType.LOADING][EventStatus.DONE]
    return done.get(lookup_id)


def async_lookup(
    engine: LMCacheEngine,
    tokens: torch.Tensor,
    lookup_id: str,
    *,
    pin: bool = True,
    search_range: list[str] | None = None,
    timeout: float = 30.0,
    via_engine: bool = False,
) -> int:
    """Run LMCache's async lookup + prefetch to completion; return hit tokens.

    Schedules ``StorageManager.async_lookup_and_prefetch`` on the StorageManager
    loop exactly as ``LMCacheEngine.async_lookup_and_prefetch`` does (non-layerwise)
    but keeps the future, so an exception from a tier's ``batched_async_contains``
    or ``batched_get_non_blocking`` is raised here instead of ending in a silent
    timeout. ``via_engine=True`` calls the engine method itself. ``pin=True`` is
    what vLLM's lookup server passes. When this returns > 0, call
    :func:`retrieve_tokens` with ``req_id=lookup_id``, then
    :func:`release_async_lookup`.
    """
    server = _lookup_server(engine)
    manager = get_storage_manager(engine)
    future: concurrent.futures.Future[None] | None = None
    if via_engine:
        engine.async_lookup_and_prefetch(
            lookup_id, tokens=tokens, search_range=search_range, pin=pin
        )
    else:
        keys: list[CacheEngineKey] = []
        cum_chunk_lengths = [0]
        for _start, end, key in engine.token_database.process_tokens(tokens=tokens):
            assert isinstance(key, CacheEngineKey)
            keys.append(key)
            cum_chunk_lengths.append(end)
        if search_range is None:
            search_range = engine.retrieve_locations
        future = asyncio.run_coroutine_threadsafe(
            manager.async_lookup_and_prefetch(
                lookup_id, keys, cum_chunk_lengths, search_range, pin
            ),
            manager.loop,
        )
    deadline = time.monotonic() + timeout
    while True:
        hit = server.poll(lookup_id, timeout=0.005)
        if hit is not None:
            return hit
        if future is not None and future.done() and future.exception() is not None:
            raise RuntimeError(f"async lookup {lookup_id} failed") from (
                future.exception()
            )
        task = _done_loading_task(engine, lookup_id)
        if task is not None and task.done() and task.exception() is not None:
            raise RuntimeError(f"async prefetch {lookup_id} failed") from (
                task.exception()
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"no async lookup response for {lookup_id}")


def release_async_lookup(engine: LMCacheEngine, lookup_id: str) -> None:
    """Drop the loading event of an async lookup whose tokens were retrieved.

    ``engine.retrieve`` already unpinned and released every prefetched MemoryObj
    but leaves the event in the EventManager. Do NOT call
    ``engine.lookup_unpin(lookup_id)`` here: for a DONE event it runs
    ``cleanup_memory_objs``, which releases the same objects a second time
    (CPU-tier objects then hit ref count 0 while still cached, and are freed).
    For a lookup that is not retrieved use :func:`abort_async_lookup`.
    """
    status = engine.event_manager.get_event_status(EventType.LOADING, lookup_id)
    if status == EventStatus.DONE:
        engine.event_manager.pop_event(EventType.LOADING, lookup_id)


def abort_async_lookup(engine: LMCacheEngine, lookup_id: str) -> None:
    """Release the prefetched objects of an async lookup that is not retrieved."""
    engine.cleanup_memory_objs(lookup_id)


def get_chunks(
    engine: LMCacheEngine, tokens: torch.Tensor | Sequence[int], location: str
) -> list[MemoryObj | None]:
    """``StorageManager.batched_get(keys, location=...)`` for ``tokens``' chunks.

    ``location`` is a key of :func:`get_backends`: ``"LocalCPUBackend"``,
    ``"LocalDiskBackend"``, or a plugin's name as listed in ``storage_plugins``.
    The caller owns one reference per returned object: ``ref_count_down()`` it.
    A full hit from a non-CPU tier is also written back into the CPU tier.
    """
    return get_storage_manager(engine).batched_get(
        chunk_keys(engine, tokens), location=location
    )


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
