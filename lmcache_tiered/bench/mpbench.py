"""Cold read bandwidth of the multi-process L2 adapter, through its interface.

:func:`mp_read_gbps` measures what LMCache's prefetch controller would get
from :class:`~lmcache_tiered.integration.mp.TieredL2Adapter`: load tasks submitted and
completed through the event fd, data landing in an L1-like arena that is
declared to the adapter (so io_uring reads it with registered buffers, as in
a server), after a restart and a dropped page cache, so every byte comes
from the devices with O_DIRECT.
"""

from __future__ import annotations

import logging
import math
import select
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.platform import consume_fd

from lmcache_tiered.bench.rawio import drop_page_cache
from lmcache_tiered.config import GIB, SETTINGS
from lmcache_tiered.integration.mp import TieredL2Adapter
from lmcache_tiered.io import ALIGN, aligned_buffer
from lmcache_tiered.storage.layout import Geometry

logger = logging.getLogger("lmcache_tiered")

#: Model name of the benchmark's keys: its chunks never meet real ones.
MODEL = "lmcache-tiered/mpbench"
_WAIT_MS = 60_000


class MpRead(NamedTuple):
    gbps: float
    cpu_s_per_gb: float


def mp_read_gbps(
    paths: Sequence[str],
    chunk_bytes: int,
    total_bytes: int,
    *,
    io_engine: str = "auto",
    queue_depth: int = 64,
    keys_per_task: int = 16,
    tasks_in_flight: int = 2,
    drop_caches: bool = True,
) -> MpRead:
    """Load ``total_bytes`` (whole chunks) through the adapter; GB/s (1e9 B/s)
    and this process's CPU seconds per GB over the loads.

    ``paths`` are scratch directories, one per device: the adapter's files
    there (``kv-mp.*``) are kept, and a later call with the same chunk size
    reuses the chunks instead of writing them again. Loads go as
    ``tasks_in_flight`` outstanding tasks of ``keys_per_task`` chunks each,
    like prefetches of concurrent requests; only they are timed.
    """
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
    chunks = math.ceil(total_bytes / chunk_bytes)
    keys = [
        ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name=MODEL, kv_rank=0)
        for i in range(chunks)
    ]
    window = keys_per_task * tasks_in_flight
    arena = torch.frombuffer(aligned_buffer(window * chunk_bytes), dtype=torch.uint8)
    objs = [
        _memory_obj(arena[i * chunk_bytes : (i + 1) * chunk_bytes])
        for i in range(window)
    ]
    stripe = SETTINGS["stripe_kb"].default * 1024
    slot = Geometry.plan(len(paths), stripe, chunk_bytes).slot_disk_bytes
    params = {
        "warm.paths": list(paths),
        "warm.capacity_gb": (chunks + 1) * slot / GIB,
        "slot_mb": chunk_bytes / 2**20,
        "io_engine": io_engine,
        "queue_depth": queue_depth,
    }
    _fill(TieredL2Adapter(params), keys, objs)
    if drop_caches:
        drop_page_cache()
    desc = L1MemoryDesc(arena.data_ptr(), arena.numel(), ALIGN, arena.numel())
    adapter = TieredL2Adapter(params, l1_memory_desc=desc)  # a restarted server
    try:
        groups = [keys[i : i + keys_per_task] for i in range(0, chunks, keys_per_task)]
        outstanding: deque[tuple[int, int]] = deque()  # (task id, keys)
        cpu_start = time.process_time()
        start = time.perf_counter()
        for n, group in enumerate(groups):
            # buffers of task n - tasks_in_flight, whose result came first
            first = (n % tasks_in_flight) * keys_per_task
            if len(outstanding) == tasks_in_flight:
                _finish_load(adapter, *outstanding.popleft())
            task = adapter.submit_load_task(group, objs[first : first + len(group)])
            outstanding.append((task, len(group)))
        while outstanding:
            _finish_load(adapter, *outstanding.popleft())
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    finally:
        adapter.close()
    gigabytes = chunks * chunk_bytes / 1e9
    return MpRead(gigabytes / elapsed, cpu / gigabytes)


def _memory_obj(data: torch.Tensor) -> MemoryObj:
    meta = MemoryObjMetadata(
        shape=torch.Size([data.numel()]),
        dtype=torch.uint8,
        address=data.data_ptr(),
        phy_size=data.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(data, meta, parent_allocator=None)


def _fill(
    adapter: TieredL2Adapter, keys: list[ObjectKey], objs: list[MemoryObj]
) -> None:
    """Store the chunks the adapter does not hold yet, then close it."""
    try:
        stored = set(adapter.tiers[0].stored_keys()) if adapter.tiers else set()
        missing = [k for k in keys if k not in stored]
        if missing:
            for obj in objs:
                obj.raw_data.copy_(
                    torch.randint(0, 256, obj.raw_data.shape, dtype=torch.uint8)
                )
        for i in range(0, len(missing), len(objs)):
            group = missing[i : i + len(objs)]
            task = adapter.submit_store_task(group, objs[: len(group)])
            while (result := adapter.pop_completed_store_tasks().get(task)) is None:
                _wait(adapter.get_store_event_fd())
            if not result.is_successful():
                raise RuntimeError("mpbench: storing the test chunks failed")
    finally:
        adapter.close()


def _finish_load(adapter: TieredL2Adapter, task: int, count: int) -> None:
    while (bitmap := adapter.query_load_result(task)) is None:
        _wait(adapter.get_load_event_fd())
    if bitmap.popcount() != count:
        raise RuntimeError(f"mpbench: {count - bitmap.popcount()} chunk(s) not loaded")


def _wait(fd: int) -> None:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if not poll.poll(_WAIT_MS):
        raise RuntimeError("mpbench: the adapter signalled nothing for 60 s")
    consume_fd(fd)
