"""An example third-party warm-up policy: keep the system prompt hot.

Most chat traffic to one deployment starts with the same system prompt, so
the first chunks of every lookup are the same few keys. This policy promotes
them to hot whenever a lookup finds them below hot. It helps when one system
prompt dominates and the hot tier keeps losing it to other traffic; it does
nothing when prompts share no head.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from lmcache.utils import CacheEngineKey

from lmcache_tiered.warmup import CacheView, Plan, WarmupPolicy


class PinPrefixPolicy(WarmupPolicy):
    """On lookup, promote the first ``chunks`` keys to hot if they are below it."""

    name = "pin_prefix"

    def __init__(self, view: CacheView, *, chunks: int = 4, window_s: float = 5.0):
        super().__init__(view)
        if chunks <= 0:
            raise ValueError(f"chunks: must be greater than 0, got {chunks!r}")
        self.chunks = chunks
        self.window_s = window_s
        self._lock = threading.Lock()
        self._until: dict[CacheEngineKey, float] = {}  # key -> planned deadline

    def on_lookup(self, keys: Sequence[CacheEngineKey], hits: int) -> list[Plan]:
        now = self.view.now()
        head = keys[: min(hits, self.chunks)]
        below = [k for k in head if self.view.where(k) != "hot"]
        with self._lock:
            if len(self._until) > 1024:  # forget expired plans
                self._until = {k: t for k, t in self._until.items() if t > now}
            due = [k for k in below if self._until.get(k, 0.0) <= now]
            for key in due:
                self._until[key] = now + self.window_s
        return [Plan(tuple(due), "hot", now + self.window_s)] if due else []
