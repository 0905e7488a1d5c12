"""TieredCache: the warm and cold tiers, the writer and the warm-up, composed.

Everything between LMCache's interface and the tiers lives here, so the
in-process plugin (:mod:`lmcache_tiered.backend`) and the multi-process L2
adapter (:mod:`lmcache_tiered.mp`) share one implementation.

- Lookups and reads fall through warm -> cold; a cold hit is served directly
  and copied to warm in the background.
- Puts are queued to one writer thread that batches them. Before warm evicts,
  its victims are demoted to cold (``tiered.cold.write: back``), or every put
  goes to both tiers (``through``).
- The warm-up policy sees every lookup, store, hit, eviction and hint; its
  plans run on the promoter thread, after demand reads.

Durability point: a put is *acknowledged* when the writer has written its
payload and then its header to a tier; only then does LMCache's
``on_complete_callback`` run and ``exists_in_put_tasks`` turn false. An
acknowledged put survives a crash of the process (``kill -9``) and is served
after the restart unless capacity evicted it meanwhile; a put not yet
acknowledged is either lost or served whole, never torn. With
``tiered.fsync: true`` each write batch is also fdatasync'ed before it is
acknowledged, so it survives a power loss too. A degraded tier (see
:mod:`lmcache_tiered.tier`) is skipped: its lookups fall through to the next
tier and puts go to the tiers that work.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered.config import ConfigError, TieredConfig, TierSettings
from lmcache_tiered.keys import key_digest
from lmcache_tiered.shared import SharedCold
from lmcache_tiered.tier import Allocator, Payload, Tier
from lmcache_tiered.warmup import load_policy
from lmcache_tiered.warmup.base import Plan, TierName, WarmupPolicy
from lmcache_tiered.warmup.chains import ChainIndex
from lmcache_tiered.warmup.promoter import Promoter

logger = logging.getLogger("lmcache_tiered")

PutCallback = Callable[[CacheEngineKey], None]
#: Most bytes of puts waiting for the writer; beyond it puts are dropped so the
#: CPU tier, whose buffers the queued puts hold, never fills up behind them.
MAX_QUEUED_BYTES = 2 << 30


class _Batch:
    """Objects queued for one tier, each holding a reference until written."""

    __slots__ = ("target", "keys", "objs", "callback")

    def __init__(
        self,
        target: TierName,
        keys: list[CacheEngineKey],
        objs: list[MemoryObj],
        callback: PutCallback | None,
    ) -> None:
        self.target, self.keys, self.objs, self.callback = target, keys, objs, callback


#: The writer's queue: batches, flush markers (set once every earlier batch is
#: written) and None, which stops it.
_QueueItem = _Batch | threading.Event | None


class TieredCache:
    """Warm (+ optional cold) tiers with a writer thread and warm-up."""

    def __init__(
        self,
        settings: TieredConfig,
        *,
        owner: str,
        max_payload: int,
        local_workers: int,
        hot: LocalCPUBackend | None,
        allocate: Allocator,
    ) -> None:
        self.settings = settings
        self.hot = hot
        self._allocate = allocate
        self.tiers: dict[TierName, Tier] = {}
        try:
            levels: list[tuple[TierName, TierSettings | None]] = [
                ("warm", settings.warm),
                ("cold", settings.cold),
            ]
            for name, tier_settings in levels:
                if tier_settings is None:
                    continue
                tier = Tier(
                    tier_settings,
                    settings,
                    # several hosts may share the cold tier: name files per host
                    owner=owner if name == "warm" else f"{owner}-{settings.host_id}",
                    max_payload=max_payload,
                    # the cap is for the host: each local worker gets a share
                    capacity_bytes=tier_settings.capacity_bytes // local_workers,
                )
                self.tiers[name] = tier
                tier.on_evict = self._evicted_from(name)
            self.chains = ChainIndex()
            self.policy = self._load_policy()
            # last: its thread must not outlive a constructor that failed
            self.shared = SharedCold(
                self.tiers.get("cold"), settings, max_payload=max_payload
            )
        except BaseException:
            for tier in self.tiers.values():
                tier.close()
            raise
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._pending: dict[bytes, int] = {}
        self._queued_bytes = 0
        self.puts_dropped = 0
        self.puts_not_admitted = 0
        self._closed = False
        self._queue: queue.SimpleQueue[_QueueItem] = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._write_loop, name="lmcache-tiered-writer", daemon=True
        )
        self._writer.start()
        self.promoter = Promoter(
            policy=self.policy,
            view=self,
            tiers=self.tiers,
            store=self.store,
            hot=hot,
            bandwidth_bytes_s=settings.warmup_bandwidth_bytes_s,
            hot_budget_bytes=int(
                settings.warmup_hot_fraction * (0 if hot is None else _hot_bytes(hot))
            ),
            tick_s=settings.warmup_tick_s,
        )

    def _load_policy(self) -> WarmupPolicy:
        name = self.settings.warmup_policy
        params = {
            k.split(".", 1)[1]: v
            for k, v in self.settings.policy_params.items()
            if k.startswith(name + ".")
        }
        for key in self.settings.policy_params:
            if not key.startswith(name + "."):
                logger.warning(
                    "lmcache_tiered: tiered.warmup.%s is ignored: the policy in use "
                    "is %s",
                    key,
                    name,
                )
        if self.settings.admit_after_hits:
            if name != "frequency":
                raise ConfigError(
                    "tiered.warm.admit_after_hits needs tiered.warmup.policy: "
                    f"frequency (the policy in use is {name})"
                )
            params.setdefault("admit_after_hits", self.settings.admit_after_hits)
        return load_policy(name, self, params)

    @property
    def warm(self) -> Tier:
        return self.tiers["warm"]

    # ------------------------------------------------------------- CacheView

    def where(self, key: CacheEngineKey) -> TierName | None:
        if self.hot is not None and self.hot.contains(key):
            return "hot"
        return self.tier_of(key)

    def tier_of(self, key: CacheEngineKey) -> TierName | None:
        """The highest of our tiers (not hot) that holds ``key``; chunks other
        hosts stored in a shared cold tier count as cold."""
        found = next((n for n, t in self.tiers.items() if t.header(key)), None)
        if found is None and self.shared.find(key) is not None:
            return "cold"
        return found

    def continuation(self, key: CacheEngineKey, limit: int) -> list[CacheEngineKey]:
        return self.chains.continuation(key, limit)

    def now(self) -> float:
        return time.monotonic()

    # ---------------------------------------------------------------- events

    def _plan(self, plans: list[Plan]) -> None:
        self.promoter.submit(plans)

    def _evicted_from(self, tier: TierName) -> Callable[[list[CacheEngineKey]], None]:
        def evicted(keys: list[CacheEngineKey]) -> None:
            for key in keys:
                self._plan(self.policy.on_evict(key, tier))

        return evicted

    def hint(self, keys: Sequence[CacheEngineKey], deadline: float | None) -> None:
        """An arrival hint: ``keys`` of a request not yet scheduled."""
        self._plan(self.policy.on_hint(keys, deadline))

    # ---------------------------------------------------------------- lookups

    def prefix_hits(self, keys: Sequence[CacheEngineKey], pin: bool = False) -> int:
        """Length of the prefix of ``keys`` held in warm or cold (pinned on
        request, recency refreshed); the policy sees the whole lookup."""
        hits = 0
        by_tier: dict[TierName, list[CacheEngineKey]] = {}
        for key in keys:
            tier = self.tier_of(key)
            if tier is None:
                break
            hits += 1
            by_tier.setdefault(tier, []).append(key)
        for tier, tier_keys in by_tier.items():
            self.tiers[tier].touch(tier_keys, pin)
        self.chains.learn(keys)
        self._plan(self.policy.on_lookup(keys, hits))
        return hits

    def stored_keys(self) -> list[CacheEngineKey]:
        keys = {k: None for t in self.tiers.values() for k in t.stored_keys()}
        return list(keys)

    def pin(self, key: CacheEngineKey) -> bool:
        tier = self.tier_of(key)
        return tier is not None and self.tiers[tier].pin(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return any(t.unpin(key) for t in self.tiers.values())

    def remove(self, key: CacheEngineKey) -> bool:
        return sum(t.remove(key) for t in self.tiers.values()) > 0

    def is_pending(self, key: CacheEngineKey) -> bool:
        return key_digest(key) in self._pending

    # ------------------------------------------------------------------ reads

    def read(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """Demand read: each tier in turn reads, in one batch, the keys still
        missing. Cold hits are queued for a copy to warm."""
        objs: list[MemoryObj | None] = [None] * len(keys)
        with self.promoter.demand(keys):
            for name, tier in self._read_order():
                missing = [i for i, obj in enumerate(objs) if obj is None]
                if not missing:
                    break
                found = tier.read([keys[i] for i in missing], self._allocate)
                for i, obj in zip(missing, found, strict=True):
                    objs[i] = obj
                hits = [(keys[i], o) for i, o in zip(missing, found, strict=True) if o]
                for key, _ in hits:
                    self._plan(self.policy.on_hit(key, name))
                if name == "cold" and hits and "warm" in self.tiers:
                    self._enqueue("warm", hits, None)
        return objs

    def _read_order(self) -> list[tuple[TierName, Tier]]:
        """Our tiers, then the other hosts' files in a shared cold tier."""
        return [*self.tiers.items(), *(("cold", t) for t in self.shared.tiers())]

    # ----------------------------------------------------------------- writes

    def put(
        self,
        keys: Sequence[CacheEngineKey],
        objs: Sequence[MemoryObj],
        callback: PutCallback | None = None,
    ) -> None:
        """Queue a request's new chunks (prefix order) for the writer; return
        at once. Already stored or queued keys are skipped; the policy sees the
        chain and may refuse admission."""
        if not self.tiers or self._closed:
            return
        self.chains.learn(keys)
        self._plan(self.policy.on_store(keys))
        items = []
        for key, obj in zip(keys, objs, strict=True):
            if not self.policy.admit(key):
                self.puts_not_admitted += 1
            elif self.tier_of(key) is None:
                items.append((key, obj))
        self._enqueue("warm", items, callback)

    def _enqueue(
        self,
        target: TierName,
        items: Sequence[tuple[CacheEngineKey, MemoryObj]],
        callback: PutCallback | None,
    ) -> None:
        """Take a reference on each object (LMCache drops its own as soon as
        the put call returns) and hand the batch to the writer."""
        batch = _Batch(target, [], [], callback)
        with self._lock:
            for key, obj in items:
                digest, size = key_digest(key), obj.get_size()
                if digest in self._pending:
                    continue
                if self._queued_bytes + size > MAX_QUEUED_BYTES:
                    self.puts_dropped += 1
                    continue
                obj.ref_count_up()
                self._pending[digest] = size
                self._queued_bytes += size
                batch.keys.append(key)
                batch.objs.append(obj)
        if batch.keys:
            self._queue.put(batch)

    def _write_loop(self) -> None:
        """Drain the queue: everything waiting goes to the tiers at once."""
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            batches = [b for b in items if isinstance(b, _Batch)]
            if batches:
                try:
                    self._write(batches)
                except Exception:
                    logger.exception("lmcache_tiered: write failed")
                finally:
                    self._release(batches)
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if None in items:
                return

    def _write(self, batches: list[_Batch]) -> None:
        payloads = [
            Payload.of(k, o)
            for b in batches
            for k, o in zip(b.keys, b.objs, strict=True)
        ]
        done = iter(self.store(payloads))
        for batch in batches:
            for key in batch.keys:
                if next(done) and batch.callback is not None:
                    try:
                        batch.callback(key)
                    except Exception:
                        logger.exception("lmcache_tiered: put callback failed")

    def store(self, payloads: list[Payload]) -> list[bool]:
        """Write chunks to warm without losing any: first warm's next victims
        are copied to cold (write-back), then what warm cannot take goes to
        cold; with write-through every chunk goes to both.

        The writer and the promoter both store; one lock keeps a victim from
        being overwritten between its demotion and the write (it is held across
        I/O, but only ever by those two background threads).
        """
        cold = self.tiers.get("cold")
        through = self.settings.cold_write_through
        with self._store_lock:
            victims = None
            if cold is not None and not through:
                victims = self.warm.victims(len(payloads))
                self._demote(victims, cold)
            # a victim read (touched) meanwhile is kept, never a chunk not in cold
            stored = self.warm.write_payloads(payloads, evict_only=victims)
            if cold is not None:
                # through: every chunk goes below too; back: what warm refused
                below = [i for i, ok in enumerate(stored) if through or not ok]
                if below:
                    cold_ok = cold.write_payloads([payloads[i] for i in below])
                    for i, ok in zip(below, cold_ok, strict=True):
                        stored[i] = stored[i] or ok
        return stored

    def _demote(self, victims: list[CacheEngineKey], cold: Tier) -> None:
        """Copy warm's next victims to cold before they are overwritten."""
        missing = [k for k in victims if cold.header(k) is None]
        if missing:
            payloads = [p for p in self.warm.read_payloads(missing) if p is not None]
            cold.write_payloads(payloads)

    def _release(self, batches: list[_Batch]) -> None:
        for batch in batches:
            for key, obj in zip(batch.keys, batch.objs, strict=True):
                with self._lock:
                    self._queued_bytes -= self._pending.pop(key_digest(key), 0)
                obj.ref_count_down()

    def flush(self) -> None:
        """Block until every put queued so far is written."""
        if self._closed:
            return
        marker = threading.Event()
        self._queue.put(marker)
        marker.wait()

    # --------------------------------------------------------------- metrics

    def snapshot(self) -> dict[str, Any]:
        """Counters of every tier and of the warm-up policy, as plain data."""
        warmup = asdict(self.promoter.stats)
        warmup["policy"] = self.settings.warmup_policy
        warmup["precision"] = self.promoter.stats.precision
        return {
            "tiers": {
                name: asdict(t.stats)
                | {"used_bytes": t.used_bytes, "chunks": len(t), "degraded": t.degraded}
                for name, t in self.tiers.items()
            },
            "warmup": warmup,
            "puts_dropped": self.puts_dropped,
            "puts_not_admitted": self.puts_not_admitted,
        }

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Write every queued put, stop the threads, close the tiers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.promoter.close()
        self._queue.put(None)
        self._writer.join()
        self.shared.close()
        for tier in self.tiers.values():
            tier.close()


def _hot_bytes(hot: LocalCPUBackend) -> int:
    """Capacity of LMCache's CPU tier in bytes (0 if it cannot be told)."""
    with contextlib.suppress(AttributeError, TypeError):
        return int(hot.memory_allocator.size)
    return 0
