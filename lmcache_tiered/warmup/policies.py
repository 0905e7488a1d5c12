"""The built-in warm-up policies: none, lookahead, session, frequency, hinted.

Each one only decides (no I/O, no lock held across a call to the view or the
promoter) and plans nothing for a chunk stored nowhere. Those built on
``_Planner`` plan nothing for a chunk already in its target tier or above,
and do not plan a chunk again for the same or a lower tier before that
plan's deadline, so repeated events (vLLM asks again for a waiting request)
cost the promoter nothing. ``hinted`` plans once per request (one hint
each) and pins what is already hot.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from lmcache_tiered.keys import StoreKey
from lmcache_tiered.warmup.base import (
    TIER_RANK,
    CacheView,
    Plan,
    TierName,
    WarmupPolicy,
)

#: planned-key records kept before expired ones are swept (amortised O(1))
_SWEEP_MIN = 4096


def _require(ok: bool, param: str, rule: str, value: object) -> None:
    """Raise the ValueError the registry turns into ``tiered.warmup.<name>.<param>``."""
    if not ok:
        raise ValueError(f"{param}: must be {rule}, got {value!r}")


class NoWarmup(WarmupPolicy):
    """No warm-up: the baseline.

    Helps when accesses are random or contexts tiny (nothing to predict, so any
    read ahead only costs bandwidth); never helps a predictable workload.
    """

    name = "none"


class _Planner(WarmupPolicy):
    """Shared by the built-ins: one lock and the filter every plan goes through.

    Subclasses guard their own state with ``self._lock`` and call
    :meth:`_plan` after releasing it (it consults the view, then takes the lock).
    """

    def __init__(self, view: CacheView) -> None:
        super().__init__(view)
        self._lock = threading.Lock()
        #: key -> (rank of the tier it was planned for, that plan's deadline)
        self._planned: dict[StoreKey, tuple[int, float]] = {}
        self._sweep_at = _SWEEP_MIN

    def _plan(
        self,
        keys: Iterable[StoreKey],
        target: Literal["hot", "warm"],
        deadline: float,
    ) -> list[Plan]:
        """One plan for those of ``keys`` (order kept) that are stored below
        ``target`` and not already planned for it before an unexpired deadline."""
        now = self.view.now()
        if deadline <= now:
            return []
        rank = TIER_RANK[target]
        below = [
            key
            for key in keys
            if (where := self.view.where(key)) is not None and TIER_RANK[where] < rank
        ]
        chosen = []
        with self._lock:
            for key in below:
                prior = self._planned.get(key)
                if prior is not None and prior[0] >= rank and prior[1] > now:
                    continue
                self._planned[key] = (rank, deadline)
                chosen.append(key)
            if len(self._planned) > self._sweep_at:
                self._planned = {k: v for k, v in self._planned.items() if v[1] > now}
                self._sweep_at = max(_SWEEP_MIN, 2 * len(self._planned))
        return [Plan(tuple(chosen), target, deadline)] if chosen else []


class LookaheadPolicy(_Planner):
    """On lookup, copy the found prefix's known continuation (children learned
    at store time) to warm; with ``promote_found``, also promote the found
    prefix itself to hot.

    The continuation helps when requests extend earlier ones: it is then ready
    on local NVMe. It goes to warm, not hot: this request does not need it
    (its own lookup missed it), so it is a guess, and a guess must not take
    the small hot budget. Promoting the found prefix helps only where the
    read comes a scheduling step or more after the lookup (LMCache's async
    loading); with synchronous loading, vLLM's default, the read follows at
    once and a promotion already running competes with it (the bench at
    ``--kv-scale 8``: +9 % TTFT p50 with it, -2 % without, at concurrency 8;
    +34 % and -1 % on random access), so it is off by default.
    """

    name = "lookahead"

    def __init__(
        self,
        view: CacheView,
        *,
        window_s: float = 2.0,
        continuation_chunks: int = 8,
        promote_found: bool = False,
    ) -> None:
        super().__init__(view)
        _require(window_s > 0, "window_s", "greater than 0", window_s)
        _require(
            continuation_chunks >= 0, "continuation_chunks", ">= 0", continuation_chunks
        )
        self.window_s = window_s
        self.continuation_chunks = continuation_chunks
        self.promote_found = promote_found

    def on_lookup(self, keys: Sequence[StoreKey], hits: int) -> list[Plan]:
        if hits <= 0:
            return []
        found = keys[:hits]
        deadline = self.view.now() + self.window_s
        plans = self._plan(found, "hot", deadline) if self.promote_found else []
        if self.continuation_chunks:
            following = self.view.continuation(found[-1], self.continuation_chunks)
            plans += self._plan(following, "warm", deadline)
        return plans


#: gaps kept per conversation (its latest) and over all conversations
GAPS_KEPT, ALL_GAPS_KEPT = 8, 256


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered`` (nearest rank; non-empty)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(slots=True)
class _Session:
    """A conversation as of its last store: the whole chain and when."""

    chain: tuple[StoreKey, ...]
    stored_at: float
    #: this conversation's latest gaps between a store and its next turn
    gaps: tuple[float, ...]


@dataclass(slots=True)
class _Sighting:
    """One lookup, shared by every key of it (``_seen``): lets a store of new
    keys find the chain head it extends."""

    keys: tuple[StoreKey, ...]
    gaps: tuple[float, ...]


class SessionPolicy(_Planner):
    """Multi-turn chat and agent loops: the next turn of a conversation looks
    up the whole chain its last turn stored, after a gap that is learned.

    A chain is the lookup's keys up to the first newly stored key plus the
    stored keys. Gaps (a store to the lookup that extends its chain) are kept
    per conversation (its last 8) and over all (the last 256): agents' tool
    calls come back in seconds and regularly, people after tens of seconds
    or minutes, so no single average fits both. After a store, from the
    conversation's own gaps (two or more) or else everyone's, the chain goes
    back to warm (cold -> warm: it may have been demoted) ``warm_lead_s``
    before the early end of the gaps (their ``early_quantile``), and to hot
    ``lead_s`` before it, held until ``lead_s`` past their late end
    (``late_quantile``). While arrival hints come, the hot stage is the
    hint's instead, as ``hinted`` does it: the turn is then known to be next
    in the queue, and a pin held through a long think time would take the
    budget from requests that are.

    Helps chat and agent loops whose think time exceeds a cold read; needs
    one observed gap before it predicts anything. Does not help single-turn
    traffic (nothing extends a chain) and wastes hot space on conversations
    that end. Memory: ``max_sessions`` chains (least recently stored dropped
    first) plus the keys of recent lookups.
    """

    name = "session"

    #: recently looked-up keys remembered to join stores to their chains
    SEEN_KEYS = 1 << 16
    #: seconds after the last arrival hint during which hints are taken to come
    HINTS_FRESH_S = 60.0

    def __init__(
        self,
        view: CacheView,
        *,
        lead_s: float = 1.0,
        warm_lead_s: float = 10.0,
        early_quantile: float = 0.1,
        late_quantile: float = 0.75,
        max_wait_s: float = 120.0,
        max_sessions: int = 1024,
        max_gap_s: float = 900.0,
    ) -> None:
        super().__init__(view)
        _require(lead_s > 0, "lead_s", "greater than 0", lead_s)
        _require(warm_lead_s >= lead_s, "warm_lead_s", ">= lead_s", warm_lead_s)
        _require(
            0 <= early_quantile <= 1, "early_quantile", "in [0, 1]", early_quantile
        )
        _require(
            early_quantile <= late_quantile <= 1,
            "late_quantile",
            "in [early_quantile, 1]",
            late_quantile,
        )
        _require(max_sessions > 0, "max_sessions", "greater than 0", max_sessions)
        _require(max_gap_s > lead_s, "max_gap_s", "greater than lead_s", max_gap_s)
        self.lead_s = lead_s
        self.warm_lead_s = warm_lead_s
        self.early_quantile = early_quantile
        self.late_quantile = late_quantile
        self.max_sessions = max_sessions
        self.max_gap_s = max_gap_s
        self._hints = HintedPolicy(view, max_wait_s=max_wait_s)
        self._last_hint = float("-inf")
        #: chain tail -> session, least recently stored first
        self._sessions: OrderedDict[StoreKey, _Session] = OrderedDict()
        #: key -> (latest lookup holding it, its position there)
        self._seen: OrderedDict[StoreKey, tuple[_Sighting, int]] = OrderedDict()
        #: (when, seq, session, target, deadline): a promotion stage falling due
        self._due: list[tuple[float, int, _Session, Literal["hot", "warm"], float]] = []
        self._seq = itertools.count()
        self._gaps: deque[float] = deque(maxlen=ALL_GAPS_KEPT)

    @property
    def tracked_sessions(self) -> int:
        """Sessions held (at most ``max_sessions``)."""
        return len(self._sessions)

    def on_hint(self, keys: Sequence[StoreKey], deadline: float | None) -> list[Plan]:
        with self._lock:
            self._last_hint = self.view.now()
        return self._hints.on_hint(keys, deadline)

    def on_lookup(self, keys: Sequence[StoreKey], hits: int) -> list[Plan]:
        now = self.view.now()
        with self._lock:
            gaps: tuple[float, ...] = ()
            # The latest key that ends a stored chain: this request is its next turn.
            tail = next((k for k in reversed(keys) if k in self._sessions), None)
            if tail is not None:
                session = self._sessions.pop(tail)
                sample = now - session.stored_at
                gaps = session.gaps
                if sample <= self.max_gap_s:
                    self._gaps.append(sample)
                    gaps = (*gaps, sample)[-GAPS_KEPT:]
            sighting = _Sighting(tuple(keys), gaps)
            for position, key in enumerate(sighting.keys):
                self._seen[key] = (sighting, position)
                self._seen.move_to_end(key)
            while len(self._seen) > self.SEEN_KEYS:
                self._seen.popitem(last=False)
        return []

    def on_store(self, keys: Sequence[StoreKey]) -> list[Plan]:
        if not keys:
            return []
        now = self.view.now()
        with self._lock:
            seen = self._seen.get(keys[0])
            if seen is None:
                session = _Session(tuple(keys), now, ())
            else:
                sighting, position = seen
                session = _Session(
                    sighting.keys[:position] + tuple(keys), now, sighting.gaps
                )
                if position:
                    # An earlier store of this request (chunked prefill) ended
                    # where this one starts: this chain supersedes it.
                    self._sessions.pop(sighting.keys[position - 1], None)
            tail = session.chain[-1]
            self._sessions.pop(tail, None)
            self._sessions[tail] = session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            gaps = sorted(session.gaps if len(session.gaps) > 1 else self._gaps)
            if gaps:
                early = now + _quantile(gaps, self.early_quantile)
                deadline = now + _quantile(gaps, self.late_quantile) + self.lead_s
                due, seq = self._due, self._seq
                when = early - self.warm_lead_s
                heapq.heappush(due, (when, next(seq), session, "warm", deadline))
                when = early - self.lead_s
                heapq.heappush(due, (when, next(seq), session, "hot", deadline))
        return []

    def on_tick(self, now: float) -> list[Plan]:
        stages = []
        with self._lock:
            hinted = now - self._last_hint < self.HINTS_FRESH_S
            while self._due and self._due[0][0] <= now:
                _, _, session, target, deadline = heapq.heappop(self._due)
                if target == "hot" and hinted:
                    continue  # the hint will bring it to hot when it is next
                if self._sessions.get(session.chain[-1]) is session:
                    stages.append((session.chain, target, deadline))
        plans: list[Plan] = []
        for chain, target, deadline in stages:
            plans += self._plan(chain, target, deadline)
        return plans


@dataclass(slots=True)
class _Count:
    value: float
    #: time of the last counted access (``value`` is as of then)
    at: float


class FrequencyPolicy(_Planner):
    """Decayed access counts: shared system prompts and few-shot prefixes
    stay hot or warm; doubles as an admission filter for NVMe writes.

    Lookups, hints and hits each count an access to their keys; accesses of a
    key closer together than ``same_access_s`` count once (a hint, the lookups
    of a waiting request and its reads are one access). Counts halve every
    ``half_life_s``. A key is "seen n times" when its count exceeds n - 1
    (decay has taken less than one access off). Every ``scan_s`` (on a tick),
    of the keys seen ``warm_after`` times the ``top_k`` most counted are kept
    warm, and those seen ``hot_after`` times hot.

    ``admit(key)`` is False until the key is seen ``admit_after_hits`` times,
    counting the request that stores it: 0 or 1 admit every chunk (default:
    the filter is off, as a warm-up policy must not silently drop writes);
    2 spares the SSD every chunk used once, at the price of a recompute the
    second time it is used. Helps skewed popularity (shared prefixes); does
    not help when every context is used once (nothing reaches ``warm_after``).
    Memory: counts of the ``max_keys`` most recently accessed keys.
    """

    name = "frequency"

    def __init__(
        self,
        view: CacheView,
        *,
        half_life_s: float = 600.0,
        warm_after: int = 2,
        hot_after: int = 4,
        top_k: int = 256,
        window_s: float = 10.0,
        scan_s: float = 1.0,
        same_access_s: float = 1.0,
        admit_after_hits: int = 0,
        max_keys: int = 1 << 16,
    ) -> None:
        super().__init__(view)
        _require(half_life_s > 0, "half_life_s", "greater than 0", half_life_s)
        _require(warm_after >= 1, "warm_after", ">= 1", warm_after)
        _require(hot_after >= warm_after, "hot_after", ">= warm_after", hot_after)
        _require(top_k > 0, "top_k", "greater than 0", top_k)
        _require(window_s > 0, "window_s", "greater than 0", window_s)
        _require(scan_s >= 0, "scan_s", ">= 0", scan_s)
        _require(same_access_s >= 0, "same_access_s", ">= 0", same_access_s)
        _require(admit_after_hits >= 0, "admit_after_hits", ">= 0", admit_after_hits)
        _require(max_keys > 0, "max_keys", "greater than 0", max_keys)
        self.half_life_s = half_life_s
        self.warm_after = warm_after
        self.hot_after = hot_after
        self.top_k = top_k
        self.window_s = window_s
        self.scan_s = scan_s
        self.same_access_s = same_access_s
        self.admit_after_hits = admit_after_hits
        self.max_keys = max_keys
        #: key -> count, least recently accessed first
        self._counts: OrderedDict[StoreKey, _Count] = OrderedDict()
        #: keys whose count reached ``warm_after`` (checked each tick), in the
        #: order they did: ties in count keep it, so prefix heads plan first
        self._popular: dict[StoreKey, None] = {}
        self._next_scan = float("-inf")

    def _decayed(self, count: _Count, now: float) -> float:
        return count.value * float(0.5 ** ((now - count.at) / self.half_life_s))

    def _access(self, keys: Iterable[StoreKey]) -> list[Plan]:
        now = self.view.now()
        with self._lock:
            for key in keys:
                count = self._counts.get(key)
                if count is None:
                    count = self._counts[key] = _Count(0.0, now)
                elif now - count.at < self.same_access_s:
                    self._counts.move_to_end(key)
                    continue
                count.value = self._decayed(count, now) + 1.0
                count.at = now
                self._counts.move_to_end(key)
                if count.value > self.warm_after - 1:
                    self._popular[key] = None
            while len(self._counts) > self.max_keys:
                self._popular.pop(self._counts.popitem(last=False)[0], None)
        return []

    def on_hint(self, keys: Sequence[StoreKey], deadline: float | None) -> list[Plan]:
        return self._access(keys)

    def on_lookup(self, keys: Sequence[StoreKey], hits: int) -> list[Plan]:
        return self._access(keys)

    def on_hit(self, key: StoreKey, tier: TierName) -> list[Plan]:
        return self._access((key,))

    def on_tick(self, now: float) -> list[Plan]:
        with self._lock:
            if now < self._next_scan:
                return []
            self._next_scan = now + self.scan_s
            scored = []
            for key in list(self._popular):
                value = self._decayed(self._counts[key], now)
                if value > self.warm_after - 1:
                    scored.append((value, key))
                else:
                    del self._popular[key]
        top = heapq.nlargest(self.top_k, scored, key=lambda item: item[0])
        hot = [key for value, key in top if value > self.hot_after - 1]
        warm = [key for value, key in top if value <= self.hot_after - 1]
        deadline = now + self.window_s
        return self._plan(hot, "hot", deadline) + self._plan(warm, "warm", deadline)

    def admit(self, key: StoreKey) -> bool:
        if self.admit_after_hits <= 1:
            return True
        now = self.view.now()
        with self._lock:
            count = self._counts.get(key)
            return (
                count is not None
                and self._decayed(count, now) > self.admit_after_hits - 1
            )


class HintedPolicy(WarmupPolicy):
    """On an arrival hint, bring the request's cached prefix to hot while the
    request waits in vLLM's queue, and keep it pinned there until the
    request's retrieve takes it; its cold part goes to warm where the pin
    budget has no room (a cold read then leaves the engine's path).

    The prefix is the keys stored somewhere, contiguous from the head (a
    chunk after the first miss is useless to LMCache); chunks already in
    LMCache's CPU tier are pinned where they are (its LRU would drop them
    before the request is scheduled). vLLM schedules first come, first
    served, and the promoter serves the earliest deadline first: with every
    hint given the same wait, ``max_wait_s`` (a hint's own deadline wins),
    hints are served in arrival order, as far as the pin budget
    (``tiered.warmup.hot_fraction``) reaches, and the requests next in line
    get their KV first. The request's lookup retires its plan: what is still
    queued is dropped and what no retrieve takes is let go; chunks vLLM's GPU
    prefix cache served are not promoted again for a while (the promoter
    learns them from lookups that find a promotion no retrieve then takes).

    Helps when requests queue longer than a read of their prefix (load
    bursts, long prefills ahead of them) and something sends hints (the vLLM
    plugin, a router); does nothing without hints. ``max_wait_s`` caps how
    long a promotion for a request that never comes is held: set it above
    the queue's usual wait and below LMCache's ``pin_timeout_sec`` (300 s).
    """

    name = "hinted"

    def __init__(self, view: CacheView, *, max_wait_s: float = 120.0) -> None:
        super().__init__(view)
        _require(max_wait_s > 0, "max_wait_s", "greater than 0", max_wait_s)
        self.max_wait_s = max_wait_s

    def on_hint(self, keys: Sequence[StoreKey], deadline: float | None) -> list[Plan]:
        prefix: list[StoreKey] = []
        cold: list[StoreKey] = []
        for key in keys:  # up to the first miss: nothing past it is read
            where = self.view.where(key)
            if where is None:
                break
            prefix.append(key)
            if where == "cold":
                cold.append(key)
        if not prefix:
            return []
        if deadline is None:
            deadline = self.view.now() + self.max_wait_s
        request = keys[-1]
        # hot first: a cold chunk goes to hot in one read; the copy to warm
        # then finds it there and is dropped, unless the pin budget was full
        plans = [Plan(tuple(prefix), "hot", deadline, request)]
        return plans + ([Plan(tuple(cold), "warm", deadline, request)] if cold else [])
