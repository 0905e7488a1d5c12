"""The promoter's copies from cold to warm not yet read: the share of the
warm tier they may hold, and what they bought.

A plan bigger than the warm tier only churns it: each copy evicts a chunk
that may be needed sooner (demoting it to cold again), and the copies made
first are evicted by the last before any request reads them. So the copies
not yet read hold at most :data:`WARM_SHARE` of the warm tier (one unit of
work may pass it); the promoter's other copies wait in its queue until a
demand read takes one, or one is settled: past its deadline, or evicted
unread (wasted).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.metrics import WarmupStats
from lmcache_tiered.warmup.base import CacheView

#: share of the warm tier the copies not yet read may hold
WARM_SHARE = 0.5


@dataclass(slots=True)
class _Copy:
    key: StoreKey
    size: int
    deadline: float


class WarmCopies:
    """The copies to warm not yet read, within ``budget_bytes``; counts
    their use and waste in ``stats``. Thread-safe: the promoter's thread
    adds and settles, readers' threads report their demand reads."""

    def __init__(self, budget_bytes: int, stats: WarmupStats, view: CacheView) -> None:
        self.budget_bytes = budget_bytes
        self.stats = stats
        self.view = view
        self._lock = threading.Lock()
        self._copies: dict[bytes, _Copy] = {}
        self._held_bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of warm the copies not yet read hold."""
        return self._held_bytes

    def full(self) -> bool:
        """Whether the copies not yet read hold the whole budget."""
        return self._held_bytes >= self.budget_bytes

    def add(self, key: StoreKey, size: int, deadline: float) -> None:
        """A chunk copied to warm for a plan due by ``deadline``."""
        digest = key_digest(key)
        with self._lock:
            old = self._copies.pop(digest, None)
            self._held_bytes += size - (old.size if old else 0)
            self._copies[digest] = _Copy(key, size, deadline)

    def read(self, keys: Sequence[StoreKey]) -> bool:
        """A demand read of ``keys``: those copied and still in warm were
        used (bytes a slower tier did not serve). Whether any was."""
        with self._lock:
            if not self._copies:
                return False
            copied = [c for k in keys if (c := self._copies.get(key_digest(k)))]
        used = [c for c in copied if self.view.where(c.key) == "warm"]
        with self._lock:
            for copy in used:
                if self._copies.pop(key_digest(copy.key), None) is copy:
                    self._held_bytes -= copy.size
                    self.stats.warm_used += 1
                    self.stats.bytes_used_warm += copy.size
        return bool(used)

    def settle(self) -> None:
        """Let go the copies past their deadline and those evicted unread:
        each counts as wasted."""
        now = self.view.now()
        with self._lock:
            copies = list(self._copies.items())
        gone = [
            (digest, copy)
            for digest, copy in copies
            if copy.deadline < now or self.view.where(copy.key) in (None, "cold")
        ]
        with self._lock:
            for digest, copy in gone:
                if self._copies.pop(digest, None) is copy:
                    self._held_bytes -= copy.size
                    self.stats.warm_wasted += 1
                    self.stats.bytes_wasted_warm += copy.size
