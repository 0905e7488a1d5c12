"""The testing harness: a real LMCache engine on CPU, for tests and benchmarks.

Everything is real LMCache (lmcache 0.5.6, 0.5.7: engine, StorageManager, its
tiers and plugins) except what needs a GPU or vLLM: CPU tensors stand in for
the GPU's KV cache (:class:`CPUConnector`) and a recorder for vLLM's lookup
server (:class:`RecordingLookupServer`). The tests, the bench and the examples
all import it from here. Usage::

    config = build_config(local_disk=str(tmp), max_local_disk_size_gb=1)
    with engine_session(config) as (engine, connector):
        tokens, kv = make_tokens(768), make_kv(connector, 768)
        store_tokens(engine, tokens, kv)      # CPU tier inline, disk queued
        wait_for_puts(engine, tokens)         # lower tiers durable
        clear_cpu_tier(engine)                # next read must come from disk
        out, hit = retrieve_tokens(engine, tokens)

Modules: :mod:`~lmcache_tiered.testing.standins` (the GPU and lookup-server
stand-ins), :mod:`~lmcache_tiered.testing.engine` (build, destroy, config),
:mod:`~lmcache_tiered.testing.drive` (stores, lookups, retrieves, waits),
:mod:`~lmcache_tiered.testing.lmcache` (the harness's and the benchmarks'
reaches into LMCache), :mod:`~lmcache_tiered.testing.ports` (loopback ports).
Each says which LMCache facts it relies on. This package touches no tier's files
and is never imported by the plugin itself.
"""

from lmcache_tiered.testing.drive import (
    abort_async_lookup,
    async_lookup,
    chunk_keys,
    clear_cpu_tier,
    drop_from_cpu_tier,
    get_chunks,
    kv_chunk_bytes,
    kv_chunk_shape,
    lookup,
    make_kv,
    make_tokens,
    release_async_lookup,
    retrieve_tokens,
    store_tokens,
    wait_for_puts,
)
from lmcache_tiered.testing.engine import (
    CPU_TIER,
    DISK_TIER,
    MODEL_NAME,
    build_config,
    build_engine,
    destroy_all_engines,
    destroy_engine,
    engine_session,
    get_backends,
    get_local_cpu_backend,
    get_storage_manager,
    set_lmcache_log_level,
)
from lmcache_tiered.testing.standins import (
    KV_LAYOUT,
    CPUConnector,
    RecordingLookupServer,
)

__all__ = [
    "CPU_TIER",
    "DISK_TIER",
    "KV_LAYOUT",
    "MODEL_NAME",
    "CPUConnector",
    "RecordingLookupServer",
    "abort_async_lookup",
    "async_lookup",
    "build_config",
    "build_engine",
    "chunk_keys",
    "clear_cpu_tier",
    "drop_from_cpu_tier",
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
