"""The warm-up policy interface: events in, promotion plans out, never I/O.

A policy watches what LMCache does (arrival hints, lookups, stores, hits,
evictions, a periodic tick) and answers with :class:`Plan` s: which chunks to
move up to which tier before a deadline. The promoter executes plans under a
bandwidth budget, with demand reads first; a policy only decides.

Keys are opaque and hashable: LMCache's ``CacheEngineKey`` in-process,
``ObjectKey`` under LMCache's multi-process server (hence
:data:`~lmcache_tiered.keys.StoreKey`). There, a lookup is per key and the
policy's ``hits`` is its leading run of hits; there is no hot tier below
LMCache, so plans for hot are carried out as plans for warm.

A new policy is a subclass of :class:`WarmupPolicy` that overrides the events
it cares about, registered in the ``lmcache_tiered.warmup_policies``
entry-point group (see ``examples/``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from lmcache_tiered.keys import StoreKey

#: Where a chunk can live: hot = LMCache's CPU tier (in-process only), warm =
#: local NVMe, cold = NVMe-oF / shared file system.
TierName = Literal["hot", "warm", "cold"]
#: Higher is closer to the GPU; a chunk stored nowhere ranks below cold.
TIER_RANK: dict[TierName | None, int] = {None: 0, "cold": 1, "warm": 2, "hot": 3}


@dataclass(frozen=True, slots=True)
class Plan:
    """Move ``keys`` (in this order: prefix heads first) up to ``target``.

    ``deadline`` is on the ``time.monotonic()`` clock: a plan not finished by
    then is dropped, as are its chunks already served by a demand read. A
    plan for hot also pins the chunks already there, until used or the
    deadline. ``request``, where the plan serves one request (an arrival
    hint's), is that request's last key: its lookup retires the plan (what is
    still queued is dropped, what was promoted and is not taken by the
    retrieve that follows is let go).
    """

    keys: tuple[StoreKey, ...]
    target: Literal["hot", "warm"]
    deadline: float
    request: StoreKey | None = None


class CacheView(Protocol):
    """What a policy may ask about the cache: answers from memory, no I/O."""

    def where(self, key: StoreKey) -> TierName | None:
        """The highest tier holding ``key``, or None."""

    def continuation(self, key: StoreKey, limit: int) -> list[StoreKey]:
        """Up to ``limit`` keys known to follow ``key`` in a prefix chain,
        learned from earlier stores and lookups (most recent child first)."""

    def now(self) -> float:
        """The ``time.monotonic()`` clock plans' deadlines are on."""


class WarmupPolicy(abc.ABC):
    """Base of every warm-up policy; each event returns plans (default none).

    Subclasses set :attr:`name` and take their parameters as keyword
    arguments (from ``tiered.warmup.<name>.<param>``); an unknown parameter
    is a TypeError, turned into a clear configuration error by the registry.
    Events arrive from LMCache's threads: keep them fast, O(keys).
    """

    name: ClassVar[str]

    def __init__(self, view: CacheView, **params: Any) -> None:
        if params:
            raise TypeError(f"unknown parameter(s): {', '.join(sorted(params))}")
        self.view = view

    def on_hint(self, keys: Sequence[StoreKey], deadline: float | None) -> list[Plan]:
        """A request reached the server (not yet scheduled): its chunk keys."""
        return []

    def on_lookup(self, keys: Sequence[StoreKey], hits: int) -> list[Plan]:
        """LMCache asked how much of ``keys`` is cached below the hot tier;
        the first ``hits`` are (the request is about to be scheduled)."""
        return []

    def on_store(self, keys: Sequence[StoreKey]) -> list[Plan]:
        """A request's new chunks were stored, in prefix order."""
        return []

    def on_hit(self, key: StoreKey, tier: TierName) -> list[Plan]:
        """A demand read was served from ``tier``."""
        return []

    def on_evict(self, key: StoreKey, tier: TierName) -> list[Plan]:
        """``key`` left ``tier``."""
        return []

    def on_tick(self, now: float) -> list[Plan]:
        """Called about every ``tiered.warmup.tick_ms`` (time-based policies)."""
        return []

    def admit(self, key: StoreKey) -> bool:
        """Whether a put of ``key`` should be written to NVMe at all (an
        admission filter sparing SSD writes); default: always."""
        return True
