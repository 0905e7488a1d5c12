"""The promoter's queue of plans: per target tier, most urgent first, and
merged, so a key queued for a tier is queued once (it stays with the first
plan that named it until taken, dropped, or past that plan's deadline).

Not thread-safe: the promoter holds its lock around every call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace

from lmcache_tiered.keys import StoreKey, key_digest

#: the tiers a plan can target
TARGETS = ("hot", "warm")


@dataclass(slots=True)
class Queued:
    """A plan (or the part of one) waiting, or a unit of it taken to run."""

    deadline: float
    seq: int
    target: str
    keys: tuple[StoreKey, ...]
    #: digest of the request the plan is for (its last key), or None
    request: bytes | None = None

    def __lt__(self, other: Queued) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class PlanQueue:
    """Plans by target tier, soonest deadline first."""

    def __init__(self) -> None:
        self._heaps: dict[str, list[Queued]] = {t: [] for t in TARGETS}
        #: (key digest, target) -> seq of the plan the key is queued with
        self._owner: dict[tuple[bytes, str], int] = {}
        self._seq = itertools.count()

    def make(
        self,
        deadline: float,
        target: str,
        keys: Iterable[StoreKey],
        request: bytes | None = None,
    ) -> Queued:
        """A new plan entry (not queued yet), after every earlier one."""
        return Queued(deadline, next(self._seq), target, tuple(keys), request)

    def waiting(self, target: str) -> bool:
        return bool(self._heaps[target])

    def push(self, queued: Queued) -> int:
        """Queue those of ``queued``'s keys not queued for its tier already;
        how many that was."""
        fresh = []
        for key in queued.keys:
            slot = (key_digest(key), queued.target)
            if slot not in self._owner:
                self._owner[slot] = queued.seq
                fresh.append(key)
        if fresh:
            heapq.heappush(
                self._heaps[queued.target], replace(queued, keys=tuple(fresh))
            )
        return len(fresh)

    def take(self, digest: bytes) -> list[str]:
        """Drop a key (a demand read serves it): the tiers it was queued for."""
        queued = [t for t in TARGETS if (digest, t) in self._owner]
        for target in queued:
            del self._owner[(digest, target)]
        return queued

    def cancel(self, request: bytes) -> int:
        """Drop the keys queued for ``request``'s plans; how many."""
        dropped = 0
        for heap in self._heaps.values():
            for queued in heap:
                if queued.request != request:
                    continue
                for key in queued.keys:
                    slot = (key_digest(key), queued.target)
                    if self._owner.get(slot) == queued.seq:
                        del self._owner[slot]
                        dropped += 1
        return dropped

    def next_unit(
        self, targets: Iterable[str], now: float, size: int
    ) -> tuple[Queued | None, int]:
        """Up to ``size`` keys of the most urgent plan for one of ``targets``,
        taken out of the queue, and how many keys past their deadline were
        dropped on the way."""
        targets = list(targets)
        dropped = 0
        while True:
            heads = [self._heaps[t][0] for t in targets if self._heaps[t]]
            if not heads:
                return None, dropped
            plan = min(heads)
            heap = self._heaps[plan.target]
            keys = [
                k
                for k in plan.keys
                if self._owner.get((key_digest(k), plan.target)) == plan.seq
            ]
            if not keys or plan.deadline < now:
                heapq.heappop(heap)
                for key in keys:
                    del self._owner[(key_digest(key), plan.target)]
                dropped += len(keys)
                continue
            unit, rest = keys[:size], keys[size:]
            if rest:
                plan.keys = tuple(rest)
            else:
                heapq.heappop(heap)
            for key in unit:
                del self._owner[(key_digest(key), plan.target)]
            return replace(plan, keys=tuple(unit)), dropped
