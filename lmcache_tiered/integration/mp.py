"""TieredL2Adapter: the tiered cache as an L2 adapter of LMCache's
multi-process server (``lmcache server``).

Enable it on the server's command line::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "lmcache_tiered.mp", "class_name": "TieredL2Adapter",
        "adapter_params": {"warm.paths": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"],
                           "warm.capacity_gb": 500}}'

``adapter_params`` take the YAML path's ``tiered.*`` settings by the same
names, without the prefix; they are parsed by the same
:meth:`TieredConfig.from_extra_config`. LMCache finds
:class:`TieredL2AdapterConfig` by its name (class name + ``Config``) and
builds it in the server, where a bad setting (the warm-up policy and its
parameters included) stops the start-up with a clear error instead of a
silently missing tier.

The adapter runs on the same :class:`~lmcache_tiered.cache.tiered_cache.TieredCache` as
the in-process plugin: warm and cold tiers, write-back demotion (or
write-through), the cold tier shared by several hosts, the warm-up policy and
its promoter. This module only translates LMCache's L2 protocol
(``lmcache/v1/distributed/l2_adapters/base.py``, lmcache 0.5.6 and 0.5.7)
into cache calls:

* Keys are ``ObjectKey``; the tiers store them under their canonical text
  (:func:`lmcache_tiered.keys.key_text`), so a restarted server serves them.
* Buffers belong to LMCache's L1 and stay theirs: the tiers read into and
  write from a flat byte view of each object (:func:`borrow`), never keeping
  a reference nor changing its count. A store task is reported done only
  once its chunks are written (payload, then header); a cold hit is copied
  out of the caller's buffer before the load is reported, for its copy to
  warm.
* Work runs on three threads (store, lookup/unlock, load:
  :class:`lmcache_tiered.cache.writer.BatchWorker`), so a long store batch never
  delays a lookup, and a load's reads go to the devices before the stores'
  writes (the I/O engines start reads first); each thread takes every task
  queued so far as one cache call, so one call's I/O keeps all devices busy,
  stores up to :data:`~lmcache_tiered.cache.writer.WRITE_BATCH_BYTES` a
  call: LMCache keeps a store task's L1 objects locked until it is reported,
  so a backlog is released as it is written, not all at its end. A
  thread signals the operation's event fd once the results it produced are
  queryable; ``submit_*`` calls only queue.
* Lookup-and-lock pins each chunk found in the tier that holds it (a pinned
  chunk is never evicted); unlock unpins. Lookups are the warm-up policy's
  signal, one call per row of keys (model, kv rank, object group, salt:
  one prefix chain), and stores teach it the chains; there is no LMCache
  CPU tier below the adapter, so promotions go to warm.
* Touches (lmcache 0.5.7: the prefixes LMCache's L1 already holds, at each
  lookup and at each request's end) are lookups without pins, queued on the
  lookup thread: they keep those chunks recent in our tiers and reach the
  warm-up policy, so a prefix served from L1 is neither evicted from warm
  nor unknown to the policy when L1 drops it.
* LMCache's listeners and usage counters see a chunk as stored while some
  tier of ours holds it: a demotion to cold is no deletion, a chunk that
  leaves its last tier (eviction, bad record, ``delete``) is one. Each chunk
  is charged one warm slot on disk. That record, and the key listing, are
  :class:`lmcache_tiered.integration.l2_ledger.L2Ledger`'s, the adapter's base class.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
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
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import (
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.platform import create_event_notifier

from lmcache_tiered._lmcache import l2_memory_tags
from lmcache_tiered.cache import writer
from lmcache_tiered.cache.tiered_cache import (
    EmptyView,
    TieredCache,
    load_configured_policy,
    tier_owner,
)
from lmcache_tiered.cache.writer import BatchWorker
from lmcache_tiered.config import PREFIX, SETTINGS, ConfigError, TieredConfig
from lmcache_tiered.integration.l2_ledger import L2Ledger
from lmcache_tiered.storage.base import StorageTier
from lmcache_tiered.storage.layout import TierNames, read_superblock
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.tierfiles import open_tier_file, take_lock

logger = logging.getLogger("lmcache_tiered")

#: File owner name of the adapter's tiers: one server process per host owns
#: them, holding every kv rank (the in-process plugin's are ``kv-w<worker>``).
OWNER = "kv-mp"


class TieredL2AdapterConfig(L2AdapterConfigBase):
    """The adapter's ``adapter_params``: the ``tiered.*`` settings, no prefix."""

    def __init__(self, settings: TieredConfig) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TieredL2AdapterConfig:
        """Parse ``adapter_params``; names copied with the prefix also work."""
        extra = {k if k.startswith(PREFIX) else PREFIX + k: v for k, v in d.items()}
        try:
            settings = TieredConfig.from_extra_config(extra)
            # Built and dropped to check the policy's name and parameters now:
            # the real one is built when the tiers open, maybe at the first
            # store (when the slot size is known), long after start-up.
            load_configured_policy(settings, EmptyView())
            return cls(settings)
        except ConfigError as exc:
            # name settings as the user wrote them: without the prefix
            text = re.sub(rf"(?<![\w/.]){re.escape(PREFIX)}", "", str(exc))
            raise ConfigError(f"TieredL2Adapter adapter_params: {text}") from None

    @classmethod
    def help(cls) -> str:
        lines = [f"- {name}: {setting.help}" for name, setting in SETTINGS.items()]
        head = "TieredL2Adapter adapter_params (the YAML's tiered.* settings):"
        return "\n".join([head, *lines])


def borrow(obj: MemoryObj) -> TensorMemoryObj | None:
    """A flat ``uint8`` MemoryObj over ``obj``'s memory, or None if it is not
    contiguous CPU memory.

    The tier records the view's shape and dtype; the view has no allocator,
    so the caller's object is never freed or changed in count. Multi-group L1
    objects (whose ``get_shape()`` is only the first group's) are stored as
    plain bytes of their full size.
    """
    raw = getattr(obj, "raw_data", None)
    if not isinstance(raw, torch.Tensor) or raw.device.type != "cpu":
        return None
    if not raw.is_contiguous():
        return None
    data = raw.view(-1).view(torch.uint8)
    size = obj.get_size()
    meta = MemoryObjMetadata(
        shape=torch.Size([size]),
        dtype=torch.uint8,
        address=0,
        phy_size=data.numel(),
        ref_count=1,
        fmt=obj.get_memory_format(),
    )
    return TensorMemoryObj(data, meta, parent_allocator=None)


def recorded_slot_bytes(path: str) -> int | None:
    """Slot size the adapter's tier under ``path`` was formatted with, if any:
    the default when ``slot_mb`` is not set, so a restart keeps its data."""
    geometry = read_superblock(TierNames((path,), OWNER).header)
    return None if geometry is None else geometry.max_payload


@dataclass(slots=True)
class _Task:
    """One submitted store, lookup-and-lock or load task."""

    task_id: L2TaskId
    keys: list[ObjectKey]
    objects: list[MemoryObj]


@dataclass(slots=True)
class _Unlock:
    """An unlock: no task id, no result."""

    keys: list[ObjectKey]


@dataclass(slots=True)
class _Touch:
    """A touch: a lookup without pins, no task id, no result."""

    keys: list[ObjectKey]


#: what the lookup thread runs, in the order submitted
_LookupJob = _Task | _Unlock | _Touch


def _rows(keys: Sequence[ObjectKey]) -> list[range]:
    """Index ranges of the runs of ``keys`` with one model, kv rank, object
    group and salt. LMCache puts a request's rows (one per object group and
    kv rank) into one task; each row is a prefix chain of its own."""
    rows: list[range] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or _row_of(keys[i]) != _row_of(keys[start]):
            rows.append(range(start, i))
            start = i
    return rows


def _row_of(key: ObjectKey) -> tuple[str, int, int, str]:
    return key.model_name, key.kv_rank, key.object_group_id, key.cache_salt


def capacity_bytes(settings: TieredConfig) -> int:
    """Most bytes of distinct chunks the tiers hold, as LMCache's usage counts
    them (each chunk once): with write-through warm only holds copies."""
    warm = settings.warm.capacity_bytes
    cold = 0 if settings.cold is None else settings.cold.capacity_bytes
    return max(warm, cold) if settings.cold_write_through else warm + cold


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
        if not isinstance(config, TieredL2AdapterConfig):
            config = TieredL2AdapterConfig.from_dict(dict(config))
        settings = config.settings
        super().__init__(max_capacity_bytes=capacity_bytes(settings))
        self.settings = settings
        self._l1_memory_desc = l1_memory_desc
        #: None until the slot size is known (see _open_cache)
        self.cache = None
        #: the tiers' lock files, held until the tiers open (_hold_directories)
        self._held: list[int] = []
        slot = settings.slot_bytes or recorded_slot_bytes(settings.warm.paths[0])
        if slot is not None:
            self._open_cache(slot)
        else:
            self._held = self._hold_directories()
        self._lock = threading.Lock()
        self._closed = False
        self._next_task_id: L2TaskId = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._stores_worker = BatchWorker[_Task](
            "lmcache-tiered-l2-store",
            self._run_stores,
            weigh=lambda task: sum(obj.get_size() for obj in task.objects),
            max_weight=writer.WRITE_BATCH_BYTES,
        )
        self._lookups_worker = BatchWorker[_LookupJob](
            "lmcache-tiered-l2-lookup", self._run_lookups
        )
        self._loads_worker = BatchWorker[_Task](
            "lmcache-tiered-l2-load", self._run_loads
        )
        if settings.hint_port >= 0:
            logger.warning(
                "lmcache_tiered: warmup.hint_port is ignored by TieredL2Adapter: "
                "LMCache's server sends no arrival hints; lookups and touches "
                "drive warm-up (a router can POST the server's /cache/prefetches)"
            )
        logger.info(
            "lmcache_tiered: TieredL2Adapter ready: %s; warm-up policy %s",
            ", ".join(
                f"{t.name} {len(t.paths)} path(s), {len(t)} chunks, "
                f"engine {t.engine_name}, O_DIRECT {t.direct_io}"
                for t in self.tiers
            )
            or "tiers open at the first store (slot size from its objects)",
            settings.warmup_policy,
        )

    # ---------------------------------------------------------------- tiers

    @property
    def tiers(self) -> list[StorageTier]:
        """Our tiers, warm first; empty until the slot size is known."""
        cache = self.cache
        return [] if cache is None else list(cache.tiers.values())

    def _hold_directories(self) -> list[int]:
        """Lock the tiers' lock files now, though the tiers open only at the
        first store (when the slot size is known): a second server on these
        directories is refused at its start, naming the holder, instead of
        starting healthy and failing every store."""
        held: list[int] = []
        try:
            for tier in (self.settings.warm, self.settings.cold):
                if tier is None:
                    continue
                owner = tier_owner(tier.name, OWNER, self.settings)
                name = TierNames(tier.paths, owner).lock
                setting = f"{PREFIX}{tier.name}.paths"
                flags = os.O_RDWR | os.O_CREAT
                held.append(
                    open_tier_file(name, flags, self.settings.file_mode, setting)
                )
                take_lock(held[-1], setting, name)
        except BaseException:
            self._release_directories(held)
            raise
        return held

    @staticmethod
    def _release_directories(held: list[int]) -> None:
        for fd in held:
            os.close(fd)
        held.clear()

    def _open_cache(self, max_payload: int) -> None:
        """Open the cache, its tiers with slots of ``max_payload`` bytes (they
        take over the locks :meth:`_hold_directories` held)."""
        self._release_directories(self._held)
        cache = TieredCache(
            self.settings,
            owner=OWNER,
            max_payload=max_payload,
            local_workers=1,
            hot=None,  # LMCache's L1 is above us; loads bring their buffers
        )
        desc = self._l1_memory_desc
        if desc is not None and desc.stable_registration_size:
            # LMCache says the L1 arena stays put: fixed buffers for loads
            cache.register_memory(desc.ptr, desc.stable_registration_size)
        self._follow(cache)
        self.cache = cache

    def get_memory_tags(self) -> Any:
        """What LMCache's prefetch controller filters L2 adapters by
        (lmcache 0.5.7, ``lmcache/v1/distributed/api.py``: one tag pair per
        adapter, compared for equality): ``STORAGE`` always (NVMe, neither
        host memory nor GPUDirect); ``LOCAL`` with a warm tier only, ``REMOTE``
        once a cold tier (files or a store) is set. A cold tier is by design
        off this host or shared with other hosts (NVMe-oF, a shared file
        system, a store: read by every host that names it), which the API
        defines as ``REMOTE``, and its hits
        are served through this same adapter: a caller that admits ``LOCAL``
        only must not get them. It does lose the warm hits then, as it would
        with LMCache's own fs and raw-block adapters when ``shared``."""
        settings = self.settings
        return l2_memory_tags(
            remote=settings.cold is not None or settings.cold_adapter is not None
        )

    # ------------------------------------------------------------- event fds

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # ---------------------------------------------------------------- submit

    def _submit(
        self,
        worker: BatchWorker[_Task] | BatchWorker[_LookupJob],
        keys: list[ObjectKey],
        objects: list[MemoryObj],
    ) -> L2TaskId:
        with self._lock:
            if self._closed:
                raise RuntimeError("TieredL2Adapter is closed")
            task_id = self._next_task_id
            self._next_task_id += 1
            # queued under the lock, so close() stops the workers after it
            worker.put(_Task(task_id, list(keys), list(objects)))
        return task_id

    def submit_store_task(
        self, keys: list[ObjectKey], objects: list[MemoryObj]
    ) -> L2TaskId:
        if len(objects) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        return self._submit(self._stores_worker, keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc],
    ) -> L2TaskId:
        return self._submit(self._lookups_worker, keys, [])

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Queued behind earlier lookups, so it always follows their locks."""
        with self._lock:
            if not self._closed:
                self._lookups_worker.put(_Unlock(list(keys)))

    def submit_touch(self, keys: list[ObjectKey]) -> None:
        """Refresh ``keys`` (held by LMCache's L1, some maybe by us too) for
        eviction, ours and LMCache's, without I/O. LMCache calls this on its
        lookup path: listeners hear of it here, as the base class does; our
        tiers and the warm-up policy on the lookup thread."""
        self._notify_keys_accessed(keys)
        with self._lock:
            if not self._closed:
                self._lookups_worker.put(_Touch(list(keys)))

    def submit_load_task(
        self, keys: list[ObjectKey], objects: list[MemoryObj]
    ) -> L2TaskId:
        if len(objects) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        return self._submit(self._loads_worker, keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    # ---------------------------------------------------------------- stores

    def _run_stores(self, tasks: list[_Task]) -> None:
        try:
            results = self._store(tasks)
        except Exception:
            logger.exception(
                "lmcache_tiered: L2 store of %d task(s) failed", len(tasks)
            )
            results = {t.task_id: L2StoreResult(False, 0) for t in tasks}
        with self._lock:
            self._stores.update(results)
        self._store_efd.notify()

    def _store(self, tasks: list[_Task]) -> dict[L2TaskId, L2StoreResult]:
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
        # the policy sees each row as a chain, and picks what to write
        chosen = [[False] * len(task.keys) for task in tasks]
        for task, picks in zip(tasks, chosen, strict=True):
            for row in _rows(task.keys):
                new = cache.select_new(task.keys[row.start : row.stop])
                for i, pick in zip(row, new, strict=True):
                    picks[i] = pick
        plan = [
            (n, i, view)
            for n, (picks, task_views) in enumerate(zip(chosen, views, strict=True))
            for i, view in enumerate(task_views)
            if picks[i] and view is not None
        ]
        payloads = [Payload.of(tasks[n].keys[i], view) for n, i, view in plan]
        stored = cache.store(payloads) if payloads else []
        ok = [[False] * len(task.keys) for task in tasks]
        written = [0] * len(tasks)
        for (n, i, view), good in zip(plan, stored, strict=True):
            ok[n][i] = good
            written[n] += view.get_size() if good else 0
        for task, picks, task_views, flags in zip(
            tasks, chosen, views, ok, strict=True
        ):
            for i, key in enumerate(task.keys):
                if not picks[i] and task_views[i] is not None:
                    # stored before, or refused by the policy's admission
                    flags[i] = cache.tier_of(key) is not None
        return {
            task.task_id: L2StoreResult(all(flags), size)
            for task, flags, size in zip(tasks, ok, written, strict=True)
        }

    # --------------------------------------------------------------- lookups

    def _run_lookups(self, jobs: list[_LookupJob]) -> None:
        """Lookups, unlocks and touches in the order submitted: pins are in
        memory."""
        found: dict[L2TaskId, Bitmap] = {}
        for job in jobs:
            cache = self.cache
            if isinstance(job, _Unlock):
                if cache is not None:
                    for key in job.keys:
                        cache.unpin(key)
                continue
            bitmap = Bitmap(len(job.keys))
            if cache is not None:
                self._lookup(cache, job.keys, bitmap, pin=isinstance(job, _Task))
            if isinstance(job, _Task):
                found[job.task_id] = bitmap
        if found:
            with self._lock:
                self._lookups.update(found)
            self._lookup_efd.notify()

    @staticmethod
    def _lookup(
        cache: TieredCache, keys: list[ObjectKey], bitmap: Bitmap, pin: bool
    ) -> None:
        """Look up (and pin) ``keys`` row by row (each row a chain the policy
        sees); a failure is logged and the rest count as misses."""
        try:
            for row in _rows(keys):
                held = cache.lookup(keys[row.start : row.stop], pin=pin)
                for i, hit in zip(row, held, strict=True):
                    if hit:
                        bitmap.set(i)
        except Exception:
            logger.exception("lmcache_tiered: L2 lookup failed")

    # ----------------------------------------------------------------- loads

    def _run_loads(self, tasks: list[_Task]) -> None:
        bitmaps = {t.task_id: Bitmap(len(t.keys)) for t in tasks}
        try:
            self._load(tasks, bitmaps)
        except Exception:
            logger.exception("lmcache_tiered: L2 load of %d task(s) failed", len(tasks))
            bitmaps = {t.task_id: Bitmap(len(t.keys)) for t in tasks}
        with self._lock:
            self._loads.update(bitmaps)
        self._load_efd.notify()

    def _load(self, tasks: list[_Task], bitmaps: dict[L2TaskId, Bitmap]) -> None:
        """Read all tasks' chunks straight into the caller's buffers, in one
        cache read (warm, then cold, then other hosts' shared cold files)."""
        cache = self.cache
        if cache is None:
            return
        cells = [(task, i) for task in tasks for i in range(len(task.keys))]
        objs = cache.read(
            [task.keys[i] for task, i in cells],
            into=[borrow(task.objects[i]) for task, i in cells],
        )
        loaded: list[ObjectKey] = []
        for (task, i), obj in zip(cells, objs, strict=True):
            if obj is not None:
                bitmaps[task.task_id].set(i)
                loaded.append(task.keys[i])
        if loaded:
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
            and all(w.is_alive() for w in self._all_workers()),
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
        }

    def _all_workers(self) -> list[BatchWorker[_Task] | BatchWorker[_LookupJob]]:
        return [self._stores_worker, self._lookups_worker, self._loads_worker]

    def close(self) -> None:
        """Finish every accepted task, then release the cache and event fds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for worker in self._all_workers():
            worker.stop()
        if self.cache is not None:
            self.cache.close()
        self._release_directories(self._held)
        for notifier in (self._store_efd, self._lookup_efd, self._load_efd):
            notifier.close()
