"""TieredCache: the warm and cold tiers, the writer and the warm-up, composed.

Everything between LMCache's interface and the tiers lives here, so the
in-process plugin (:mod:`lmcache_tiered.backend`) and the multi-process L2
adapter (:mod:`lmcache_tiered.mp`) share one implementation.

- Lookups and reads fall through warm -> cold (then other hosts' files in a
  shared cold tier); a cold hit is served directly and copied to warm in the
  background.
- Puts are queued to one writer thread that batches them (the in-process
  plugin); the multi-process adapter, which has a store thread of its own,
  writes synchronously through :meth:`TieredCache.store`. Before warm evicts,
  its victims are demoted to cold (``tiered.cold.write: back``), or every
  write goes to both tiers (``through``).
- The warm-up policy sees every lookup, store, hit, eviction and hint; its
  plans run on the promoter thread, after demand reads.

Durability point: a put is *acknowledged* when the writer has written its
payload and then its header to a tier; only then does LMCache's
``on_complete_callback`` run and ``exists_in_put_tasks`` turn false. An
acknowledged put survives a crash of the process (``kill -9``) and is served
after the restart unless capacity evicted it meanwhile; a put not yet
acknowledged is either lost or served whole, never torn. When the
interpreter exits, puts still queued are written first (for at most
``EXIT_FLUSH_S``), even if nobody called :meth:`TieredCache.close`, as vLLM
0.32 never does (see :func:`_flush_at_exit`). With
``tiered.fsync: true`` each write batch is also fdatasync'ed before it is
acknowledged, so it survives a power loss too. A degraded tier (see
:mod:`lmcache_tiered.tier`) is skipped: its lookups fall through to the next
tier and puts go to the tiers that work.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict
from typing import Any, cast

from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered._lmcache import cpu_pool_bytes
from lmcache_tiered.adapter_tier import AdapterTier
from lmcache_tiered.config import ConfigError, TieredConfig, TierSettings
from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.layout import RecordHeader, align_up
from lmcache_tiered.shared import SharedCold
from lmcache_tiered.tier import Allocator, Payload, Tier
from lmcache_tiered.warmup import CacheView, load_policy
from lmcache_tiered.warmup.base import Plan, TierName, WarmupPolicy
from lmcache_tiered.warmup.chains import ChainIndex
from lmcache_tiered.warmup.promoter import Promoter

logger = logging.getLogger("lmcache_tiered")

PutCallback = Callable[[StoreKey], None]
#: Called with keys that may have entered or left the cache (see on_change).
ChangeCallback = Callable[[Sequence[StoreKey]], None]
#: Most bytes of puts waiting for the writer; beyond it puts are dropped so the
#: CPU tier, whose buffers the queued puts hold, never fills up behind them.
MAX_QUEUED_BYTES = 2 << 30
#: Longest an exiting interpreter waits for the puts still queued (seconds)
EXIT_FLUSH_S = 30.0
#: Threads reading the tiers after the first of a demand read (cold, and
#: other hosts' files in a shared cold tier), each in parallel with the others
_READ_THREADS = 4


def load_configured_policy(settings: TieredConfig, view: CacheView) -> WarmupPolicy:
    """The policy ``tiered.warmup.policy`` names, over ``view``, with its own
    ``tiered.warmup.<name>.*`` parameters; ConfigError on a bad name, a bad
    parameter, or ``warm.admit_after_hits`` without the frequency policy."""
    name = settings.warmup_policy
    params = {
        k.split(".", 1)[1]: v
        for k, v in settings.policy_params.items()
        if k.startswith(name + ".")
    }
    if settings.admit_after_hits:
        if name != "frequency":
            raise ConfigError(
                "tiered.warm.admit_after_hits needs tiered.warmup.policy: "
                f"frequency (the policy in use is {name})"
            )
        params.setdefault("admit_after_hits", settings.admit_after_hits)
    return load_policy(name, view, params)


class EmptyView:
    """A CacheView of a cache holding nothing: enough to build a policy and
    so check its settings before the tiers can be opened."""

    def where(self, key: StoreKey) -> TierName | None:
        return None

    def continuation(self, key: StoreKey, limit: int) -> list[StoreKey]:
        return []

    def now(self) -> float:
        return time.monotonic()


class _Batch:
    """Payloads queued for one tier. ``refs`` are the objects whose memory
    the payloads point into, each holding a reference until written (None
    for a payload copied into its own buffer)."""

    __slots__ = ("target", "payloads", "refs", "callback")

    def __init__(self, target: TierName, callback: PutCallback | None) -> None:
        self.target, self.callback = target, callback
        self.payloads: list[Payload] = []
        self.refs: list[MemoryObj | None] = []


#: The writer's queue: batches, flush markers (set once every earlier batch is
#: written) and None, which stops it.
_QueueItem = _Batch | threading.Event | None


class TieredCache:
    """Warm (+ optional cold) tiers with a writer thread and warm-up.

    ``hot`` is LMCache's CPU tier in-process; the multi-process adapter has
    none (plans for hot then go to warm, see the promoter). ``allocate`` gives
    memory for reads that bring no buffers of their own (``read(into=None)``).
    """

    def __init__(
        self,
        settings: TieredConfig,
        *,
        owner: str,
        max_payload: int,
        local_workers: int,
        hot: LocalCPUBackend | None,
        allocate: Allocator | None = None,
    ) -> None:
        self.settings = settings
        self.hot = hot
        self._allocate = allocate
        #: the owner's hook: called with keys that may have entered or left
        #: our tiers (written, evicted, dropped as bad, removed); the truth is
        #: :meth:`holds`. The L2 adapter keeps LMCache's accounting with it.
        self.on_change: ChangeCallback | None = None
        #: how much faster than real time the policies' clock runs: 1 in
        #: production; a replay that runs N x faster than the server it models
        #: sets N, so policies' time settings keep their production meaning
        self.time_scale = 1.0
        self.tiers: dict[TierName, Tier] = {}
        try:
            levels: list[tuple[TierName, TierSettings | None]] = [
                ("warm", settings.warm),
                ("cold", settings.cold),
            ]
            for name, tier_settings in levels:
                if tier_settings is None:
                    continue
                tier = Tier(
                    settings.tier_options(tier_settings),
                    # several hosts may share the cold tier: name files per host
                    owner=owner if name == "warm" else f"{owner}-{settings.host_id}",
                    max_payload=max_payload,
                    # the cap is for the host: each local worker gets a share
                    capacity_bytes=tier_settings.capacity_bytes // local_workers,
                )
                self.tiers[name] = tier
                tier.on_evict = self._evicted_from(name)
            #: the cold tier on a store (tiered.cold.adapter), if configured
            self.store_tier: AdapterTier | None = None
            if settings.cold_adapter is not None:
                self.store_tier = AdapterTier(settings, max_payload=max_payload)
                # it has the surface of a Tier the cache and promoter use
                self.tiers["cold"] = cast(Tier, self.store_tier)
            self.chains = ChainIndex()
            self.policy = self._load_policy()
            # last: its thread must not outlive a constructor that failed
            self.shared = SharedCold(
                None if self.store_tier is not None else self.tiers.get("cold"),
                settings,
                max_payload=max_payload,
            )
        except BaseException:
            for tier in self.tiers.values():
                tier.close()
            raise
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._pending: dict[bytes, int] = {}
        self._queued_bytes = 0
        self.puts_dropped = 0
        self.puts_not_admitted = 0
        #: chunks demand reads took from LMCache's CPU tier instead of disk
        self.reads_from_hot = 0
        self._closed = False
        self._queue: queue.SimpleQueue[_QueueItem] = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._write_loop, name="lmcache-tiered-writer", daemon=True
        )
        self._writer.start()
        _flush_at_exit(self)
        #: reads the other tiers' shares of a demand read while the caller
        #: reads the first one's
        self._reader = ThreadPoolExecutor(
            max_workers=_READ_THREADS, thread_name_prefix="lmcache-tiered-read"
        )
        self.promoter = Promoter(
            policy=self.policy,
            view=self,
            tiers=self.tiers,
            read_cold=self._read_cold,
            store=self.store,
            hot=hot,
            bandwidth_bytes_s=settings.warmup_bandwidth_bytes_s,
            hot_budget_bytes=int(
                settings.warmup_hot_fraction
                * (0 if hot is None else cpu_pool_bytes(hot))
            ),
            tick_s=settings.warmup_tick_s,
            min_precision=settings.warmup_min_precision,
        )

    def _load_policy(self) -> WarmupPolicy:
        name = self.settings.warmup_policy
        for key in self.settings.policy_params:
            if not key.startswith(name + "."):
                logger.warning(
                    "lmcache_tiered: tiered.warmup.%s is ignored: the policy in use "
                    "is %s",
                    key,
                    name,
                )
        return load_configured_policy(self.settings, self)

    @property
    def warm(self) -> Tier:
        return self.tiers["warm"]

    # ------------------------------------------------------------- CacheView

    def where(self, key: StoreKey) -> TierName | None:
        if self.hot is not None and self.hot.contains(key):
            return "hot"
        return self.tier_of(key)

    def tier_of(self, key: StoreKey) -> TierName | None:
        """The highest of our tiers (not hot) that holds ``key``; chunks other
        hosts stored in a shared cold tier count as cold."""
        found = next((n for n, t in self.tiers.items() if t.header(key)), None)
        if found is None and self.shared.find(key) is not None:
            return "cold"
        return found

    def holds(self, key: StoreKey) -> bool:
        """Whether one of our own tiers (not another host's files) holds ``key``:
        what this host stores, and what LMCache's L2 accounting counts."""
        return self.header(key) is not None

    def header(self, key: StoreKey) -> RecordHeader | None:
        """``key``'s record header in the highest of our own tiers holding it."""
        return next(
            (h for t in self.tiers.values() if (h := t.header(key)) is not None), None
        )

    def continuation(self, key: StoreKey, limit: int) -> list[StoreKey]:
        return self.chains.continuation(key, limit)

    def now(self) -> float:
        """Seconds on the policies' clock: ``time.monotonic()`` times
        :attr:`time_scale`."""
        return time.monotonic() * self.time_scale

    # ---------------------------------------------------------------- events

    def _plan(self, event: Callable[..., list[Plan]], *args: Any) -> None:
        """Tell the policy of an event and queue the plans it answers. A
        failing policy is logged: the lookup, read or write that fed it goes
        on (a lookup must not leave its pins behind half-way)."""
        try:
            plans = event(*args)
        except Exception:
            logger.exception(
                "lmcache_tiered: warm-up policy %s failed", self.settings.warmup_policy
            )
            return
        self.promoter.submit(plans)

    def _changed(self, keys: Sequence[StoreKey]) -> None:
        if keys and self.on_change is not None:
            self.on_change(keys)

    def _evicted_from(self, tier: TierName) -> Callable[[list[StoreKey]], None]:
        """The tier's eviction hook: the policy hears of each key, the owner
        of the keys that may now be nowhere (a demoted one is still in cold)."""

        def evicted(keys: list[StoreKey]) -> None:
            for key in keys:
                self._plan(self.policy.on_evict, key, tier)
            self._changed(keys)

        return evicted

    def hint(self, keys: Sequence[StoreKey], deadline: float | None) -> None:
        """An arrival hint: ``keys`` of a request not yet scheduled."""
        self._plan(self.policy.on_hint, keys, deadline)

    # ---------------------------------------------------------------- lookups

    def lookup(
        self, keys: Sequence[StoreKey], pin: bool = False, *, prefix: bool = False
    ) -> list[bool]:
        """Which of ``keys`` (one prefix chain, in order) warm or cold holds;
        those are pinned on request where they are and their recency is
        refreshed. With ``prefix`` the keys after the first miss count as
        misses and are left alone. The policy sees the whole lookup, with the
        leading run of hits as the prefix found: lookups are its signal."""
        held = [False] * len(keys)
        if self.store_tier is not None:
            # chunks other hosts or processes put in the store: one round trip
            self.store_tier.discover([k for k in keys if self.warm.header(k) is None])
        by_tier: dict[TierName, list[StoreKey]] = {}
        for i, key in enumerate(keys):
            tier = self.tier_of(key)
            if tier is None:
                if prefix:
                    break
                continue
            held[i] = True
            by_tier.setdefault(tier, []).append(key)
        for tier, tier_keys in by_tier.items():
            self.tiers[tier].touch(tier_keys, pin)
        self.chains.learn(keys)
        hits = next((i for i, h in enumerate(held) if not h), len(held))
        self._plan(self.policy.on_lookup, keys, hits)
        return held

    def prefix_hits(self, keys: Sequence[StoreKey], pin: bool = False) -> int:
        """Length of the prefix of ``keys`` held in warm or cold (pinned on
        request, recency refreshed); the policy sees the whole lookup."""
        return sum(self.lookup(keys, pin, prefix=True))

    def register_memory(self, address: int, nbytes: int) -> None:
        """Register memory that reads land in (LMCache's CPU pool, the L1
        arena) with each io_uring engine as fixed buffers: no page pinning
        per request. The memory must stay mapped while the tiers are open."""
        region = memoryview((ctypes.c_ubyte * nbytes).from_address(address))
        for tier in self.tiers.values():
            if tier.engine.supports_fixed_buffers:
                tier.engine.register_buffers([region])

    def stored_keys(self) -> list[StoreKey]:
        keys = {k: None for t in self.tiers.values() for k in t.stored_keys()}
        return list(keys)

    def pin(self, key: StoreKey) -> bool:
        tier = self.tier_of(key)
        return tier is not None and self.tiers[tier].pin(key)

    def unpin(self, key: StoreKey) -> bool:
        return any(t.unpin(key) for t in self.tiers.values())

    def remove(self, key: StoreKey) -> bool:
        removed = sum(t.remove(key) for t in self.tiers.values()) > 0
        if removed:
            self._changed([key])
        return removed

    def is_pending(self, key: StoreKey) -> bool:
        return key_digest(key) in self._pending

    # ------------------------------------------------------------------ reads

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
        objs: list[MemoryObj | None] = [None] * len(keys)
        #: indices a tier found and gave memory to: a miss among them is a
        #: record that failed its checks (dropped) or a device error
        tried: set[int] = set()
        wanted = [i for i in range(len(keys)) if into is None or into[i] is not None]
        if into is None:
            wanted = self._read_hot(keys, wanted, objs)
        order = self._read_order()
        with self.promoter.demand([keys[i] for i in wanted]):
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
                self._reader.submit(
                    self._read_tier, order[n], keys, share, into, objs, tried
                )
                for n, share in parts[1:]
            ]
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
        if self.hot is None:
            return wanted
        served: list[StoreKey] = []
        left = []
        # each found object comes with the caller's reference taken
        found = self.hot.batched_get_blocking([keys[i] for i in wanted])
        for i, obj in zip(wanted, found, strict=True):
            if obj is None:
                left.append(i)
            else:
                objs[i] = obj
                served.append(keys[i])
        if served:
            self.reads_from_hot += len(served)
            self.promoter.used(served)
        return left

    def _read_tier(
        self,
        tier_entry: tuple[TierName, Tier],
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
        found = tier.read([keys[i] for i in missing], allocate)
        for i, obj in zip(missing, found, strict=True):
            if obj is not None and into is not None:
                obj.ref_count_down()  # the one _read_memory took
            objs[i] = obj
        hits = [(keys[i], o) for i, o in zip(missing, found, strict=True) if o]
        for key, _ in hits:
            self._plan(self.policy.on_hit, key, name)
        if name == "cold" and hits and "warm" in self.tiers:
            # The caller may reuse its own buffers as soon as this
            # returns, so their bytes are copied now (a memcpy: far
            # cheaper than reading cold again, and it does not hold up
            # the read as a warm write, with its demotions, would).
            # LMCache's CPU-tier objects are referenced until written.
            self._enqueue("warm", hits, None, copy=into is not None)

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

    def _read_order(self) -> list[tuple[TierName, Tier]]:
        """Our tiers, then the other hosts' files in a shared cold tier."""
        return [*self.tiers.items(), *(("cold", t) for t in self.shared.tiers())]

    def _read_cold(self, keys: Sequence[StoreKey]) -> list[Payload | None]:
        """Read ``keys`` from cold, ours then the other hosts' files, into
        fresh buffers (the promoter's copies to warm)."""
        payloads: list[Payload | None] = [None] * len(keys)
        for name, tier in self._read_order():
            missing = [i for i, p in enumerate(payloads) if p is None]
            if name != "cold" or not missing:
                continue
            found = tier.read_payloads([keys[i] for i in missing])
            for i, payload in zip(missing, found, strict=True):
                payloads[i] = payload
        return payloads

    # ----------------------------------------------------------------- writes

    def select_new(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Which of a request's new chunks (one prefix chain, in order) to
        write: the policy sees the chain and may refuse admission; keys
        already stored are skipped."""
        self.chains.learn(keys)
        self._plan(self.policy.on_store, keys)
        chosen = []
        for key in keys:
            admitted = self.policy.admit(key)
            if not admitted:
                self.puts_not_admitted += 1
            chosen.append(admitted and self.tier_of(key) is None)
        return chosen

    def put(
        self,
        keys: Sequence[StoreKey],
        objs: Sequence[MemoryObj],
        callback: PutCallback | None = None,
    ) -> None:
        """Queue a request's new chunks (prefix order) for the writer; return
        at once (see :meth:`select_new`)."""
        if not self.tiers or self._closed:
            return
        chosen = self.select_new(keys)
        items = [(k, o) for k, o, c in zip(keys, objs, chosen, strict=True) if c]
        self._enqueue("warm", items, callback)

    def _enqueue(
        self,
        target: TierName,
        items: Sequence[tuple[StoreKey, MemoryObj]],
        callback: PutCallback | None,
        *,
        copy: bool = False,
    ) -> None:
        """Hand a batch to the writer. Each object is referenced until it is
        written (LMCache drops its own as soon as the put call returns), or
        with ``copy`` its bytes are copied now (for a buffer its owner may
        reuse at once)."""
        chosen = []
        with self._lock:
            for key, obj in items:
                digest, size = key_digest(key), obj.get_size()
                if digest in self._pending:
                    continue
                if self._queued_bytes + size > MAX_QUEUED_BYTES:
                    self.puts_dropped += 1
                    continue
                if not copy:
                    obj.ref_count_up()
                self._pending[digest] = size
                self._queued_bytes += size
                chosen.append((key, obj))
        batch = _Batch(target, callback)
        for key, obj in chosen:
            payload = Payload.of(key, obj)
            if copy:
                buffer = aligned_buffer(align_up(len(payload.view)))
                buffer[: len(payload.view)] = payload.view
                payload = dataclasses.replace(
                    payload, view=buffer[: len(payload.view)], direct=True
                )
            batch.payloads.append(payload)
            batch.refs.append(None if copy else obj)
        if batch.payloads:
            self._queue.put(batch)

    def _write_loop(self) -> None:
        """Drain the queue: everything waiting goes to the tiers at once."""
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            batches = [b for b in items if isinstance(b, _Batch)]
            if batches:
                try:
                    self._write(batches)
                except Exception:
                    logger.exception("lmcache_tiered: write failed")
                finally:
                    self._release(batches)
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if None in items:
                return

    def _write(self, batches: list[_Batch]) -> None:
        done = iter(self.store([p for b in batches for p in b.payloads]))
        for batch in batches:
            for payload in batch.payloads:
                if next(done) and batch.callback is not None:
                    try:
                        batch.callback(payload.key)
                    except Exception:
                        logger.exception("lmcache_tiered: put callback failed")

    def store(self, payloads: list[Payload]) -> list[bool]:
        """Write chunks to warm without losing any: first warm's next victims
        are copied to cold (write-back), then what warm cannot take goes to
        cold; with write-through every chunk goes to both. True for each
        chunk stored (payload, then header, written) when this returns.

        The writer, the promoter and the L2 adapter's store thread all store;
        one lock keeps a victim from being overwritten between its demotion
        and the write (it is held across I/O, but only ever by those
        background threads).
        """
        cold = self.tiers.get("cold")
        through = self.settings.cold_write_through
        with self._store_lock:
            victims = None
            if cold is not None and not through:
                victims = self.warm.victims(len(payloads))
                self._demote(victims, cold)
            # a victim read (touched) meanwhile is kept, never a chunk not in cold
            stored = self.warm.write_payloads(payloads, evict_only=victims)
            if cold is not None:
                # through: every chunk goes below too; back: what warm refused
                below = [i for i, ok in enumerate(stored) if through or not ok]
                if below:
                    cold_ok = cold.write_payloads([payloads[i] for i in below])
                    for i, ok in zip(below, cold_ok, strict=True):
                        stored[i] = stored[i] or ok
        self._changed([p.key for p in payloads])
        return stored

    def _demote(self, victims: list[StoreKey], cold: Tier) -> None:
        """Copy warm's next victims to cold before they are overwritten."""
        missing = [k for k in victims if cold.header(k) is None]
        if missing:
            payloads = [p for p in self.warm.read_payloads(missing) if p is not None]
            cold.write_payloads(payloads)

    def _release(self, batches: list[_Batch]) -> None:
        for batch in batches:
            for payload, ref in zip(batch.payloads, batch.refs, strict=True):
                with self._lock:
                    self._queued_bytes -= self._pending.pop(key_digest(payload.key), 0)
                if ref is not None:
                    ref.ref_count_down()

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every put queued so far is written, or ``timeout``
        seconds; False if some were still queued then."""
        if self._closed:
            return True
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout)

    def flush_at_exit(self) -> None:
        """Write the puts still queued, for at most ``EXIT_FLUSH_S``; the
        interpreter is exiting and close() was not called."""
        queued = len(self._pending)
        if self._closed or not queued:
            return
        if self.flush(EXIT_FLUSH_S):
            logger.info("lmcache_tiered: at exit, wrote %d queued puts", queued)
        else:
            logger.warning(
                "lmcache_tiered: at exit, %d puts still queued after %.0f s: lost",
                len(self._pending),
                EXIT_FLUSH_S,
            )

    # --------------------------------------------------------------- metrics

    def snapshot(self) -> dict[str, Any]:
        """Counters of every tier and of the warm-up policy, as plain data."""
        warmup = asdict(self.promoter.stats)
        warmup["policy"] = self.settings.warmup_policy
        warmup["precision"] = self.promoter.stats.precision
        return {
            "tiers": {
                name: asdict(t.stats)
                | {"used_bytes": t.used_bytes, "chunks": len(t), "degraded": t.degraded}
                for name, t in self.tiers.items()
            },
            "warmup": warmup,
            "puts_dropped": self.puts_dropped,
            "puts_not_admitted": self.puts_not_admitted,
            "reads_from_hot": self.reads_from_hot,
        }

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Write every queued put, stop the threads, close the tiers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.promoter.close()
        self._queue.put(None)
        self._writer.join()
        self._reader.shutdown()
        self.shared.close()
        for tier in self.tiers.values():
            tier.close()


def _flush_at_exit(cache: TieredCache) -> None:
    """Have ``cache`` write its queued puts when the interpreter exits.

    vLLM 0.32's LMCacheConnectorV1 never shuts LMCache down, so close() never
    runs and the daemon writer would die with its queue. The hook runs where
    ``concurrent.futures`` runs its own: in ``threading._register_atexit``,
    before Python joins non-daemon threads, because LMCache's storage-manager
    loop thread never ends and an ``atexit`` hook would never be reached.
    It holds only a weak reference: a closed, dropped cache costs nothing.
    """
    ref = weakref.ref(cache)

    def flush() -> None:
        if (alive := ref()) is not None:
            alive.flush_at_exit()

    register = getattr(threading, "_register_atexit", atexit.register)
    with contextlib.suppress(RuntimeError):  # the interpreter is shutting down
        register(flush)
