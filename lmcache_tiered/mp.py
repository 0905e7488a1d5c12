"""TieredL2Adapter: the striped tiers as an L2 adapter of LMCache's
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
builds it in the server, where a bad setting stops the start-up with a clear
error instead of a silently missing tier.

The same :class:`~lmcache_tiered.tier.Tier` code serves both plugin paths;
this module only translates LMCache's L2 protocol (lmcache 0.5.6,
``lmcache/v1/distributed/l2_adapters/base.py``) into tier calls:

* Keys are ``ObjectKey``; the tiers store them under their canonical text
  (:func:`lmcache_tiered.keys.key_text`), so a restarted server serves them.
* Buffers belong to LMCache's L1 and stay theirs: the tiers read into and
  write from a flat byte view of each object (:func:`borrow`), never taking
  or dropping a reference.
* Work runs on three threads (store, lookup/unlock, load), so a long store
  batch never delays a lookup or a load; each thread takes every task queued
  so far as one tier call, so one call's I/O keeps all devices busy. A thread
  signals the operation's event fd once the results it produced are
  queryable; ``submit_*`` calls only queue.
* Lookup-and-lock pins chunks in the tier (a pinned chunk is never evicted);
  unlock unpins. The tier evicts by LRU on its own when full: evictions, bad
  records and ``delete`` reach LMCache's listeners and usage counters, each
  chunk charged one slot on disk.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import re
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import (
    L1MemoryDesc,
    L2AdapterListener,
    L2StoreResult,
)
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import (
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.platform import create_event_notifier

from lmcache_tiered.config import PREFIX, SETTINGS, ConfigError, TieredConfig
from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.layout import HEADER_SIZE, Geometry, RecordHeader
from lmcache_tiered.tier import Tier

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
            return cls(TieredConfig.from_extra_config(extra))
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

    The tier records the object's shape and dtype and drops its reference on a
    failed read; the view has neither an allocator nor a real reference, so
    the caller's object is never freed or changed in count. Multi-group L1
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
    try:
        with open(os.path.join(path, f"{OWNER}.hdr"), "rb") as f:
            block = f.read(HEADER_SIZE)
    except FileNotFoundError:
        return None
    geometry = Geometry.decode_superblock(block)
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


_Job = TypeVar("_Job")


class _Worker(Generic[_Job]):
    """A thread that hands every job queued so far to ``handle`` as one batch.

    ``stop`` lets it finish what is queued, so no accepted task is left
    without a result.
    """

    def __init__(self, name: str, handle: Callable[[list[_Job]], None]) -> None:
        self._handle = handle
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: _Job) -> None:
        self._queue.put(job)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get())
            batch = [job for job in jobs if job is not None]
            if batch:
                try:
                    self._handle(batch)
                except Exception:  # the handlers publish their own failures
                    logger.exception("lmcache_tiered: %s failed", self._thread.name)
            if len(batch) < len(jobs):
                return


class TieredL2Adapter(L2AdapterInterface):
    """Striped NVMe tiers behind LMCache's ``L2AdapterInterface``.

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
        levels = [t for t in (settings.warm, settings.cold) if t is not None]
        super().__init__(max_capacity_bytes=sum(t.capacity_bytes for t in levels))
        self.settings = settings
        self._l1_memory_desc = l1_memory_desc
        #: warm first; empty until the slot size is known (see _open_tiers)
        self.tiers: list[Tier] = []
        slot = settings.slot_bytes or recorded_slot_bytes(settings.warm.paths[0])
        if slot is not None:
            self._open_tiers(slot)
        self._lock = threading.Lock()
        self._closed = False
        self._next_task_id: L2TaskId = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._stores_worker = _Worker[_Task](
            "lmcache-tiered-l2-store", self._run_stores
        )
        self._lookups_worker = _Worker[_Task | _Unlock](
            "lmcache-tiered-l2-lookup", self._run_lookups
        )
        self._loads_worker = _Worker[_Task]("lmcache-tiered-l2-load", self._run_loads)
        if settings.cold is not None:
            logger.warning(
                "lmcache_tiered: TieredL2Adapter reads the cold tier but does not "
                "write it yet: stores go to the warm tier only"
            )
        logger.info(
            "lmcache_tiered: TieredL2Adapter ready: %s",
            ", ".join(
                f"{t.name} {len(t.paths)} path(s), {len(t)} chunks, "
                f"engine {t.engine.name}, O_DIRECT {t.direct_io}"
                for t in self.tiers
            )
            or "tiers open at the first store (slot size from its objects)",
        )

    # ---------------------------------------------------------------- tiers

    def _open_tiers(self, max_payload: int) -> None:
        """Open every configured tier with slots of ``max_payload`` bytes."""
        tiers: list[Tier] = []
        try:
            for level in (self.settings.warm, self.settings.cold):
                if level is not None:
                    tiers.append(
                        Tier(
                            level,
                            self.settings,
                            owner=OWNER,
                            max_payload=max_payload,
                            capacity_bytes=level.capacity_bytes,
                        )
                    )
        except Exception:
            for tier in tiers:
                tier.close()
            raise
        for tier in tiers:
            self._register_l1(tier)
            tier.on_evict = self._evicted_from(tier)
        recovered = [(k, t) for t in tiers for k in t.stored_keys()]
        with self._usage_lock:  # seeded quietly, as LMCache's raw-block adapter
            for key, tier in recovered:
                if not isinstance(key, ObjectKey):
                    continue
                charge = self._charge(tier)
                self._total_bytes_used += charge
                salts = self._bytes_by_cache_salt
                salts[key.cache_salt] = salts.get(key.cache_salt, 0) + charge
        self.tiers = tiers

    def _register_l1(self, tier: Tier) -> None:
        """Register LMCache's L1 arena with an io_uring engine (fixed buffers:
        no page pinning per read) where LMCache says the range is stable."""
        desc = self._l1_memory_desc
        register = getattr(tier.engine, "register_buffers", None)
        if desc is None or not desc.stable_registration_size or register is None:
            return
        arena = (ctypes.c_ubyte * desc.stable_registration_size).from_address(desc.ptr)
        register([memoryview(arena)])

    @staticmethod
    def _charge(tier: Tier) -> int:
        """Bytes a chunk counts for in LMCache's usage: one slot on disk."""
        return tier.geometry.slot_disk_bytes

    def _evicted_from(self, tier: Tier) -> Callable[[list[StoreKey]], None]:
        def evicted(keys: list[StoreKey]) -> None:
            self._deleted([(k, self._charge(tier)) for k in keys])

        return evicted

    def _deleted(self, charges: Sequence[tuple[StoreKey, int]]) -> None:
        """Tell LMCache's listeners and usage counters that chunks are gone."""
        gone = [(k, c) for k, c in charges if isinstance(k, ObjectKey)]
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [c for _, c in gone])

    # ------------------------------------------------------------- event fds

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ---------------------------------------------------------------- submit

    def _submit(
        self,
        worker: _Worker[_Task] | _Worker[_Task | _Unlock],
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
        """Write all tasks' chunks in one batch; a task succeeds when every
        one of its chunks is stored (now or before)."""
        views = [[borrow(obj) for obj in task.objects] for task in tasks]
        plan = [
            (n, key, view)
            for n, (task, row) in enumerate(zip(tasks, views, strict=True))
            for key, view in zip(task.keys, row, strict=True)
            if view is not None
        ]
        if not self.tiers and plan:
            slot = max(view.get_size() for _, _, view in plan)
            logger.info(
                "lmcache_tiered: L2 slot size %d bytes, from the first store "
                "(set slot_mb to choose it)",
                slot,
            )
            self._open_tiers(slot)
        ok = [None not in row and bool(self.tiers) for row in views]
        written = [0] * len(tasks)
        if self.tiers and plan:
            warm = self.tiers[0]
            fresh = {key_digest(k) for _, k, _ in plan if warm.header(k) is None}
            stored = warm.write([(key, view) for _, key, view in plan])
            new_keys: list[ObjectKey] = []
            for (n, key, view), good in zip(plan, stored, strict=True):
                if not good:
                    ok[n] = False
                elif key_digest(key) in fresh:
                    fresh.discard(key_digest(key))
                    new_keys.append(key)
                    written[n] += view.get_size()
            if new_keys:
                charges = [self._charge(warm)] * len(new_keys)
                self._notify_keys_stored(new_keys, charges)
        return {
            task.task_id: L2StoreResult(good, size)
            for task, good, size in zip(tasks, ok, written, strict=True)
        }

    # --------------------------------------------------------------- lookups

    def _run_lookups(self, jobs: list[_Task | _Unlock]) -> None:
        """Lookups and unlocks in the order submitted: pins are in memory."""
        found: dict[L2TaskId, Bitmap] = {}
        for job in jobs:
            if isinstance(job, _Unlock):
                for key in job.keys:
                    any(tier.unpin(key) for tier in self.tiers)
                continue
            bitmap = Bitmap(len(job.keys))
            # tails first: the prefix's heads end up the most recently used
            for i in reversed(range(len(job.keys))):
                if any(tier.contains(job.keys[i], pin=True) for tier in self.tiers):
                    bitmap.set(i)
            found[job.task_id] = bitmap
        if found:
            with self._lock:
                self._lookups.update(found)
            self._lookup_efd.notify()

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
        """Read all tasks' chunks straight into the caller's buffers, each
        tier in turn taking the ones still missing as one batch."""
        cells = [
            (task, i, view)
            for task in tasks
            for i, view in enumerate(borrow(obj) for obj in task.objects)
            if view is not None
        ]
        loaded: list[ObjectKey] = []
        for tier in self.tiers:
            if not cells:
                break
            got, dropped = self._read(tier, [(t.keys[i], v) for t, i, v in cells])
            for (task, i, _), ok in zip(cells, got, strict=True):
                if ok:
                    bitmaps[task.task_id].set(i)
                    loaded.append(task.keys[i])
            self._deleted([(key, self._charge(tier)) for key in dropped])
            cells = [cell for cell, ok in zip(cells, got, strict=True) if not ok]
        if loaded:
            self._notify_keys_accessed(loaded)

    @staticmethod
    def _read(
        tier: Tier, wanted: list[tuple[ObjectKey, TensorMemoryObj]]
    ) -> tuple[list[bool], list[StoreKey]]:
        """One tier read of ``wanted`` into its buffers: per key whether it was
        read, and the keys the tier dropped as bad records."""
        free: dict[bytes, deque[TensorMemoryObj]] = {}
        for key, view in wanted:
            free.setdefault(key_digest(key), deque()).append(view)
        given: dict[int, StoreKey] = {}

        def allocate(header: RecordHeader) -> MemoryObj | None:
            """The caller's buffer for this key (repeated keys take theirs in
            order), if the record fills it exactly."""
            view = free[key_digest(header.key)].popleft()
            if header.payload_size != view.get_size():
                return None
            given[id(view)] = header.key
            return view

        got = [obj is not None for obj in tier.read([k for k, _ in wanted], allocate)]
        # a buffer handed out but not filled: the record failed its checks
        bad = [
            given[id(view)]
            for (_, view), ok in zip(wanted, got, strict=True)
            if not ok and id(view) in given
        ]
        return got, bad

    # ------------------------------------------------------------- eviction

    def delete(self, keys: list[ObjectKey]) -> None:
        """Forget ``keys`` in every tier (LMCache's L2 eviction calls this)."""
        removed: list[tuple[StoreKey, int]] = []
        for key in keys:
            charge = sum(self._charge(t) for t in self.tiers if t.remove(key))
            if charge:
                removed.append((key, charge))
        self._deleted(removed)

    def register_listener(self, listener: L2AdapterListener) -> None:
        """Register ``listener`` and tell it of the chunks already stored
        (recovered after a restart), as LMCache's raw-block adapter does."""
        super().register_listener(listener)
        for tier in self.tiers:
            keys = [k for k in tier.stored_keys() if isinstance(k, ObjectKey)]
            if keys:
                listener.on_l2_keys_stored(keys, [self._charge(tier)] * len(keys))

    # ---------------------------------------------------------------- status

    def report_status(self) -> dict[str, Any]:
        return {
            "is_healthy": not self._closed
            and all(w.is_alive() for w in self._all_workers()),
            "type": type(self).__name__,
            "tiers": {
                t.name: {
                    "paths": list(t.paths),
                    "chunks": len(t),
                    "engine": t.engine.name,
                    "direct_io": t.direct_io,
                    **asdict(t.stats),
                }
                for t in self.tiers
            },
        }

    def _all_workers(self) -> list[_Worker[_Task] | _Worker[_Task | _Unlock]]:
        return [self._stores_worker, self._lookups_worker, self._loads_worker]

    def close(self) -> None:
        """Finish every accepted task, then release tiers and event fds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for worker in self._all_workers():
            worker.stop()
        for tier in self.tiers:
            tier.close()
        for notifier in (self._store_efd, self._lookup_efd, self._load_efd):
            notifier.close()
