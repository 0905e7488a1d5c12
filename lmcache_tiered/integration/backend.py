"""TieredBackend: the LMCache storage plugin.

Enable it in LMCache's YAML::

    storage_plugins: ["tiered"]
    extra_config:
      storage_plugin.tiered.module_path: lmcache_tiered.backend
      storage_plugin.tiered.class_name: TieredBackend
      tiered.warm.paths: ["/mnt/nvme0/kv", "/mnt/nvme1/kv"]

LMCache calls the constructor with keywords and only *logs* an exception from
it, so every configuration error is also logged here at ERROR, in full. This
class only translates LMCache's interface; the work is in
:class:`lmcache_tiered.cache.tiered_cache.TieredCache`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, cast

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import (
    AllocatorBackendInterface,
    StoragePluginInterface,
)
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered._lmcache import (
    ChunkedTokenDatabase,
    before_cpu_pool_frees,
    cpu_pool_buffer,
    log_with_lmcache,
)
from lmcache_tiered.cache.admission import DEFAULT_CHUNK_TOKENS
from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.cache.writer import PutCallback
from lmcache_tiered.config import ConfigError, TieredConfig, setting_key
from lmcache_tiered.metrics import AdmissionStats, WarmupStats, collector
from lmcache_tiered.warmup.hints import HintServer

logger = logging.getLogger("lmcache_tiered")


def full_chunk_bytes(metadata: LMCacheMetadata) -> int:
    """Bytes of one full KV chunk: the slot size when tiered.slot_mb is unset."""
    return int(math.prod(metadata.kv_shape) * metadata.kv_dtype.itemsize)


def _hint_port(base: int, metadata: LMCacheMetadata | None) -> int:
    """Each tensor-parallel worker on a host listens on ``base + its local
    rank`` (0 stays "any free port"); a hint must reach every worker, since
    each holds its own shard of every chunk."""
    if base == 0 or metadata is None:
        return base
    return int(base + metadata.local_worker_id)


def registrable_pool(hot: LocalCPUBackend, mode: str) -> tuple[int, int] | None:
    """(address, bytes) of LMCache's CPU pool to register as io_uring fixed
    buffers under ``tiered.register_cpu_pool`` = ``mode``, else None.

    ``auto`` takes only a page-locked pool (as on GPU hosts): registering a
    pageable one pins, so commits, all of it at start-up, which ``always``
    accepts (reads then pin no pages per request, as with a pinned pool)."""
    buffer = cpu_pool_buffer(hot)
    if mode == "never" or buffer is None or not buffer.numel():
        return None
    if buffer.device.type != "cpu" or (mode == "auto" and not buffer.is_pinned()):
        return None
    return buffer.data_ptr(), buffer.numel() * buffer.element_size()


class TieredBackend(StoragePluginInterface):
    """Striped NVMe tiers and warm-up behind LMCache's storage-plugin interface.

    In the scheduler role (no ``local_cpu_backend``) it opens no files, so the
    workers on the host keep theirs, and reports no hits.
    """

    def __init__(
        self,
        config: LMCacheEngineConfig | None = None,
        dst_device: str = "cpu",
        metadata: LMCacheMetadata | None = None,
        local_cpu_backend: LocalCPUBackend | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        log_with_lmcache()
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        self.cache: TieredCache | None = None
        self.hint_server: HintServer | None = None
        try:
            self.settings = TieredConfig.from_extra_config(
                None if config is None else config.extra_config
            )
            if local_cpu_backend is not None:
                self.cache = self._open_cache(metadata, local_cpu_backend)
                pool = registrable_pool(
                    local_cpu_backend, self.settings.register_cpu_pool
                )
                if pool is not None:
                    self.cache.register_memory(*pool)
                if self.settings.hint_port >= 0:
                    self.hint_server = HintServer(
                        port=_hint_port(self.settings.hint_port, metadata),
                        on_hint=self.hint,
                    )
        except Exception as exc:
            logger.error("lmcache_tiered: TieredBackend not loaded: %s", exc)
            if self.cache is not None:
                self.cache.close()
            raise
        self._token_db: ChunkedTokenDatabase | None = None
        self._async_pins: dict[str, list[CacheEngineKey]] = {}
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="lmcache-tiered-read")
        self._closed = False
        owner = "scheduler" if metadata is None else f"w{metadata.worker_id}"
        self._metrics_label = collector().add_source(owner, self.metrics_snapshot)
        if self.cache is not None:
            # LMCache frees its CPU tier before it closes plugins: close first
            before_cpu_pool_frees(local_cpu_backend, self.close)
        self._log_ready()

    def _open_cache(
        self, metadata: LMCacheMetadata | None, hot: LocalCPUBackend
    ) -> TieredCache:
        if self.settings.slot_bytes is not None:
            max_payload = self.settings.slot_bytes
            if metadata is not None and max_payload < full_chunk_bytes(metadata):
                raise ConfigError(
                    f"{setting_key('slot_mb')}: {max_payload / 2**20:.3g} MiB is "
                    f"less than one full chunk of this model "
                    f"({full_chunk_bytes(metadata) / 2**20:.3g} MiB): every full "
                    "chunk would be dropped; raise it or leave it unset"
                )
        elif metadata is not None:
            max_payload = full_chunk_bytes(metadata)
        else:
            raise ConfigError(
                f"{setting_key('slot_mb')} is required when LMCache passes no "
                "model metadata"
            )
        worker = 0 if metadata is None else metadata.worker_id
        local_workers = 1 if metadata is None else max(1, metadata.local_world_size)
        return TieredCache(
            self.settings,
            owner=f"kv-w{worker}",
            max_payload=max_payload,
            local_workers=local_workers,
            hot=hot,
            # never busy-loop: a full CPU pool must be a miss, not a hang
            allocate=lambda h: hot.allocate(h.shape, h.dtype, h.fmt, busy_loop=False),
            chunk_tokens=int(getattr(self.config, "chunk_size", DEFAULT_CHUNK_TOKENS)),
        )

    def _log_ready(self) -> None:
        if self.cache is None:
            logger.warning(
                "lmcache_tiered: no LocalCPUBackend (scheduler role, or "
                "max_local_cpu_size <= 0): this instance stores and serves nothing; "
                "on workers set max_local_cpu_size > 0"
            )
            return
        logger.info(
            "lmcache_tiered: TieredBackend ready: %s%s",
            self.cache.describe(),
            "" if self.hint_server is None else f", hints at {self.hint_server.url}",
        )

    def __str__(self) -> str:
        return self.__class__.__name__

    # ---------------------------------------------------------------- lookups

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return 0 if self.cache is None else self.cache.prefix_hits(keys, pin)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        hits = self.batched_contains(keys, pin)
        if pin and hits:
            # released when this lookup's load finishes (LMCache never does)
            self._async_pins.setdefault(lookup_id, []).extend(keys[:hits])
        return hits

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.cache is not None and self.cache.is_pending(key)

    def get_keys(self) -> list[CacheEngineKey]:
        return [] if self.cache is None else self.cache.stored_keys()

    def pin(self, key: CacheEngineKey) -> bool:
        return self.cache is not None and self.cache.pin(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.cache is not None and self.cache.unpin(key)

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.cache is not None and self.cache.remove(key)

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        return sum(self.remove(key, force) for key in keys)

    def get_allocator_backend(self) -> AllocatorBackendInterface:
        if self.local_cpu_backend is None:
            raise RuntimeError(
                "TieredBackend has no LocalCPUBackend to allocate from "
                "(scheduler role or max_local_cpu_size <= 0)"
            )
        return self.local_cpu_backend

    def touch_cache(self) -> None:
        """Recency is refreshed by lookups and reads; nothing to do."""

    # ------------------------------------------------------------------ hints

    def hint(
        self,
        token_ids: Sequence[int] | torch.Tensor | None = None,
        keys: Sequence[CacheEngineKey] | None = None,
        deadline_s: float | None = None,
    ) -> None:
        """An arrival hint: a request reached the server and will be looked up
        soon. Give its prompt ``token_ids`` (or its chunk ``keys``) and, if
        known, the seconds until it is expected to be scheduled."""
        if self.cache is None:
            return
        if keys is None:
            if token_ids is None:
                raise ValueError("hint() needs token_ids or keys")
            keys = self._keys_of(token_ids)
        deadline = None if deadline_s is None else self.cache.now() + deadline_s
        self.cache.hint(keys, deadline)

    def _keys_of(self, token_ids: Sequence[int] | torch.Tensor) -> list[CacheEngineKey]:
        """The chunk keys LMCache will look up for these tokens."""
        if self._token_db is None:
            self._token_db = ChunkedTokenDatabase(self.config, self.metadata)
        tokens = torch.as_tensor(token_ids, dtype=torch.long)
        return [
            cast(CacheEngineKey, key)
            for _, _, key in self._token_db.process_tokens(tokens=tokens)
        ]

    # ------------------------------------------------------------------ reads

    def batched_get_blocking(
        self, keys: list[CacheEngineKey]
    ) -> list[MemoryObj | None]:
        return [None] * len(keys) if self.cache is None else self.cache.read(keys)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def get_non_blocking(
        self, key: CacheEngineKey, location: str | None = None
    ) -> Future[None] | None:
        if not self.contains(key):
            return None
        return self._readers.submit(self.get_blocking, key)

    async def batched_get_non_blocking(
        self,
        lookup_id: str,
        keys: list[CacheEngineKey],
        transfer_spec: Any = None,
    ) -> list[MemoryObj]:
        """Read the batch off the event loop; return its contiguous prefix of
        hits (LMCache maps results to keys by position).

        As with LMCache's own disk tier, each returned object is pinned once:
        the engine's async retrieve unpins it, then drops its reference.
        """
        loop = asyncio.get_running_loop()
        try:
            objs = await loop.run_in_executor(
                self._readers, self.batched_get_blocking, keys
            )
        finally:
            for key in self._async_pins.pop(lookup_id, []):
                self.unpin(key)
        prefix: list[MemoryObj] = list(
            itertools.takewhile(lambda obj: obj is not None, objs)
        )
        for obj in objs[len(prefix) :]:
            if obj is not None:
                obj.ref_count_down()
        for obj in prefix:
            obj.pin()
        return prefix

    # ----------------------------------------------------------------- writes

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: PutCallback | None = None,
    ) -> list[Future[None]] | None:
        """Queue the batch for the writer thread and return at once."""
        if self.cache is not None:
            self.cache.put(keys, objs, on_complete_callback)
        return None

    def flush(self) -> None:
        """Block until every put queued so far is written (tests, benchmarks)."""
        if self.cache is not None:
            self.cache.flush()

    # --------------------------------------------------------------- metrics

    def metrics_snapshot(self) -> dict[str, Any]:
        """Counters per tier and of the warm-up policy, as plain data."""
        if self.cache is None:
            warmup = asdict(WarmupStats()) | {"policy": self.settings.warmup_policy}
            return {
                "tiers": {},
                "warmup": warmup,
                "reads_from_hot": 0,
                "admission": asdict(AdmissionStats()),
            }
        return self.cache.snapshot()

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Write the queued puts (within the writer's bound), then release
        everything (idempotent). Runs when LMCache closes its CPU tier, whose
        memory the queued puts and the promoter's pins are in, whatever order
        LMCache closes its backends in."""
        if self._closed:
            return
        self._closed = True
        self._readers.shutdown(wait=True)
        collector().remove_source(self._metrics_label)
        if self.hint_server is not None:
            self.hint_server.close()
        if self.cache is not None:
            self.cache.close()
