"""Drive an engine as vLLM does: token ids and KV in, stores, lookups,
retrieves (sync and async), and the waits a test needs between them.

May touch: an engine built by :mod:`lmcache_tiered.testing.engine`, its
StorageManager and backends through LMCache's own calls; no tier's files.

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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj

from lmcache_tiered.testing.engine import (
    CPU_TIER,
    get_backends,
    get_local_cpu_backend,
    get_storage_manager,
)
from lmcache_tiered.testing.lmcache import EventStatus, EventType, LMCacheEngine
from lmcache_tiered.testing.standins import CPUConnector, RecordingLookupServer


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


def drop_from_cpu_tier(engine: LMCacheEngine, keys: Sequence[CacheEngineKey]) -> int:
    """Drop ``keys`` from the CPU tier (those it holds); returns how many.

    A forced ``LocalCPUBackend.remove``, which also releases lookup pins the
    objects still hold.
    """
    cpu = get_local_cpu_backend(engine)
    if cpu is None or not keys:
        return 0
    return cpu.batched_remove(list(keys))


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
