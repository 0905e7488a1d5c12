"""TieredL2Adapter: the tiered cache as an L2 adapter of LMCache's
multi-process server (``lmcache server``).

Enable it on the server's command line::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "lmcache_tiered.mp", "class_name": "TieredL2Adapter",
        "adapter_params": {"warm.paths": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"],
                           "warm.capacity_gb": 500}}'

``adapter_params`` are the YAML's ``tiered.*`` settings without the prefix
(:mod:`lmcache_tiered.integration.l2_config`); a bad one stops the server's
start-up with a clear error instead of a silently missing tier.

The adapter runs on the same
:class:`~lmcache_tiered.cache.tiered_cache.TieredCache` as the in-process
plugin; this module only translates LMCache's L2 protocol
(``lmcache/v1/distributed/l2_adapters/base.py``, lmcache 0.5.6 and 0.5.7)
into cache calls (:mod:`lmcache_tiered.integration.l2_work`):

* Keys are ``ObjectKey``, stored under their canonical text, so a restarted
  server serves them. Buffers stay LMCache's: the tiers read into and write
  from a flat byte view of each object, never keeping a reference.
* Three threads (store, lookup/unlock/touch, load) each take every task
  queued so far as one cache call, so a long store batch never delays a
  lookup, one call's I/O keeps all devices busy, and stores go out up to
  :data:`~lmcache_tiered.cache.writer.WRITE_BATCH_BYTES` a call (LMCache
  keeps a store task's L1 objects locked until it is reported). A thread
  signals its operation's event fd once its results are queryable;
  ``submit_*`` calls only queue. A store task is reported done once its
  chunks are written (payload, then header).
* Lookup-and-lock pins each chunk found where it is; unlock unpins. Lookups
  and touches (0.5.7: prefixes LMCache's L1 holds) are the warm-up policy's
  signal, one prefix chain per row of keys; there is no LMCache CPU tier
  below the adapter, so promotions go to warm.
* A thread stuck inside one batch for 30 s is logged once with every
  thread's stack (:class:`~lmcache_tiered.cache.writer.StallWatch`).
* Counters per tier, of the warm-up policy and of read-time admission are
  in the adapter's part of the server's ``/status`` and on its Prometheus
  port (``lmcache_tiered_*``, ``instance="kv-mp"``), as in-process.
* LMCache's listeners and usage counters see a chunk as stored while some
  tier of ours holds it (:class:`lmcache_tiered.integration.l2_ledger.L2Ledger`,
  the adapter's base class); each chunk is charged one warm slot on disk.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import (
    MemoryLayoutDesc,
    ObjectKey,
)
from lmcache.v1.distributed.internal_api import (
    L1MemoryDesc,
    L2StoreResult,
)
from lmcache.v1.distributed.l2_adapters.base import L2TaskId
from lmcache.v1.memory_management import (
    MemoryObj,
)

from lmcache_tiered._lmcache import l2_memory_tags, log_with_lmcache
from lmcache_tiered.cache import writer
from lmcache_tiered.cache.tiered_cache import TieredCache, tier_owner
from lmcache_tiered.cache.writer import BatchWorker, StallWatch
from lmcache_tiered.config import PREFIX
from lmcache_tiered.integration.l2_config import TieredL2AdapterConfig, capacity_bytes
from lmcache_tiered.integration.l2_ledger import L2Ledger
from lmcache_tiered.integration.l2_work import (
    Channel,
    LookupJob,
    Task,
    Touch,
    Unlock,
    borrow,
    load_tasks,
    lookup,
    store_tasks,
)
from lmcache_tiered.io.base import CLOSE_WAIT_S
from lmcache_tiered.metrics import collector
from lmcache_tiered.storage.base import StorageTier
from lmcache_tiered.storage.directories import DirectoryHold, recorded_max_payload

__all__ = ["OWNER", "TieredL2Adapter", "TieredL2AdapterConfig", "borrow"]

logger = logging.getLogger("lmcache_tiered")

#: File owner name of the adapter's tiers: one server process per host owns
#: them, holding every kv rank (the in-process plugin's are ``kv-w<worker>``).
OWNER = "kv-mp"


class TieredL2Adapter(L2Ledger):
    """A :class:`TieredCache` behind LMCache's ``L2AdapterInterface``.

    LMCache's plugin factory calls ``TieredL2Adapter(config, l1_memory_desc=)``
    (``lmcache/v1/distributed/l2_adapters/plugin_l2_adapter.py``); a plain
    mapping of ``adapter_params`` is accepted too. With an io_uring engine the
    L1 arena is registered as fixed buffers when LMCache declares it stable.
    """

    def __init__(
        self,
        config: TieredL2AdapterConfig | Mapping[str, Any],
        l1_memory_desc: L1MemoryDesc | None = None,
    ) -> None:
        log_with_lmcache()
        if not isinstance(config, TieredL2AdapterConfig):
            config = TieredL2AdapterConfig.from_dict(dict(config))
        settings = config.settings
        super().__init__(max_capacity_bytes=capacity_bytes(settings))
        self.settings = settings
        self._l1_memory_desc = l1_memory_desc
        #: None until the slot size is known (see _open_cache)
        self.cache: TieredCache | None = None
        self._metrics_label = ""
        #: the tiers' directories, held until the tiers open and adopt them
        self._holds = self._hold_directories()
        warm = settings.warm
        slot = settings.slot_bytes or recorded_max_payload(
            warm.paths, tier_owner(warm.name, OWNER, settings)
        )
        if slot is not None:
            self._open_cache(slot)
        self._lock = threading.Lock()
        self._closed = False
        self._next_task_id: L2TaskId = 0
        self._stores = Channel[Task, L2StoreResult](
            self._lock,
            BatchWorker(
                "lmcache-tiered-l2-store",
                self._run_stores,
                weigh=lambda task: sum(obj.get_size() for obj in task.objects),
                max_weight=writer.WRITE_BATCH_BYTES,
            ),
        )
        self._lookups = Channel[LookupJob, Bitmap](
            self._lock, BatchWorker("lmcache-tiered-l2-lookup", self._run_lookups)
        )
        self._loads = Channel[Task, Bitmap](
            self._lock, BatchWorker("lmcache-tiered-l2-load", self._run_loads)
        )
        self._stall_watch = StallWatch([c.worker for c in self._channels()])
        if settings.hint_port >= 0:
            logger.warning(
                "lmcache_tiered: warmup.hint_port is ignored by TieredL2Adapter: "
                "LMCache's server sends no arrival hints; lookups and touches "
                "drive warm-up (a router can POST the server's /cache/prefetches)"
            )
        logger.info(
            "lmcache_tiered: TieredL2Adapter ready: %s",
            self.cache.describe()
            if self.cache is not None
            else "tiers open at the first store (slot size from its objects); "
            f"warm-up policy {settings.warmup_policy}",
        )

    # ---------------------------------------------------------------- tiers

    @property
    def tiers(self) -> list[StorageTier]:
        """Our tiers, warm first; empty until the slot size is known."""
        cache = self.cache
        return [] if cache is None else list(cache.tiers.values())

    def _hold_directories(self) -> dict[str, DirectoryHold]:
        """Hold the tiers' directories now, though the tiers may open only at
        the first store (when the slot size is known): a second server on
        them is refused at its start, naming the holder, instead of starting
        healthy and failing every store."""
        holds: dict[str, DirectoryHold] = {}
        try:
            for tier in (self.settings.warm, self.settings.cold):
                if tier is not None:
                    holds[tier.name] = DirectoryHold(
                        tier.paths,
                        tier_owner(tier.name, OWNER, self.settings),
                        setting=f"{PREFIX}{tier.name}.paths",
                        file_mode=self.settings.file_mode,
                    )
        except BaseException:
            for hold in holds.values():
                hold.release()
            raise
        return holds

    def _open_cache(self, max_payload: int) -> None:
        """Open the cache, its tiers with slots of ``max_payload`` bytes (they
        adopt the locks :meth:`_hold_directories` took, with no gap between)."""
        cache = TieredCache(
            self.settings,
            owner=OWNER,
            max_payload=max_payload,
            local_workers=1,
            hot=None,  # LMCache's L1 is above us; loads bring their buffers
            holds=self._holds,
        )
        desc = self._l1_memory_desc
        if desc is not None and desc.stable_registration_size:
            # LMCache says the L1 arena stays put: fixed buffers for loads
            cache.register_memory(desc.ptr, desc.stable_registration_size)
        self._follow(cache)
        self.cache = cache
        # LMCache's server serves the process's Prometheus registry
        # (--prometheus-port): our series join its own there
        self._metrics_label = collector().add_source(OWNER, cache.snapshot)

    def get_memory_tags(self) -> Any:
        """What LMCache's prefetch controller filters L2 adapters by (0.5.7:
        one tag pair per adapter): ``STORAGE``, and ``LOCAL`` with a warm tier
        only, ``REMOTE`` once a cold tier is set. A cold tier is off this host
        or shared by hosts by design, and its hits come through this adapter:
        a caller that admits ``LOCAL`` only must not get them (it loses the
        warm hits then, as with LMCache's own fs adapters when ``shared``)."""
        settings = self.settings
        return l2_memory_tags(
            remote=settings.cold is not None or settings.cold_adapter is not None
        )

    # ------------------------------------------------------------- event fds

    def get_store_event_fd(self) -> int:
        return self._stores.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookups.fileno()

    def get_load_event_fd(self) -> int:
        return self._loads.fileno()

    # ---------------------------------------------------------------- submit

    def _submit(
        self,
        worker: BatchWorker[Task] | BatchWorker[LookupJob],
        keys: list[ObjectKey],
        objects: list[MemoryObj],
    ) -> L2TaskId:
        with self._lock:
            if self._closed:
                raise RuntimeError("TieredL2Adapter is closed")
            task_id = self._next_task_id
            self._next_task_id += 1
            # queued under the lock, so close() stops the workers after it
            worker.put(Task(task_id, list(keys), list(objects)))
        return task_id

    def submit_store_task(
        self, keys: list[ObjectKey], objects: list[MemoryObj]
    ) -> L2TaskId:
        if len(objects) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        return self._submit(self._stores.worker, keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._stores.pop_all()

    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc],
    ) -> L2TaskId:
        return self._submit(self._lookups.worker, keys, [])

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._lookups.pop(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Queued behind earlier lookups, so it always follows their locks."""
        with self._lock:
            if not self._closed:
                self._lookups.worker.put(Unlock(list(keys)))

    def submit_touch(self, keys: list[ObjectKey]) -> None:
        """Refresh ``keys`` (held by LMCache's L1, some maybe by us too) for
        eviction, ours and LMCache's, without I/O. LMCache calls this on its
        lookup path: listeners hear of it here, as the base class does; our
        tiers and the warm-up policy on the lookup thread."""
        self._notify_keys_accessed(keys)
        with self._lock:
            if not self._closed:
                self._lookups.worker.put(Touch(list(keys)))

    def submit_load_task(
        self, keys: list[ObjectKey], objects: list[MemoryObj]
    ) -> L2TaskId:
        if len(objects) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        return self._submit(self._loads.worker, keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._loads.pop(task_id)

    # ---------------------------------------------------------------- stores

    def _run_stores(self, tasks: list[Task]) -> None:
        try:
            results = self._store(tasks)
        except Exception:
            logger.exception(
                "lmcache_tiered: L2 store of %d task(s) failed", len(tasks)
            )
            results = {t.task_id: L2StoreResult(False, 0) for t in tasks}
        self._stores.publish(results)

    def _store(self, tasks: list[Task]) -> dict[L2TaskId, L2StoreResult]:
        """Write all tasks' new chunks in one batch, synchronously: a task is
        reported only once they are written, and succeeds when every one of
        its chunks is stored (now or before)."""
        views = [[borrow(obj) for obj in task.objects] for task in tasks]
        sizes = [view.get_size() for row in views for view in row if view]
        if self.cache is None and sizes:
            logger.info(
                "lmcache_tiered: L2 slot size %d bytes, from the first store "
                "(set slot_mb to choose it)",
                max(sizes),
            )
            self._open_cache(max(sizes))
        cache = self.cache
        if cache is None:
            return {t.task_id: L2StoreResult(False, 0) for t in tasks}
        return store_tasks(cache, tasks, views)

    # --------------------------------------------------------------- lookups

    def _run_lookups(self, jobs: list[LookupJob]) -> None:
        """Lookups, unlocks and touches in the order submitted: pins are in
        memory."""
        found: dict[L2TaskId, Bitmap] = {}
        for job in jobs:
            cache = self.cache
            if isinstance(job, Unlock):
                if cache is not None:
                    for key in job.keys:
                        cache.unpin(key)
                continue
            bitmap = Bitmap(len(job.keys))
            if cache is not None:
                lookup(cache, job.keys, bitmap, pin=isinstance(job, Task))
            if isinstance(job, Task):
                found[job.task_id] = bitmap
        if found:
            self._lookups.publish(found)

    # ----------------------------------------------------------------- loads

    def _run_loads(self, tasks: list[Task]) -> None:
        bitmaps = {t.task_id: Bitmap(len(t.keys)) for t in tasks}
        try:
            self._load(tasks, bitmaps)
        except Exception:
            logger.exception("lmcache_tiered: L2 load of %d task(s) failed", len(tasks))
            bitmaps = {t.task_id: Bitmap(len(t.keys)) for t in tasks}
        self._loads.publish(bitmaps)

    def _load(self, tasks: list[Task], bitmaps: dict[L2TaskId, Bitmap]) -> None:
        """Read all tasks' chunks straight into the caller's buffers, in one
        cache read; the listeners hear which were loaded."""
        if self.cache is not None and (
            loaded := load_tasks(self.cache, tasks, bitmaps)
        ):
            self._notify_keys_accessed(loaded)

    # ------------------------------------------------------------- eviction

    def delete(self, keys: list[ObjectKey]) -> None:
        """Forget ``keys`` in every tier (LMCache's L2 eviction calls this);
        listeners hear of it from the ledger
        (:mod:`lmcache_tiered.integration.l2_ledger`)."""
        cache = self.cache
        if cache is not None:
            for key in keys:
                cache.remove(key)

    # ---------------------------------------------------------------- status

    def report_status(self) -> dict[str, Any]:
        cache = self.cache
        counters = {} if cache is None else cache.snapshot()
        return {
            "is_healthy": not self._closed
            and all(c.worker.is_alive() for c in self._channels()),
            "type": type(self).__name__,
            "tiers": {
                name: {
                    "paths": list(t.paths),
                    "engine": t.engine_name,
                    "direct_io": t.direct_io,
                    **counters["tiers"][name],
                }
                for name, t in ({} if cache is None else cache.tiers).items()
            },
            "warmup": counters.get("warmup"),
            "admission": counters.get("admission"),
        }

    def _channels(self) -> list[Channel[Any, Any]]:
        return [self._stores, self._lookups, self._loads]

    def close(self) -> None:
        """Finish every accepted task, then release the cache and event fds;
        bounded: stores get the writer's flush time, lookups and loads
        :data:`~lmcache_tiered.io.base.CLOSE_WAIT_S` (a hung drive must not
        hang the server's shutdown)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        waits = (writer.EXIT_FLUSH_S + CLOSE_WAIT_S, CLOSE_WAIT_S, CLOSE_WAIT_S)
        for channel, wait in zip(self._channels(), waits, strict=True):
            if not channel.worker.stop(wait):
                logger.warning(
                    "lmcache_tiered: %s still busy after %.0f s at close (a "
                    "drive stuck in I/O?); closing without it",
                    channel.worker.name,
                    wait,
                )
        self._stall_watch.stop()
        if self.cache is not None:
            collector().remove_source(self._metrics_label)
            self.cache.close()
        for hold in self._holds.values():
            hold.release()
        for channel in self._channels():
            channel.events.close()
