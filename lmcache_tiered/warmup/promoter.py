"""Executes warm-up plans on one thread: demand reads first, within a budget.

Plans are queued by deadline and merged (a key queued for a tier is not
queued twice); a key past its deadline, already in its target tier, or
served meanwhile by a demand read is dropped. Work goes in small units, and
none starts while a demand read runs.

Promotion to hot pins each chunk in LMCache's CPU tier (one already there is
pinned where it is) until a retrieve takes it or its deadline passes: that
tier is an LRU every store churns. Pins stay within a byte budget; a
promotion needed sooner displaces those needed later, which wait in the
queue. A plan made for one request is retired by that request's lookup
(what is queued is dropped; a promotion a lookup finds is let go
FOUND_GRACE_S later unless taken). A chunk a lookup found and no retrieve
took was served by vLLM's GPU prefix cache: not promoted again for
GPU_HELD_S.

The benefit guard: while fewer than ``min_precision`` of the last promotions
to hot settled were used (taken by a retrieve: bytes a drive would otherwise
have read), rather than dropped by LMCache unused or overtaken by a demand
read while still queued, only one unit of work in GUARD_PROBE_EVERY runs,
copies to warm included (the probes keep measuring, so a policy that starts
to pay is let go again). A policy that only copies to warm, and any policy
without a hot tier, is never held back.

Copies from cold to warm not yet read hold at most half the warm tier
(:mod:`lmcache_tiered.warmup.warm_copies`): more waits in the queue, as a
plan for hot waits for room in the pin budget.

Without a hot tier (LMCache's multi-process server, where the L2 adapter
has no CPU tier below LMCache's L1) a plan for hot is a plan for warm.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered._lmcache import move_to_recent, watch_use
from lmcache_tiered.io import base as io_base
from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.metrics import WarmupStats
from lmcache_tiered.storage.base import StorageTier
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.warmup.base import (
    TIER_RANK,
    CacheView,
    Plan,
    TierName,
    WarmupPolicy,
)
from lmcache_tiered.warmup.plan_queue import TARGETS, PlanQueue, Queued
from lmcache_tiered.warmup.warm_copies import WarmCopies

logger = logging.getLogger("lmcache_tiered")

#: chunks per unit of warm-up work: a demand read waits for at most one unit
UNIT_KEYS = 8
#: the benefit guard judges the last GUARD_WINDOW promotions to hot settled
#: (used, or dropped by LMCache unused), once there are GUARD_MIN of them
GUARD_WINDOW = 256
GUARD_MIN = 64
#: while the guard holds a policy back, one unit in this many still runs
GUARD_PROBE_EVERY = 8
#: seconds a promotion a lookup found stays pinned for the retrieve that
#: follows it (at once with synchronous loading; a step later with async)
FOUND_GRACE_S = 2.0
#: seconds a chunk found by a lookup and taken by no retrieve (vLLM's GPU
#: prefix cache served it) is not promoted to hot again
GPU_HELD_S = 60.0
#: seconds between moves of the pinned promotions to the recent end of
#: LMCache's CPU-tier LRU (they drift to its old end in tens of seconds)
RECENCY_EVERY_S = 2.0
#: distinct requests and GPU-held chunks remembered before expired ones are
#: swept (amortised O(1))
SWEEP_MIN = 4096


@dataclass(slots=True)
class _Promotion:
    """A chunk promoted to hot and not yet used."""

    key: StoreKey
    obj: MemoryObj
    size: int
    deadline: float
    #: digest of the request the plan was for (its last key), or None
    request: bytes | None
    #: held by the promoter (counts against the budget) until used or expired
    pinned: bool = True
    #: a lookup found it (then a retrieve takes it within FOUND_GRACE_S, or
    #: vLLM's GPU prefix cache served that chunk)
    found: bool = False
    #: read into hot by the promoter (False: pinned where it already was)
    read: bool = True

    def release(self) -> None:
        if self.pinned:
            self.pinned = False
            self.obj.unpin()


class Promoter:
    """Runs a policy's plans against the tiers; one thread, closed by close()."""

    def __init__(
        self,
        *,
        policy: WarmupPolicy,
        view: CacheView,
        tiers: dict[TierName, StorageTier],
        read_cold: Callable[[list[StoreKey]], list[Payload | None]],
        store: Callable[[list[Payload]], list[bool]],
        hot: LocalCPUBackend | None,
        bandwidth_bytes_s: float | None,
        hot_budget_bytes: int,
        warm_budget_bytes: int,
        tick_s: float,
        min_precision: float,
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
        self.min_precision = min_precision
        self.stats = WarmupStats()
        #: the copies to warm not yet read, within warm_budget_bytes
        self.copies = WarmCopies(warm_budget_bytes, self.stats, view)
        #: called on the promoter's thread as a unit of work starts, with its
        #: target tier and keys (tracing; tests check its ordering)
        self.before_unit: Callable[[str, tuple[StoreKey, ...]], None] | None = None
        #: settled promotions to hot, oldest first: used (True), or wasted or
        #: overtaken by a demand read while still queued (False)
        self._outcomes: deque[bool] = deque(maxlen=GUARD_WINDOW)
        self._units = itertools.count()
        self._cond = threading.Condition()
        self._queue = PlanQueue()
        self._inflight: set[bytes] = set()
        self._demand = 0
        self._next_io = 0.0
        #: unused promotions to hot, by key digest
        self._promoted: dict[bytes, _Promotion] = {}
        #: per target tier: its budget is full of promotions needed sooner,
        #: so its plans wait until one is used or expires (checked again
        #: every tick)
        self._full = dict.fromkeys(TARGETS, False)
        #: requests with plans queued or promotions held -> their latest deadline
        self._requests: dict[bytes, float] = {}
        #: chunks vLLM's GPU prefix cache served, by digest -> until when
        self._gpu_held: dict[bytes, float] = {}
        self._recency_at = 0.0
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
                target = plan.target if self.hot is not None else "warm"
                request = None if plan.request is None else key_digest(plan.request)
                queued = self._queue.make(plan.deadline, target, plan.keys, request)
                self.stats.keys_planned += self._queue.push(queued)
                if request is not None:
                    self._note_request(request, plan.deadline)
            self._cond.notify_all()

    def _note_request(self, request: bytes, deadline: float) -> None:
        """Remember a request with plans (call under the lock)."""
        self._requests[request] = max(deadline, self._requests.get(request, deadline))
        if len(self._requests) > SWEEP_MIN:
            now, requests = self.view.now(), self._requests.items()
            self._requests = {r: d for r, d in requests if d > now}

    def scheduled(self, keys: Sequence[StoreKey]) -> None:
        """A lookup of ``keys`` (a whole prompt's chunks past those LMCache's
        CPU tier found): retire the plans of the request they end. Its keys
        still queued are dropped; its promotions not yet taken are let go
        FOUND_GRACE_S from now unless a retrieve takes them."""
        if not keys:
            return
        request = key_digest(keys[-1])
        with self._cond:
            if self._requests.pop(request, None) is None:
                return
            self.stats.cancelled += self._queue.cancel(request)
            soon = self.view.now() + FOUND_GRACE_S
            for promotion in self._promoted.values():
                if promotion.request == request:
                    promotion.deadline = min(promotion.deadline, soon)

    @contextlib.contextmanager
    def demand(self, keys: Sequence[StoreKey]) -> Iterator[None]:
        """Wrap a demand read: no warm-up unit starts until it is done, and its
        keys are dropped from the queue (counted late if they were planned)."""
        digests = [key_digest(k) for k in keys]
        read_copies = self.copies.read(keys)  # room for more copies to warm
        with self._cond:
            if read_copies:
                self._full["warm"] = False
            self._demand += 1
            for digest in digests:
                planned = self._queue.take(digest)
                if planned or digest in self._inflight:
                    self.stats.late += 1
                if "hot" in planned:  # the promotion came too late: no use
                    self._outcomes.append(False)
        try:
            yield
        finally:
            with self._cond:
                self._demand -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread and release the promoter's pins. A promotion stuck
        in a hung drive's I/O is waited for at most CLOSE_WAIT_S, then left
        behind (one WARNING): a pin it takes after that is not released."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(io_base.CLOSE_WAIT_S)
        if self._thread.is_alive():
            logger.warning(
                "lmcache_tiered: closing while a warm-up step is still running "
                "after %.3g s (I/O on a hung drive?): left behind",
                io_base.CLOSE_WAIT_S,
            )
        with self._cond:
            promoted, self._promoted = list(self._promoted.values()), {}
        for promotion in promoted:
            promotion.release()

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        next_tick = time.monotonic()
        while True:
            with self._cond:
                while not self._closed and not self._runnable():
                    timeout = next_tick - time.monotonic()
                    if timeout <= 0:
                        break
                    self._cond.wait(timeout)
                if self._closed:
                    return
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self.tick_s
                self._guard(self._tick)
            unit = self._next_unit()
            if unit is not None:
                if self._held_back():
                    self.stats.held_back += len(unit.keys)
                else:
                    if self.before_unit is not None:
                        self._guard(self.before_unit, unit.target, unit.keys)
                    self._guard(self._execute, unit)
                with self._cond:
                    self._inflight.clear()

    def _tick(self) -> None:
        if self.hot is not None:
            pinned = self._settle()
            now = time.monotonic()
            if now >= self._recency_at:
                self._recency_at = now + RECENCY_EVERY_S
                move_to_recent(self.hot, [p.key for p in pinned])
        self.copies.settle()
        with self._cond:  # promotions may have expired or been evicted
            self._full = dict.fromkeys(TARGETS, False)
        self.submit(self.policy.on_tick(self.view.now()))

    def _held_back(self) -> bool:
        """The benefit guard: whether to skip the next unit."""
        with self._cond:
            settled, used = len(self._outcomes), sum(self._outcomes)
        if settled < GUARD_MIN or used >= self.min_precision * settled:
            return False
        return next(self._units) % GUARD_PROBE_EVERY != 0

    def _runnable(self) -> bool:
        return any(self._queue.waiting(t) and not f for t, f in self._full.items())

    def _guard(self, work: Callable[..., None], *args: Any) -> None:
        """A failing policy or promotion is logged, never kills the thread."""
        try:
            work(*args)
        except Exception:
            logger.exception("lmcache_tiered: warm-up step failed")

    def _next_unit(self) -> Queued | None:
        """Up to UNIT_KEYS keys of the most urgent runnable plan, once no
        demand read runs."""
        with self._cond:
            while self._demand and not self._closed:
                self._cond.wait(0.05)
            targets = [t for t, full in self._full.items() if not full]
            unit, expired = self._queue.next_unit(targets, self.view.now(), UNIT_KEYS)
            self.stats.cancelled += expired
            if unit is not None:
                self._inflight.update(key_digest(k) for k in unit.keys)
            return unit

    def _requeue(self, unit: Queued) -> None:
        """Put a unit that found no room in its tier's budget back in the
        queue (keys planned again meanwhile stay with that newer plan)."""
        with self._cond:
            self._queue.push(unit)
            self._full[unit.target] = True

    # ------------------------------------------------------------------ work

    def _execute(self, unit: Queued) -> None:
        target = unit.target
        wanted = TIER_RANK["hot" if target == "hot" else "warm"]
        by_tier: dict[TierName, list[StoreKey]] = {}
        for key in unit.keys:
            where = self.view.where(key)
            if where is None or (TIER_RANK[where] >= wanted and target != "hot"):
                self.stats.cancelled += 1
            elif target == "hot" and self._gpu_serves(key):
                self.stats.gpu_skipped += 1
            else:
                by_tier.setdefault(where, []).append(key)
        for source, source_keys in by_tier.items():
            if target == "warm":
                if self.copies.full():
                    self._requeue(replace(unit, keys=tuple(source_keys)))
                    continue
                self._throttle()
                self._to_warm(source_keys, unit.deadline)
                continue
            if source == "hot":
                done = self._pin_in_place(source_keys, unit)
            else:
                self._throttle()
                done = self._to_hot(self.tiers[source], source_keys, unit)
            if not done:
                self._requeue(replace(unit, keys=tuple(source_keys)))

    def _gpu_serves(self, key: StoreKey) -> bool:
        """Whether vLLM's GPU prefix cache served ``key`` lately."""
        with self._cond:
            until = self._gpu_held.get(key_digest(key))
        return until is not None and until > self.view.now()

    def _throttle(self) -> None:
        time.sleep(max(0.0, self._next_io - time.monotonic()))

    def _spent(self, nbytes: int) -> None:
        if self.bandwidth:
            start = max(self._next_io, time.monotonic())
            self._next_io = start + nbytes / self.bandwidth

    def _to_warm(self, keys: list[StoreKey], deadline: float) -> None:
        """Copy ``keys`` from cold (ours, or another host's shared files) to
        warm, held in the copies' budget until read or ``deadline``."""
        if "warm" not in self.tiers:
            return
        payloads = [p for p in self.read_cold(keys) if p is not None]
        if not payloads:
            return
        stored = self.store(payloads)  # demotes what it evicts: nothing is lost
        moved = 0
        for payload, ok in zip(payloads, stored, strict=True):
            if ok:
                self.copies.add(payload.key, len(payload.view), deadline)
                moved += len(payload.view)
        self.stats.bytes_promoted_warm += moved
        self._spent(moved)

    def _pin_in_place(self, keys: list[StoreKey], unit: Queued) -> bool:
        """Pin ``keys``, already in LMCache's CPU tier, as :meth:`_to_hot`
        pins what it reads; False (nothing done) when the budget has no room."""
        hot = self.hot
        assert hot is not None
        with self._cond:
            keys = [k for k in keys if key_digest(k) not in self._promoted]
        held = [(k, o) for k in keys if (o := hot.get_blocking(k)) is not None]
        try:
            need = sum(obj.get_size() for _, obj in held)
            if need > self.hot_budget:
                self.stats.cancelled += len(keys)
                return True
            if not self._make_room(need, unit.deadline):
                return False
            for key, obj in held:
                obj.pin()
                self._track(key, obj, unit, read=False)
            self.stats.pinned_in_place += len(held)
            return True
        finally:
            for _, obj in held:
                obj.ref_count_down()  # get_blocking's reference

    def _to_hot(self, source: StorageTier, keys: list[StoreKey], unit: Queued) -> bool:
        """Read ``keys`` into LMCache's CPU tier, pinned until used or the
        unit's deadline; False (nothing done) when the budget has no room."""
        hot = self.hot
        if hot is None:
            return True
        need = sum(h.payload_size for k in keys if (h := source.header(k)) is not None)
        if need > self.hot_budget:
            self.stats.cancelled += len(keys)
            return True
        if not self._make_room(need, unit.deadline):
            return False
        objs = source.read(
            keys,
            lambda h: hot.allocate(h.shape, h.dtype, h.fmt, busy_loop=False),
        )
        found = [(k, o) for k, o in zip(keys, objs, strict=True) if o is not None]
        if not found:
            return True
        for _, obj in found:
            obj.pin()  # before the hot tier sees it: its LRU must not take it
        hot.batched_submit_put_task([k for k, _ in found], [o for _, o in found])
        moved = 0
        for key, obj in found:
            self._track(key, obj, unit, read=True)
            moved += obj.get_size()
            obj.ref_count_down()  # the hot tier holds its own reference now
        self.stats.bytes_promoted_hot += moved
        self._spent(moved)
        return True

    def _track(self, key: StoreKey, obj: MemoryObj, unit: Queued, read: bool) -> None:
        """Hold a pinned promotion until its first use: the first reference
        the hot tier hands out after the put (a retrieve taking it, not a
        lookup finding it: vLLM loads nothing its GPU prefix cache holds)."""
        digest = key_digest(key)
        promotion = _Promotion(
            key, obj, obj.get_size(), unit.deadline, unit.request, read=read
        )
        with self._cond:
            self._promoted[digest] = promotion
        watch_use(obj, lambda: self._used(digest), lambda: self._found(digest))

    def _found(self, digest: bytes) -> None:
        """A lookup found a promotion: a retrieve takes it soon, or not at all."""
        with self._cond:
            promotion = self._promoted.get(digest)
            if promotion is not None:
                promotion.found = True
                soon = self.view.now() + FOUND_GRACE_S
                promotion.deadline = min(promotion.deadline, soon)

    def _used(self, digest: bytes) -> None:
        with self._cond:
            promotion = self._promoted.pop(digest, None)
            if promotion is None:
                return
            self.stats.timely += 1
            if promotion.read:
                self.stats.bytes_used += promotion.size
            else:
                self.stats.bytes_used_in_place += promotion.size
            self._outcomes.append(True)
            promotion.release()  # the retrieve holds its own reference now
            self._full["hot"] = False
            self._cond.notify_all()

    def _settle(self) -> list[_Promotion]:
        """Unpin promotions past their deadline (still cached: a late request
        may still use them, or LMCache evicts them), settle those LMCache
        dropped unused as wasted; the promotions still pinned."""
        hot = self.hot
        assert hot is not None
        now = self.view.now()
        with self._cond:
            promoted = list(self._promoted.items())
        cached = {d: hot.contains(p.key) for d, p in promoted}
        pinned: list[_Promotion] = []
        with self._cond:  # _used may settle one meanwhile
            for digest, promotion in promoted:
                if self._promoted.get(digest) is not promotion:
                    continue
                if not cached[digest]:
                    del self._promoted[digest]
                    self.stats.wasted += 1
                    self.stats.bytes_wasted += promotion.size if promotion.read else 0
                    self._outcomes.append(False)
                    promotion.release()
                elif promotion.pinned and promotion.deadline < now:
                    promotion.release()
                    if promotion.found:  # vLLM's GPU prefix cache served it
                        del self._promoted[digest]
                        self.stats.gpu_served += 1
                        self._gpu_held[digest] = now + GPU_HELD_S
                elif promotion.pinned:
                    pinned.append(promotion)
            if len(self._gpu_held) > SWEEP_MIN:
                held = self._gpu_held.items()
                self._gpu_held = {d: until for d, until in held if until > now}
        return pinned

    def _make_room(self, need: int, deadline: float) -> bool:
        """Fit ``need`` more pinned bytes in the hot budget: unpin expired
        promotions, forget those LMCache dropped, then evict promotions
        needed later than ``deadline``, latest first. False if it cannot fit."""
        hot = self.hot
        assert hot is not None
        pinned = self._settle()
        used = sum(p.size for p in pinned)
        later = sorted(
            (p for p in pinned if p.deadline > deadline), key=lambda p: -p.deadline
        )
        displaced: dict[tuple[float, bytes | None], list[StoreKey]] = {}
        for promotion in later:
            if used + need <= self.hot_budget:
                break
            with self._cond:  # _used may release it meanwhile
                promotion.release()
            used -= promotion.size  # no longer held by the promoter
            if promotion.obj.is_pinned:
                continue  # a lookup holds it: it is being used
            if hot.remove(promotion.key):
                with self._cond:
                    self._promoted.pop(key_digest(promotion.key), None)
                plan = (promotion.deadline, promotion.request)
                displaced.setdefault(plan, []).append(promotion.key)
        # displaced promotions are still wanted: they wait for room again
        for (when, request), keys in displaced.items():
            self._requeue(self._queue.make(when, "hot", keys, request))
        return used + need <= self.hot_budget
