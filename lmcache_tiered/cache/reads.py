"""Demand reads: every tier reads its share of a request at once.

A demand read first hands out what LMCache's CPU tier already holds, then
splits the rest by the tier that holds each key (warm, cold, then other
hosts' files in a shared cold tier) and reads all shares in parallel, so a
remote cold read overlaps the local warm one instead of following it. A key
that moved meanwhile or failed a tier's checks is then tried in the other
tiers in turn. Reads land in the caller's buffers or in memory from the
cache's allocator; cold hits are queued for a copy to warm.

May touch: the tiers it is given (reads only), LMCache's CPU tier (lookups
of what it holds), the promoter's demand gate (warm-up waits while a demand
read runs) and the writer (cold hits' copies to warm). The policy hears of
each hit through the ``on_hit`` callback; the cache's owner of keys that
failed their checks through ``changed``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered.cache.admission import ReadAdmission
from lmcache_tiered.cache.writer import Writer
from lmcache_tiered.io import base as io_base
from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.storage.base import StorageTier
from lmcache_tiered.storage.layout import RecordHeader
from lmcache_tiered.storage.payload import Allocator
from lmcache_tiered.warmup.base import TierName
from lmcache_tiered.warmup.promoter import Promoter

logger = logging.getLogger("lmcache_tiered")

#: Threads reading the tiers after the first of a demand read (cold, and
#: other hosts' files in a shared cold tier), each in parallel with the others
READ_THREADS = 4

#: The tiers a read may use, in the order a key is looked for.
ReadOrder = Callable[[], list[tuple[TierName, StorageTier]]]


class DemandReader:
    """Reads of ``keys`` for LMCache, over the tiers ``order`` lists."""

    def __init__(
        self,
        *,
        admission: ReadAdmission,
        order: ReadOrder,
        hot: LocalCPUBackend | None,
        allocate: Allocator | None,
        promoter: Promoter,
        writer: Writer,
        on_hit: Callable[[StoreKey, TierName], None],
        changed: Callable[[Sequence[StoreKey]], None],
    ) -> None:
        self._admission = admission
        self._order = order
        self._hot = hot
        self._allocate = allocate
        self._promoter = promoter
        self._writer = writer
        self._on_hit = on_hit
        self._changed = changed
        #: chunks demand reads took from LMCache's CPU tier instead of disk
        self.reads_from_hot = 0
        #: reads the other tiers' shares of a demand read while the caller
        #: reads the first one's
        self._pool = ThreadPoolExecutor(
            max_workers=READ_THREADS, thread_name_prefix="lmcache-tiered-read"
        )
        #: the pool's reads not yet done (set.add/discard: atomic under the GIL)
        self._running: set[Future[None]] = set()

    def read(
        self,
        keys: Sequence[StoreKey],
        into: Sequence[MemoryObj | None] | None = None,
    ) -> list[MemoryObj | None]:
        """Demand read: every tier reads the keys it holds in one batch, all
        tiers at once; a key that moved meanwhile or failed a tier's checks is
        then tried in the other tiers in turn. Cold hits are queued for a copy
        to warm.

        Without ``into`` a key LMCache's CPU tier holds is served from there
        (see :meth:`_read_hot`), each other object comes from ``allocate``,
        and the caller owns one reference to each. ``into`` are the caller's
        buffers instead, one per key (None: skip the key); a record of another
        size is a miss, and the result is the buffer itself, its reference
        count unchanged.
        """
        if into is None and self._allocate is None:
            raise ValueError("TieredCache.read: no buffers given and no allocator")
        if self._admission.recompute_tokens_per_s is None:
            return self._read(keys, into)
        promises = self._admission.read_begins(keys)
        objs = self._read(keys, into)
        self._admission.read_done(promises)
        return objs

    def _read(
        self,
        keys: Sequence[StoreKey],
        into: Sequence[MemoryObj | None] | None,
    ) -> list[MemoryObj | None]:
        objs: list[MemoryObj | None] = [None] * len(keys)
        #: indices a tier found and gave memory to: a miss among them is a
        #: record that failed its checks (dropped) or a device error
        tried: set[int] = set()
        wanted = [i for i in range(len(keys)) if into is None or into[i] is not None]
        if into is None:
            wanted = self._read_hot(keys, wanted, objs)
        order = self._order()
        with self._promoter.demand([keys[i] for i in wanted]):
            # each tier reads its share at once: a remote cold read overlaps
            # the local warm one instead of following it
            shares: dict[int, list[int]] = {}
            for i in wanted:
                holder = next(
                    (n for n, (_, t) in enumerate(order) if t.header(keys[i])), None
                )
                if holder is not None:
                    shares.setdefault(holder, []).append(i)
            parts = list(shares.items())
            reads = [
                self._pool.submit(
                    self._read_tier, order[n], keys, share, into, objs, tried
                )
                for n, share in parts[1:]
            ]
            for running in reads:
                self._running.add(running)
                running.add_done_callback(self._running.discard)
            try:
                for n, share in parts[:1]:
                    self._read_tier(order[n], keys, share, into, objs, tried)
            finally:
                # never return while a pool read still writes into the
                # caller's buffers
                wait(reads)
            for read in reads:
                read.result()
            # keys that moved meanwhile or failed a tier's checks: the other
            # tiers in turn
            for n, tier_entry in enumerate(order):
                done = set(shares.get(n, ()))
                missing = [i for i in wanted if objs[i] is None and i not in done]
                if missing:
                    self._read_tier(tier_entry, keys, missing, into, objs, tried)
        self._changed([keys[i] for i in tried if objs[i] is None])
        return objs

    def _read_hot(
        self,
        keys: Sequence[StoreKey],
        wanted: list[int],
        objs: list[MemoryObj | None],
    ) -> list[int]:
        """Hand out LMCache's own CPU-tier copy of each wanted key it holds;
        the indices left to read from disk.

        LMCache's lookup gives a backend the rest of a prefix from the first
        chunk its CPU tier lacks, so a later chunk in memory (one the promoter
        brought there, or one a store left) would otherwise be read from disk.
        The caller owns one reference to each object, as with a read.
        """
        if self._hot is None:
            return wanted
        served: list[StoreKey] = []
        left = []
        # each found object comes with the caller's reference taken
        found = self._hot.batched_get_blocking([keys[i] for i in wanted])
        for i, obj in zip(wanted, found, strict=True):
            if obj is None:
                left.append(i)
            else:
                objs[i] = obj
                served.append(keys[i])
        if served:
            self.reads_from_hot += len(served)  # a promotion among them: used
        return left

    def _read_tier(
        self,
        tier_entry: tuple[TierName, StorageTier],
        keys: Sequence[StoreKey],
        missing: list[int],
        into: Sequence[MemoryObj | None] | None,
        objs: list[MemoryObj | None],
        tried: set[int],
    ) -> None:
        """One tier's batch read of ``keys[missing]`` into ``objs``; the
        policy hears of each hit, and cold hits are queued for warm."""
        name, tier = tier_entry
        allocate = self._read_memory(keys, missing, into, tried)
        wanted = [keys[i] for i in missing]
        if self._admission.recompute_tokens_per_s is None:
            found = tier.read(wanted, allocate)  # the rule is off: nothing to time
        else:
            nbytes = sum(h.payload_size for k in wanted if (h := tier.header(k)))
            with self._admission.reading(name, nbytes):
                found = tier.read(wanted, allocate)
        for i, obj in zip(missing, found, strict=True):
            if obj is not None and into is not None:
                obj.ref_count_down()  # the one _read_memory took
            objs[i] = obj
        hits = [(keys[i], o) for i, o in zip(missing, found, strict=True) if o]
        for key, _ in hits:
            self._on_hit(key, name)
        if name == "cold" and hits:
            # The caller may reuse its own buffers as soon as this
            # returns, so their bytes are copied now (a memcpy: far
            # cheaper than reading cold again, and it does not hold up
            # the read as a warm write, with its demotions, would).
            # LMCache's CPU-tier objects are referenced until written.
            self._writer.enqueue(hits, None, copy=into is not None)

    def _read_memory(
        self,
        keys: Sequence[StoreKey],
        missing: Sequence[int],
        into: Sequence[MemoryObj | None] | None,
        tried: set[int],
    ) -> Allocator:
        """Memory for one tier's read of ``keys[missing]``: the caller's buffer
        of that key (repeated keys take theirs in order), or ``allocate``'s."""
        queues: dict[bytes, deque[int]] = {}
        for i in missing:
            queues.setdefault(key_digest(keys[i]), deque()).append(i)

        def allocate(header: RecordHeader) -> MemoryObj | None:
            i = queues[key_digest(header.key)].popleft()
            if into is None:
                assert self._allocate is not None  # checked by read()
                obj = self._allocate(header)
            else:
                obj = into[i]
                if obj is None or obj.get_size() != header.payload_size:
                    return None
                # the tier drops a reference on a failed read: give it one,
                # so the caller's count never changes (read() drops it on
                # success)
                obj.ref_count_up()
            if obj is not None:
                tried.add(i)
            return obj

        return allocate

    def close(self) -> None:
        """Stop the pool, waiting at most CLOSE_WAIT_S for its reads: one
        stuck in a hung drive is left behind (one WARNING)."""
        self._pool.shutdown(wait=False)  # queued reads still run
        _, stuck = wait(list(self._running), timeout=io_base.CLOSE_WAIT_S)
        if stuck:
            logger.warning(
                "lmcache_tiered: closing with %d tier reads still running after "
                "%.3g s (a hung drive?): left behind",
                len(stuck),
                io_base.CLOSE_WAIT_S,
            )
