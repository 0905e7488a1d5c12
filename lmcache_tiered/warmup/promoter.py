"""Executes warm-up plans on one thread: demand reads first, within a budget.

Plans are queued by deadline and merged (a key already queued for a tier is
not queued twice); a key past its deadline, already in its target tier, or
served meanwhile by a demand read is dropped. Work goes in small units so a
demand read never waits behind a long warm-up batch, and no unit starts while
a demand read is running. Promotion to hot allocates from LMCache's CPU tier
without busy-looping and stops at a byte budget, evicting its own unused
promotions first. Without a hot tier (LMCache's multi-process server, where
the L2 adapter has no CPU tier of its own below LMCache's L1) a plan for hot
is a plan for warm: the highest tier there is.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache.v1.memory_management import MemoryObj, TensorMemoryObj
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.metrics import WarmupStats
from lmcache_tiered.tier import Payload, Tier
from lmcache_tiered.warmup.base import (
    TIER_RANK,
    CacheView,
    Plan,
    TierName,
    WarmupPolicy,
)

logger = logging.getLogger("lmcache_tiered")

#: chunks per unit of warm-up work: a demand read waits for at most one unit
UNIT_KEYS = 8


class _PromotedObj(TensorMemoryObj):
    """A chunk the promoter put in the hot tier. LMCache pins a hot chunk when
    a lookup finds it, so the first pin tells the promoter it was used."""

    on_first_pin: Callable[[], None] | None

    def pin(self) -> bool:
        callback, self.on_first_pin = self.on_first_pin, None
        if callback is not None:
            callback()
        return super().pin()


@dataclass(slots=True)
class _Queued:
    deadline: float
    seq: int
    target: str
    keys: tuple[StoreKey, ...]

    def __lt__(self, other: _Queued) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class Promoter:
    """Runs a policy's plans against the tiers; one thread, closed by close()."""

    def __init__(
        self,
        *,
        policy: WarmupPolicy,
        view: CacheView,
        tiers: dict[TierName, Tier],
        read_cold: Callable[[list[StoreKey]], list[Payload | None]],
        store: Callable[[list[Payload]], list[bool]],
        hot: LocalCPUBackend | None,
        bandwidth_bytes_s: float | None,
        hot_budget_bytes: int,
        tick_s: float,
    ) -> None:
        self.policy = policy
        self.view = view
        self.tiers = tiers
        self.read_cold = read_cold
        self.store = store
        self.hot = hot
        self.bandwidth = bandwidth_bytes_s
        self.hot_budget = hot_budget_bytes
        self.tick_s = tick_s
        self.stats = WarmupStats()
        self._cond = threading.Condition()
        self._heap: list[_Queued] = []
        self._owner: dict[tuple[bytes, str], int] = {}
        self._inflight: set[bytes] = set()
        self._demand = 0
        self._seq = itertools.count()
        self._next_io = 0.0
        self._unused_hot: OrderedDict[bytes, tuple[StoreKey, MemoryObj, int]] = (
            OrderedDict()
        )
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="lmcache-tiered-warmup", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------- interface

    def submit(self, plans: Sequence[Plan]) -> None:
        """Queue plans (merged with what is queued already); with no hot tier,
        plans for hot are queued for warm."""
        if not plans:
            return
        with self._cond:
            for plan in plans:
                self.stats.plans += 1
                seq = next(self._seq)
                target = plan.target if self.hot is not None else "warm"
                fresh = []
                for key in plan.keys:
                    slot = (key_digest(key), target)
                    if slot not in self._owner:
                        self._owner[slot] = seq
                        fresh.append(key)
                if fresh:
                    self.stats.keys_planned += len(fresh)
                    heapq.heappush(
                        self._heap,
                        _Queued(plan.deadline, seq, target, tuple(fresh)),
                    )
            self._cond.notify_all()

    @contextlib.contextmanager
    def demand(self, keys: Sequence[StoreKey]) -> Iterator[None]:
        """Wrap a demand read: no warm-up unit starts until it is done, and its
        keys are dropped from the queue (counted late if they were planned)."""
        digests = [key_digest(k) for k in keys]
        with self._cond:
            self._demand += 1
            for digest in digests:
                planned = [t for t in ("hot", "warm") if (digest, t) in self._owner]
                for target in planned:
                    del self._owner[(digest, target)]
                if planned or digest in self._inflight:
                    self.stats.late += 1
        try:
            yield
        finally:
            with self._cond:
                self._demand -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        next_tick = time.monotonic()
        while True:
            with self._cond:
                while not self._closed and not self._heap:
                    timeout = next_tick - time.monotonic()
                    if timeout <= 0:
                        break
                    self._cond.wait(timeout)
                if self._closed:
                    return
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self.tick_s
                self._guard(self._tick, now)
            unit = self._next_unit()
            if unit is not None:
                self._guard(self._execute, *unit)
                with self._cond:
                    self._inflight.clear()

    def _tick(self, now: float) -> None:
        self.submit(self.policy.on_tick(now))

    def _guard(self, work: Callable[..., None], *args: Any) -> None:
        """A failing policy or promotion is logged, never kills the thread."""
        try:
            work(*args)
        except Exception:
            logger.exception("lmcache_tiered: warm-up step failed")

    def _next_unit(self) -> tuple[str, list[StoreKey]] | None:
        """Up to UNIT_KEYS keys of the most urgent plan, once no demand read
        runs and the bandwidth budget allows."""
        with self._cond:
            while self._demand and not self._closed:
                self._cond.wait(0.05)
            now = time.monotonic()
            while self._heap:
                plan = self._heap[0]
                keys = [
                    k
                    for k in plan.keys
                    if self._owner.get((key_digest(k), plan.target)) == plan.seq
                ]
                if not keys or plan.deadline < now:
                    heapq.heappop(self._heap)
                    self._drop(keys, plan.target)
                    continue
                unit, rest = keys[:UNIT_KEYS], keys[UNIT_KEYS:]
                if rest:
                    plan.keys = tuple(rest)
                else:
                    heapq.heappop(self._heap)
                for key in unit:
                    digest = key_digest(key)
                    del self._owner[(digest, plan.target)]
                    self._inflight.add(digest)
                return plan.target, unit
        return None

    def _drop(self, keys: Sequence[StoreKey], target: str) -> None:
        for key in keys:
            self._owner.pop((key_digest(key), target), None)
        self.stats.cancelled += len(keys)

    # ------------------------------------------------------------------ work

    def _execute(self, target: str, keys: list[StoreKey]) -> None:
        wanted = TIER_RANK["hot" if target == "hot" else "warm"]
        by_tier: dict[TierName, list[StoreKey]] = {}
        for key in keys:
            where = self.view.where(key)
            if where is None or TIER_RANK[where] >= wanted:
                self.stats.cancelled += 1
            else:
                by_tier.setdefault(where, []).append(key)
        for source, source_keys in by_tier.items():
            self._throttle()
            if target == "warm":
                self._to_warm(source_keys)
            else:
                self._to_hot(self.tiers[source], source_keys)

    def _throttle(self) -> None:
        delay = self._next_io - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _spent(self, nbytes: int) -> None:
        if self.bandwidth:
            self._next_io = (
                max(self._next_io, time.monotonic()) + nbytes / self.bandwidth
            )

    def _to_warm(self, keys: list[StoreKey]) -> None:
        """Copy ``keys`` from cold (ours, or another host's shared files) to
        warm."""
        if "warm" not in self.tiers:
            return
        payloads = [p for p in self.read_cold(keys) if p is not None]
        if not payloads:
            return
        stored = self.store(payloads)  # demotes what it evicts: nothing is lost
        moved = sum(len(p.view) for p, ok in zip(payloads, stored, strict=True) if ok)
        self.stats.bytes_promoted_warm += moved
        self._spent(moved)

    def _to_hot(self, source: Tier, keys: list[StoreKey]) -> None:
        hot = self.hot
        if hot is None:
            return
        need = sum(h.payload_size for k in keys if (h := source.header(k)) is not None)
        if not self._make_room(need):
            self.stats.cancelled += len(keys)
            return
        objs = source.read(
            keys,
            lambda h: hot.allocate(h.shape, h.dtype, h.fmt, busy_loop=False),
        )
        found = [(k, o) for k, o in zip(keys, objs, strict=True) if o is not None]
        if not found:
            return
        for key, obj in found:
            self._track(key, obj)
        hot.batched_submit_put_task([k for k, _ in found], [o for _, o in found])
        moved = 0
        for _, obj in found:
            moved += obj.get_size()
            obj.ref_count_down()  # the hot tier holds its own reference now
        self.stats.bytes_promoted_hot += moved
        self._spent(moved)

    def _track(self, key: StoreKey, obj: MemoryObj) -> None:
        """Remember an unused promotion; its first lookup pin marks it used."""
        digest, size = key_digest(key), obj.get_size()
        if type(obj) is TensorMemoryObj:
            obj.__class__ = _PromotedObj
            assert isinstance(obj, _PromotedObj)
            obj.on_first_pin = lambda: self._used(digest)
        with self._cond:
            self._unused_hot[digest] = (key, obj, size)

    def _used(self, digest: bytes) -> None:
        with self._cond:
            entry = self._unused_hot.pop(digest, None)
            if entry is not None:
                self.stats.timely += 1
                self.stats.bytes_used += entry[2]

    def _make_room(self, need: int) -> bool:
        """Keep unused promotions within the hot budget: forget those LMCache
        evicted, then evict our oldest unused ones. False if it cannot fit."""
        hot = self.hot
        assert hot is not None
        if need > self.hot_budget:
            return False
        with self._cond:
            tracked = list(self._unused_hot.items())
        used = 0
        for digest, (key, _, size) in tracked:
            if not hot.contains(key):
                with self._cond:
                    self._unused_hot.pop(digest, None)
            else:
                used += size
        for digest, (key, obj, size) in tracked:
            if used + need <= self.hot_budget:
                break
            if digest in self._unused_hot and not obj.is_pinned and hot.remove(key):
                with self._cond:
                    self._unused_hot.pop(digest, None)
                used -= size
        return used + need <= self.hot_budget
