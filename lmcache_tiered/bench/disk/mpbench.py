"""Cold reads and writes of multi-process L2 adapters, through LMCache's interface.

What LMCache's store and prefetch controllers get from an L2 adapter: ours
(:class:`~lmcache_tiered.integration.mp.TieredL2Adapter` over every drive) and
LMCache's own ``raw_block``, ``fs`` and ``fs_native``, on one drive or one per
drive. Each is driven the same way: store tasks, then, in every round, a
restart (new adapter objects on the same files), a dropped page cache,
lookup-and-lock and loads into an L1-like arena declared to the adapters (so
the io_uring engines register it, as in a server).

Several adapters are driven as LMCache 0.5.6 and 0.5.7rc2 drive them: their
only store policy that writes L2, ``default``, sends every key to every
adapter, and the default prefetch policy loads each key from the
lowest-indexed adapter that holds it. ``raw_block`` x N "one drive per key"
places each key on one adapter instead, as LMCache's open "striped" store
policy proposes (not in a release): the best a user could configure by
writing that policy.

Stores a cold tier can run on (``--store``: Redis through LMCache's ``resp``
adapter, Mooncake Store through our connector, any ``tiered.cold.adapter``
JSON) are driven the same way, as one adapter each: the figures of the cold
tier's own reads, without a drive. Their chunks are deleted after each
placement, leaving the store as found.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import select
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
    get_l2_adapter_config_class,
)
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.platform import consume_fd

from lmcache_tiered._lmcache import parse_l2_adapter
from lmcache_tiered.bench.common.stores import store_kind
from lmcache_tiered.bench.disk.rawio import drop_page_cache
from lmcache_tiered.config import GIB, SETTINGS
from lmcache_tiered.integration.l2_config import TieredL2AdapterConfig
from lmcache_tiered.integration.mp import TieredL2Adapter
from lmcache_tiered.io import ALIGN, aligned_buffer
from lmcache_tiered.storage.layout import Geometry
from lmcache_tiered.testing.lmcache import (
    L2_ADAPTER_MODULES,
    RUST_RAW_BLOCK_EXTENSION,
    L2AdapterDescriptor,
    StorePolicy,
    create_store_policy,
)

#: our adapter's name among the contenders
OURS = "mp_tiered"
#: Model name of the benchmark's keys: its chunks never meet real ones.
MODEL = "lmcache-tiered/mpbench"
_WAIT_MS = 60_000
#: chunks a load task carries, and load tasks outstanding at once (like the
#: prefetches of concurrent requests)
KEYS_PER_TASK, TASKS_IN_FLIGHT = 16, 2
#: times a read round loads every key. Every contender reads with O_DIRECT,
#: so each pass comes from the drives; one pass of 0.5 GB over 4 drives capped
#: at 0.4 GB/s lasts 0.3 s, and the cap's 100 ms slices (and a burst after a
#: drive idles) moved such a figure by up to 30 % (1.5-2.3 GB/s); 4 passes
#: measured 1.57-1.71
READ_PASSES = 4
#: raw_block's per-slot header and the metadata region it is given
RAW_BLOCK_HEADER, RAW_BLOCK_META = 4096, 64 << 20
RAW_BLOCK_MISSING = (
    f"raw_block needs the Rust extension {RUST_RAW_BLOCK_EXTENSION}, which is not "
    "installed (pip install --pre lmcache-rust-raw-block-io)"
)


class MpRead(NamedTuple):
    gbps: float
    cpu_s_per_gb: float


class OneAdapterPerKey(StorePolicy):
    """Each key to one adapter, chosen by its hash (the proposed "striped"
    policy). The bench's keys are sequential, so the spread is exactly even:
    the best case for it."""

    def select_store_targets(
        self, keys: list[ObjectKey], adapters: list[L2AdapterDescriptor]
    ) -> dict[int, list[ObjectKey]]:
        targets: dict[int, list[ObjectKey]] = {}
        for key in keys:
            pick = adapters[int.from_bytes(key.chunk_hash, "big") % len(adapters)]
            targets.setdefault(pick.index, []).append(key)
        return targets

    def select_l1_deletions(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        return []


class Arena:
    """The L1 stand-in: ``window`` chunk buffers in one aligned, declared
    region, and the benchmark's keys."""

    def __init__(self, chunk_bytes: int, total_bytes: int) -> None:
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
        self.chunk_bytes = chunk_bytes
        chunks = math.ceil(total_bytes / chunk_bytes)
        self.keys = [
            ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name=MODEL, kv_rank=0)
            for i in range(chunks)
        ]
        window = KEYS_PER_TASK * TASKS_IN_FLIGHT
        self.tensor = torch.frombuffer(
            aligned_buffer(window * chunk_bytes), dtype=torch.uint8
        )
        self.tensor.copy_(torch.randint(0, 256, self.tensor.shape, dtype=torch.uint8))
        self.objs = [
            _memory_obj(self.tensor[i * chunk_bytes : (i + 1) * chunk_bytes])
            for i in range(window)
        ]
        size = self.tensor.numel()
        self.desc = L1MemoryDesc(self.tensor.data_ptr(), size, ALIGN, size)

    @property
    def stored_bytes(self) -> int:
        return len(self.keys) * self.chunk_bytes


@dataclass
class MpContender:
    """One multi-process L2 configuration: its adapters and how keys are
    placed on them."""

    name: str
    label: str
    #: the keys and buffers it stores and loads
    arena: Arena
    configs: list[L2AdapterConfigBase]
    open_one: Callable[[L2AdapterConfigBase, L1MemoryDesc], L2AdapterInterface]
    policy: StorePolicy
    #: where its data lands (for diskbench's space check)
    dirs: list[str]
    #: bytes it writes per byte stored (N for every key on every adapter)
    copies: int = 1
    #: False for a placement no LMCache release offers
    released: bool = True
    #: after a restart: "recovered" (every chunk found) or "lost"
    restart: str = ""
    #: a store a cold tier runs on (no drive): not a disk adapter to beat
    store: bool = False
    #: what its store policy sees of the adapters
    descriptors: list[L2AdapterDescriptor] = field(init=False)

    def __post_init__(self) -> None:
        self.descriptors = [
            L2AdapterDescriptor(index=i, config=c) for i, c in enumerate(self.configs)
        ]

    def describe(self) -> dict[str, Any]:
        """What the report says about it."""
        return {
            "label": self.label,
            "adapters": len(self.configs),
            "copies": self.copies,
            "released": self.released,
            "restart": self.restart,
            "store": self.store,
        }

    def open(self, desc: L1MemoryDesc) -> list[L2AdapterInterface]:
        adapters: list[L2AdapterInterface] = []
        try:
            for config in self.configs:
                adapters.append(self.open_one(config, desc))
        except BaseException:
            close_all(adapters)
            raise
        return adapters


def contenders(
    dirs: Sequence[str], arena: Arena, *, io_engine: str = "auto", queue_depth: int = 64
) -> tuple[list[MpContender], str | None]:
    """Ours over every directory (one per drive) and LMCache's adapters on the
    first and on each; and why raw_block is left out, if it is."""
    chunks, chunk_bytes = len(arena.keys), arena.chunk_bytes
    n = len(dirs)

    def sub(name: str) -> list[str]:
        made = [os.path.join(d, name) for d in dirs]
        for path in made:
            os.makedirs(path, exist_ok=True)
        return made

    stripe = SETTINGS["stripe_kb"].default * 1024
    slot = Geometry.plan(n, stripe, chunk_bytes).slot_disk_bytes
    ours_dirs = sub("tiered")
    ours: dict[str, Any] = {
        "warm.paths": ours_dirs,
        "warm.capacity_gb": (chunks + 1) * slot / GIB,
        "slot_mb": chunk_bytes / 2**20,
        "io_engine": io_engine,
        "queue_depth": queue_depth,
    }
    found = [
        MpContender(
            OURS,
            f"TieredL2Adapter x {n} (striped)",
            arena,
            [TieredL2AdapterConfig.from_dict(ours)],
            lambda _config, desc: TieredL2Adapter(ours, l1_memory_desc=desc),
            create_store_policy("default"),
            ours_dirs,
        )
    ]
    missing = None
    if importlib.util.find_spec(RUST_RAW_BLOCK_EXTENSION) is None:
        missing = RAW_BLOCK_MISSING
    kinds = [k for k in L2_ADAPTER_MODULES if not (missing and k == "raw_block")]
    for kind in kinds:
        places = sub(kind)
        specs = [_lmcache_spec(kind, p, chunks, chunk_bytes) for p in places]
        configs = [_lmcache_config(s) for s in specs]
        found.append(
            MpContender(
                f"mp_{kind}",
                f"LMCache {kind} x 1",
                arena,
                configs[:1],
                create_l2_adapter_from_registry,
                create_store_policy("default"),
                places[:1],
            )
        )
        if n == 1:
            continue
        found.append(
            MpContender(
                f"mp_{kind}_x{n}",
                f"LMCache {kind} x {n} (every key on every drive)",
                arena,
                configs,
                create_l2_adapter_from_registry,
                create_store_policy("default"),
                places,
                copies=n,
            )
        )
        if kind == "raw_block":
            by_key = sub("raw_block_by_key")
            specs = [_lmcache_spec(kind, p, chunks, chunk_bytes) for p in by_key]
            found.append(
                MpContender(
                    f"mp_raw_block_x{n}_by_key",
                    f"LMCache raw_block x {n} (one drive per key, unreleased policy)",
                    arena,
                    [_lmcache_config(s) for s in specs],
                    create_l2_adapter_from_registry,
                    OneAdapterPerKey(),
                    by_key,
                    released=False,
                )
            )
    return found, missing


def store_contenders(
    specs: Sequence[Mapping[str, Any]], arena: Arena
) -> list[MpContender]:
    """The stores ``specs`` (``tiered.cold.adapter``'s JSON) name, each one
    adapter built by LMCache's own parser and factory, named by its kind."""
    found: list[MpContender] = []
    for spec in specs:
        kind = store_kind(spec)
        name = f"store_{kind.lower()}"
        if any(c.name == name for c in found):
            name += f"_{len(found) + 1}"
        found.append(
            MpContender(
                name,
                f"{kind} store (cold tier, no drive)",
                arena,
                [parse_l2_adapter(json.dumps(spec))],
                create_l2_adapter_from_registry,
                create_store_policy("default"),
                [],
                store=True,
            )
        )
    return found


def forget(contender: MpContender) -> None:
    """Delete the arena's keys from a store contender (LMCache's native
    adapters delete synchronously; Mooncake's leased objects later)."""
    adapters = contender.open(contender.arena.desc)
    try:
        for adapter in adapters:
            adapter.delete(contender.arena.keys)
    finally:
        close_all(adapters)


def _lmcache_spec(
    kind: str, path: str, chunks: int, chunk_bytes: int
) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON a user gives ``lmcache server`` for ``kind``
    in ``path``: O_DIRECT everywhere; raw_block in its file mode, io_uring."""
    if kind != "raw_block":
        return {"type": kind, "base_path": path, "use_odirect": True}
    slot = chunk_bytes + RAW_BLOCK_HEADER
    device = os.path.join(path, "raw_block.img")
    capacity = RAW_BLOCK_META + (chunks + 2) * slot
    with open(device, "wb") as f:  # its file mode wants a pre-sized file
        f.truncate(capacity)
    return {
        "type": "raw_block",
        "device_path": device,
        "slot_bytes": slot,
        "capacity_bytes": capacity,
        "meta_total_bytes": RAW_BLOCK_META,
        "io_engine": "io_uring",
    }


def _lmcache_config(spec: dict[str, Any]) -> L2AdapterConfigBase:
    importlib.import_module(L2_ADAPTER_MODULES[spec["type"]])
    params = {k: v for k, v in spec.items() if k != "type"}
    return get_l2_adapter_config_class(spec["type"]).from_dict(params)


def fill(contender: MpContender) -> float:
    """Store every key as the contender's store policy places it; the write
    GB/s (bytes stored once, over the time until every store task reported).
    Then close, reopen and set ``contender.restart``."""
    arena = contender.arena
    adapters = contender.open(arena.desc)
    window = len(arena.objs)
    try:
        start = time.perf_counter()
        for first in range(0, len(arena.keys), window):
            group = arena.keys[first : first + window]
            by_key = dict(zip(group, arena.objs, strict=False))
            targets = contender.policy.select_store_targets(
                group, contender.descriptors
            )
            tasks = [
                (a := adapters[i], a.submit_store_task(ks, [by_key[k] for k in ks]))
                for i, ks in targets.items()
            ]
            for adapter, task in tasks:
                while (result := adapter.pop_completed_store_tasks().get(task)) is None:
                    _wait(adapter.get_store_event_fd())
                if not result.is_successful():
                    raise RuntimeError(f"{contender.name}: storing the chunks failed")
        elapsed = time.perf_counter() - start
    finally:
        close_all(adapters)
    adapters = contender.open(arena.desc)
    try:
        found = _lookup(adapters, arena.keys)
        everywhere = set(arena.keys).issubset(k for keys in found for k in keys)
        contender.restart = "recovered" if everywhere else "lost"
        for adapter, keys in zip(adapters, found, strict=True):
            adapter.submit_unlock(keys)
    finally:
        close_all(adapters)
    return arena.stored_bytes / elapsed / 1e9


def read_round(
    contender: MpContender, *, drop_caches: bool = True, passes: int = READ_PASSES
) -> MpRead:
    """Restart, drop the page cache, then look up and load every key
    ``passes`` times (each from the lowest-indexed adapter holding it),
    :data:`TASKS_IN_FLIGHT` groups of :data:`KEYS_PER_TASK` at a time; GB/s
    and CPU s/GB."""
    if contender.restart != "recovered":
        raise RuntimeError(f"{contender.name}: its chunks did not survive a restart")
    arena = contender.arena
    if drop_caches:
        drop_page_cache()
    adapters = contender.open(arena.desc)  # a restarted server
    try:
        keys, step = arena.keys, KEYS_PER_TASK
        groups = [keys[i : i + step] for i in range(0, len(keys), step)] * passes
        outstanding: deque[list[tuple[int, int, list[ObjectKey]]]] = deque()
        cpu_start = time.process_time()
        start = time.perf_counter()
        for n, group in enumerate(groups):
            if len(outstanding) == TASKS_IN_FLIGHT:
                _finish_loads(contender, adapters, outstanding.popleft())
            holders = _plan(adapters, group, _lookup(adapters, group))
            if None in holders:
                raise RuntimeError(f"{contender.name}: a stored chunk was not found")
            base = (n % TASKS_IN_FLIGHT) * KEYS_PER_TASK
            tasks = []
            for i, adapter in enumerate(adapters):
                picks = [j for j, h in enumerate(holders) if h == i]
                if picks:
                    ks = [group[j] for j in picks]
                    bufs = [arena.objs[base + j] for j in picks]
                    tasks.append((i, adapter.submit_load_task(ks, bufs), ks))
            outstanding.append(tasks)
        while outstanding:
            _finish_loads(contender, adapters, outstanding.popleft())
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    finally:
        close_all(adapters)
    gigabytes = passes * arena.stored_bytes / 1e9
    return MpRead(gigabytes / elapsed, cpu / gigabytes)


def _lookup(
    adapters: list[L2AdapterInterface], keys: list[ObjectKey]
) -> list[list[ObjectKey]]:
    """Lookup-and-lock on every adapter: the keys each one found (and now
    holds locked)."""
    tasks = [(a, a.submit_lookup_and_lock_task(keys, {})) for a in adapters]
    found = []
    for adapter, task in tasks:
        while (bitmap := adapter.query_lookup_and_lock_result(task)) is None:
            _wait(adapter.get_lookup_and_lock_event_fd())
        found.append([keys[j] for j in bitmap.get_indices_list()])
    return found


def _plan(
    adapters: list[L2AdapterInterface],
    keys: list[ObjectKey],
    found: list[list[ObjectKey]],
) -> list[int | None]:
    """Each key's adapter: the lowest-indexed one that found it (None: none
    did), as LMCache's default prefetch policy plans; the other adapters'
    locks are released, as its prefetch releases what the plan leaves out."""
    holder: dict[ObjectKey, int] = {}
    for index, keys_found in enumerate(found):
        for key in keys_found:
            holder.setdefault(key, index)
    for index, (adapter, keys_found) in enumerate(zip(adapters, found, strict=True)):
        spare = [k for k in keys_found if holder[k] != index]
        if spare:
            adapter.submit_unlock(spare)
    return [holder.get(key) for key in keys]


def _finish_loads(
    contender: MpContender,
    adapters: list[L2AdapterInterface],
    tasks: list[tuple[int, int, list[ObjectKey]]],
) -> None:
    for index, task, keys in tasks:
        adapter = adapters[index]
        while (bitmap := adapter.query_load_result(task)) is None:
            _wait(adapter.get_load_event_fd())
        if bitmap.popcount() != len(keys):
            lost = len(keys) - bitmap.popcount()
            raise RuntimeError(f"{contender.name}: {lost} chunk(s) not loaded")
        adapter.submit_unlock(keys)


def close_all(adapters: list[L2AdapterInterface]) -> None:
    for adapter in adapters:
        adapter.close()


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


def _wait(fd: int) -> None:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if not poll.poll(_WAIT_MS):
        raise RuntimeError("mpbench: the adapter signalled nothing for 60 s")
    consume_fd(fd)
