"""What the cache asks of a storage tier, whatever stores the bytes.

Two kinds of tier serve it: :class:`lmcache_tiered.storage.tier.Tier` (files on
NVMe: striped, O_DIRECT, its own index and eviction) and
:class:`lmcache_tiered.storage.adapter_tier.AdapterTier` (a cold tier on a store
behind one of LMCache's L2 adapters: Redis, S3, ...). Both are a
:class:`StorageTier`: the cache, the demand reader, the promoter and the two
LMCache front ends use a tier only through it, and ask its capability
properties (as zarr's stores answer ``supports_writes``) instead of its class.
Bulk and convenience operations are built here from the single ones a tier
implements; a tier overrides one where it can do better (one round trip for
a batch). Every tier passes one shared test suite (tests/test_tier_suite.py).

This module holds no state and does no I/O.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Sequence

from lmcache.v1.memory_management import MemoryObj

from lmcache_tiered.keys import StoreKey
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage.layout import RecordHeader
from lmcache_tiered.storage.payload import Allocator, Payload


class StorageTier(abc.ABC):
    """One level of storage: what it holds, reads, writes and reports."""

    #: ``warm`` or ``cold``: the tier's place, in logs and settings
    name: str
    #: the tier's directories (none for a store)
    paths: Sequence[str] = ()
    stats: TierStats

    # ------------------------------------------------------------ capabilities

    #: :meth:`discover` asks the backing store for chunks its index lacks
    #: (written by other hosts or earlier processes); without it the index
    #: knows every chunk the tier holds
    supports_discovery: bool = False
    #: the backing store evicts on its own, unseen: :attr:`on_evict` never
    #: hears of it (a tier that evicts by itself tells it every key it drops)
    evicts_itself: bool = False
    #: called (outside the tier's lock) with the keys a write evicted
    on_evict: Callable[[list[StoreKey]], None] | None = None

    @property
    def direct_io(self) -> bool:
        """Whether reads and writes bypass the page cache."""
        return False

    @property
    @abc.abstractmethod
    def engine_name(self) -> str:
        """What moves the bytes, for logs and status (``uring``, ``threads``,
        ``l2:resp``)."""

    @property
    @abc.abstractmethod
    def degraded(self) -> str | None:
        """Why the tier serves nothing now (None: healthy)."""

    @property
    @abc.abstractmethod
    def writes_refused(self) -> str | None:
        """Why the tier takes no writes while it serves reads (None: it
        takes them)."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes of storage the tier holds."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Chunks the tier knows it holds."""

    # ------------------------------------------------------------------ index

    @abc.abstractmethod
    def header(self, key: StoreKey) -> RecordHeader | None:
        """``key``'s record header if the tier holds it (no I/O)."""

    @abc.abstractmethod
    def touch(self, keys: Sequence[StoreKey], pin: bool = False) -> int:
        """Refresh the recency of the held ``keys`` (pin them on request);
        how many are held."""

    @abc.abstractmethod
    def stored_keys(self) -> list[StoreKey]: ...

    @abc.abstractmethod
    def pin(self, key: StoreKey) -> bool: ...

    @abc.abstractmethod
    def unpin(self, key: StoreKey) -> bool: ...

    @abc.abstractmethod
    def remove(self, key: StoreKey) -> bool:
        """Forget ``key``; True if the tier held it."""

    def contains(self, key: StoreKey, pin: bool = False) -> bool:
        """Whether the key is held; refreshes its recency, pins on request."""
        return self.touch([key], pin) == 1

    def remove_many(self, keys: Sequence[StoreKey]) -> int:
        """Forget ``keys``; how many the tier held."""
        return sum(self.remove(key) for key in keys)

    def discover(self, keys: Sequence[StoreKey]) -> None:
        """Learn which of ``keys`` the backing store holds that the index
        lacks (nothing to learn where :attr:`supports_discovery` is False)."""
        return None

    # ------------------------------------------------------------ reads, writes

    @abc.abstractmethod
    def read(
        self, keys: Sequence[StoreKey], allocate: Allocator
    ) -> list[MemoryObj | None]:
        """Read ``keys`` in one batch into ``allocate``'s objects (the caller
        owns one reference to each); None for a miss or a bad record."""

    @abc.abstractmethod
    def read_payloads(self, keys: Sequence[StoreKey]) -> list[Payload | None]:
        """Read ``keys`` into fresh aligned buffers (copies between tiers)."""

    @abc.abstractmethod
    def write_payloads(
        self,
        payloads: Sequence[Payload],
        evict_only: Collection[StoreKey] | None = None,
    ) -> list[bool]:
        """Store a batch; True for each chunk stored when this returns. With
        ``evict_only`` no other chunk is evicted to make room."""

    def register_buffers(self, regions: Sequence[memoryview]) -> bool:
        """Declare memory that later reads land in (fixed buffers); True if
        it makes them cheaper."""
        return False

    @abc.abstractmethod
    def close(self) -> None: ...
