"""What the cache asks of a storage tier, whatever stores the bytes.

Two kinds of tier serve it: :class:`lmcache_tiered.storage.tier.Tier` (files on
NVMe: striped, O_DIRECT, its own index and eviction) and
:class:`lmcache_tiered.storage.adapter_tier.AdapterTier` (a cold tier on a store
behind one of LMCache's L2 adapters: Redis, S3, ...). The cache, the demand
reader, the promoter and the two LMCache front ends (the in-process plugin's
ready line, the L2 adapter's ready line and status) use a tier only through
:class:`StorageTier`; mypy checks both classes against it where
:class:`lmcache_tiered.cache.tiered_cache.TieredCache` puts them in its ``tiers``. What
only one kind has (a file tier's victims, geometry and eviction hook, a
store's discovery of other hosts' chunks) is asked of that class by name.

This room holds types only: no state, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from lmcache.v1.memory_management import MemoryObj

from lmcache_tiered.keys import StoreKey
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage.layout import RecordHeader
from lmcache_tiered.storage.payload import Allocator, Payload


class TierEngine(Protocol):
    """What a tier reports of the engine that moves its bytes."""

    @property
    def name(self) -> str:
        """Short name for logs and status (``uring``, ``threads``, ``l2:resp``)."""

    @property
    def supports_fixed_buffers(self) -> bool:
        """Whether :meth:`register_buffers` can make transfers cheaper."""

    def register_buffers(self, regions: Sequence[memoryview]) -> bool:
        """Declare memory that later reads land in; True if it helps."""


class StorageTier(Protocol):
    """One level of storage: what it holds, reads, writes and reports."""

    @property
    def name(self) -> str:
        """``warm`` or ``cold``: the tier's place, in logs and settings."""

    @property
    def paths(self) -> Sequence[str]:
        """The tier's directories (none for a store)."""

    @property
    def direct_io(self) -> bool:
        """Whether reads and writes bypass the page cache."""

    @property
    def engine(self) -> TierEngine: ...

    @property
    def stats(self) -> TierStats:
        """Counters: hits, misses, puts, bytes, errors, degradations."""

    @property
    def degraded(self) -> str | None:
        """Why the tier serves nothing now (None: healthy)."""

    @property
    def writes_refused(self) -> str | None:
        """Why the tier takes no writes while it serves reads (None: it
        takes them)."""

    @property
    def used_bytes(self) -> int:
        """Bytes of storage the tier holds."""

    def __len__(self) -> int:
        """Chunks the tier knows it holds."""

    def header(self, key: StoreKey) -> RecordHeader | None:
        """``key``'s record header if the tier holds it (no I/O)."""

    def touch(self, keys: Sequence[StoreKey], pin: bool = False) -> int:
        """Refresh the recency of the held ``keys`` (pin them on request);
        how many are held."""

    def stored_keys(self) -> list[StoreKey]: ...

    def pin(self, key: StoreKey) -> bool: ...

    def unpin(self, key: StoreKey) -> bool: ...

    def remove(self, key: StoreKey) -> bool:
        """Forget ``key``; True if the tier held it."""

    def read(
        self, keys: Sequence[StoreKey], allocate: Allocator
    ) -> list[MemoryObj | None]:
        """Read ``keys`` in one batch into ``allocate``'s objects (the caller
        owns one reference to each); None for a miss or a bad record."""

    def read_payloads(self, keys: Sequence[StoreKey]) -> list[Payload | None]:
        """Read ``keys`` into fresh aligned buffers (copies between tiers)."""

    def write_payloads(
        self,
        payloads: Sequence[Payload],
        evict_only: Collection[StoreKey] | None = None,
    ) -> list[bool]:
        """Store a batch; True for each chunk stored when this returns. With
        ``evict_only`` no other chunk is evicted to make room."""

    def close(self) -> None: ...
