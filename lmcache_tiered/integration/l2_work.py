"""What the L2 adapter's three threads do with the cache: LMCache's tasks as
they queue (:class:`Task`, and the lookup thread's unlocks and touches), the
channel each kind of task's results go back through (:class:`Channel`), the
caller's buffers borrowed as flat bytes (:func:`borrow`), and the store,
lookup and load of a batch of tasks, row by row (each row one prefix chain
the warm-up policy sees)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2TaskId
from lmcache.v1.memory_management import (
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.platform import create_event_notifier

from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.cache.writer import BatchWorker
from lmcache_tiered.storage.payload import Payload

logger = logging.getLogger("lmcache_tiered")


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


@dataclass(slots=True)
class Task:
    """One submitted store, lookup-and-lock or load task."""

    task_id: L2TaskId
    keys: list[ObjectKey]
    objects: list[MemoryObj]


@dataclass(slots=True)
class Unlock:
    """An unlock: no task id, no result."""

    keys: list[ObjectKey]


@dataclass(slots=True)
class Touch:
    """A touch: a lookup without pins, no task id, no result."""

    keys: list[ObjectKey]


#: what the lookup thread runs, in the order submitted
LookupJob = Task | Unlock | Touch
Job_ = TypeVar("Job_")
Result_ = TypeVar("Result_")


class Channel(Generic[Job_, Result_]):
    """One kind of operation LMCache submits: the thread that runs it, the
    results not yet asked for, and the event fd LMCache polls for them."""

    def __init__(self, lock: threading.Lock, worker: BatchWorker[Job_]) -> None:
        self.worker = worker
        self.events = create_event_notifier()
        self._lock = lock
        self._results: dict[L2TaskId, Result_] = {}

    def fileno(self) -> int:
        return int(self.events.fileno())

    def publish(self, results: Mapping[L2TaskId, Result_]) -> None:
        """Make ``results`` queryable, then signal the event fd."""
        with self._lock:
            self._results.update(results)
        self.events.notify()

    def pop(self, task_id: L2TaskId) -> Result_ | None:
        with self._lock:
            return self._results.pop(task_id, None)

    def pop_all(self) -> dict[L2TaskId, Result_]:
        with self._lock:
            done, self._results = self._results, {}
        return done


def rows(keys: Sequence[ObjectKey]) -> list[range]:
    """Index ranges of the runs of ``keys`` with one model, kv rank, object
    group and salt. LMCache puts a request's rows (one per object group and
    kv rank) into one task; each row is a prefix chain of its own."""
    rows: list[range] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or row_of(keys[i]) != row_of(keys[start]):
            rows.append(range(start, i))
            start = i
    return rows


def chains(cache: TieredCache, keys: Sequence[ObjectKey]) -> list[range]:
    """Index ranges of ``keys``, one per request's chain: each row cut where
    the lookups taught that a key follows another than the one before it
    (LMCache's server stores several requests' new chunks in one row)."""
    return [
        range(row.start + run.start, row.start + run.stop)
        for row in rows(keys)
        for run in cache.chains.runs(keys[row.start : row.stop])
    ]


def row_of(key: ObjectKey) -> tuple[str, int, int, str]:
    return key.model_name, key.kv_rank, key.object_group_id, key.cache_salt


def store_tasks(
    cache: TieredCache, tasks: list[Task], views: list[list[TensorMemoryObj | None]]
) -> dict[L2TaskId, L2StoreResult]:
    """Write all tasks' new chunks (``views``: their borrowed buffers) in one
    batch, synchronously: a task succeeds when every one of its chunks is
    stored (now or before)."""
    # the policy sees each request's chunks as a chain, and picks what to write
    chosen = [[False] * len(task.keys) for task in tasks]
    for task, picks in zip(tasks, chosen, strict=True):
        for chain in chains(cache, task.keys):
            new = cache.select_new(task.keys[chain.start : chain.stop])
            for i, pick in zip(chain, new, strict=True):
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
    for task, picks, task_views, flags in zip(tasks, chosen, views, ok, strict=True):
        for i, key in enumerate(task.keys):
            if not picks[i] and task_views[i] is not None:
                # stored before, or refused by the policy's admission
                flags[i] = cache.tier_of(key) is not None
    return {
        task.task_id: L2StoreResult(all(flags), size)
        for task, flags, size in zip(tasks, ok, written, strict=True)
    }


def lookup(
    cache: TieredCache, keys: list[ObjectKey], bitmap: Bitmap, pin: bool
) -> None:
    """Look up (and pin) ``keys`` row by row (each row a chain the policy
    sees), answering of each row's prefix of hits what the read-time
    admission admits; a failure is logged and the rest count as misses."""
    try:
        for row in rows(keys):
            chain = keys[row.start : row.stop]
            # LMCache's prefetch asks L2 for a prompt's every key, from its
            # first chunk (prefetch_controller.py, "we submit the full keys")
            held = cache.lookup(chain, pin=pin, rooted=True)
            prefix = next((i for i, h in enumerate(held) if not h), len(held))
            admitted = cache.admitted(chain, prefix, pin)
            for i, hit in zip(row, held, strict=True):
                if hit and not prefix > i - row.start >= admitted:
                    bitmap.set(i)
    except Exception:
        logger.exception("lmcache_tiered: L2 lookup failed")


def load_tasks(
    cache: TieredCache, tasks: list[Task], bitmaps: dict[L2TaskId, Bitmap]
) -> list[ObjectKey]:
    """Read all tasks' chunks straight into the caller's buffers, in one
    cache read (warm, then cold, then other hosts' shared cold files); set
    each loaded chunk's bit; the keys loaded."""
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
    return loaded
