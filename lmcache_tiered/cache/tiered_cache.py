"""TieredCache: the warm and cold tiers, the writer and the warm-up, composed.

Everything between LMCache's interface and the tiers lives here, so the
in-process plugin (:mod:`lmcache_tiered.integration.backend`) and the
multi-process L2 adapter (:mod:`lmcache_tiered.integration.mp`) share one
implementation. This module opens the tiers, answers lookups (the policy's
signal), stores with demotion, and dispatches events to the warm-up policy;
the work itself is in the modules it composes:

- Demand reads fan out over the tiers in :mod:`lmcache_tiered.cache.reads`
  (warm -> cold, then other hosts' files in a shared cold tier); a cold hit
  is served directly and copied to warm in the background.
- Puts are queued to the writer (:mod:`lmcache_tiered.cache.writer`), one thread
  that batches them (the in-process plugin); the multi-process adapter, which
  has a store thread of its own, writes synchronously through
  :meth:`TieredCache.store`. Before warm evicts, its victims are demoted to
  cold (``tiered.cold.write: back``), or every write goes to both tiers
  (``through``).
- The warm-up policy sees every lookup, store, hit, eviction and hint; its
  plans run on the promoter thread (:mod:`lmcache_tiered.warmup.promoter`),
  after demand reads.

May touch: the tiers (through
:class:`lmcache_tiered.storage.base.StorageTier`),
LMCache's CPU tier (lookups only; the promoter and reader use it), the policy,
and the owner's ``on_change`` hook. It never does I/O itself.

Durability point: a put is *acknowledged* when the writer has written its
payload and then its header to a tier; only then does LMCache's
``on_complete_callback`` run and ``exists_in_put_tasks`` turn false. An
acknowledged put survives a crash of the process (``kill -9``) and is served
after the restart unless capacity evicted it meanwhile; a put not yet
acknowledged is either lost or served whole, never torn. When the
interpreter exits, puts still queued are written first (for at most
:data:`lmcache_tiered.cache.writer.EXIT_FLUSH_S`), even if nobody called
:meth:`TieredCache.close`, as vLLM 0.32 never does. With
``tiered.fsync: true`` each write batch is also fdatasync'ed before it is
acknowledged, so it survives a power loss too. A degraded tier (see
:mod:`lmcache_tiered.storage.tier`) is skipped: its lookups fall through to the next
tier and puts go to the tiers that work.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_tiered._lmcache import cpu_pool_bytes
from lmcache_tiered.cache.admission import DEFAULT_CHUNK_TOKENS, ReadAdmission
from lmcache_tiered.cache.reads import DemandReader
from lmcache_tiered.cache.shared import SharedCold
from lmcache_tiered.cache.writer import PutCallback, Writer
from lmcache_tiered.config import ConfigError, TieredConfig, TierSettings, setting_key
from lmcache_tiered.keys import StoreKey
from lmcache_tiered.storage.adapter_tier import AdapterTier
from lmcache_tiered.storage.base import StorageTier
from lmcache_tiered.storage.directories import DirectoryHold
from lmcache_tiered.storage.layout import RecordHeader, TierNames
from lmcache_tiered.storage.seal import load_seal
from lmcache_tiered.storage.tier import Allocator, Payload, Tier
from lmcache_tiered.warmup import CacheView, load_policy
from lmcache_tiered.warmup.base import Plan, TierName, WarmupPolicy
from lmcache_tiered.warmup.chains import ChainIndex
from lmcache_tiered.warmup.promoter import Promoter
from lmcache_tiered.warmup.warm_copies import WARM_SHARE

logger = logging.getLogger("lmcache_tiered")

#: Called with keys that may have entered or left the cache (see on_change).
ChangeCallback = Callable[[Sequence[StoreKey]], None]


def tier_owner(tier: str, owner: str, settings: TieredConfig) -> str:
    """The owner name of tier ``tier``'s files: several hosts may share the
    cold tier, so its files are named per host."""
    return owner if tier == "warm" else TierNames.host_owner(owner, settings.host_id)


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
                f"{setting_key('warm.admit_after_hits')} needs "
                f"{setting_key('warmup.policy')}: frequency (the policy in use is "
                f"{name})"
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


class TieredCache:
    """Warm (+ optional cold) tiers with a writer thread and warm-up.

    ``hot`` is LMCache's CPU tier in-process; the multi-process adapter has
    none (plans for hot then go to warm, see the promoter). ``allocate`` gives
    memory for reads that bring no buffers of their own (``read(into=None)``).
    ``holds``: tiers' directories this process already holds; each tier
    adopts its lock as it opens. ``chunk_tokens``: LMCache's chunk size
    (the read-time admission's tokens per full chunk).
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
        holds: Mapping[str, DirectoryHold] | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        self.settings = settings
        self.hot = hot
        #: the owner's hook: called with keys that may have entered or left
        #: our tiers (written, evicted, dropped as bad, removed); the truth is
        #: :meth:`holds`. The L2 adapter keeps LMCache's accounting with it.
        self.on_change: ChangeCallback | None = None
        self.tiers: dict[TierName, StorageTier] = {}
        try:
            levels: list[tuple[TierName, TierSettings | None]] = [
                ("warm", settings.warm),
                ("cold", settings.cold),
            ]
            files: dict[TierName, Tier] = {}
            holds = holds or {}
            seal = (
                None
                if settings.cold_auth_key_file is None
                else load_seal(
                    settings.cold_auth_key_file, setting_key("cold.auth_key_file")
                )
            )
            for name, tier_settings in levels:
                if tier_settings is None:
                    continue
                files[name] = self.tiers[name] = Tier(
                    settings.tier_options(tier_settings),
                    owner=tier_owner(name, owner, settings),
                    max_payload=max_payload,
                    # the cap is for the host: each local worker gets a share
                    capacity_bytes=tier_settings.capacity_bytes // local_workers,
                    held_lock=None if name not in holds else holds[name].adopt,
                    seal=seal if name == "cold" else None,
                    # other hosts read a cold tier's files (SharedCold)
                    change_log=name == "cold",
                )
            #: always files: the store asks for its victims, the L2 adapter
            #: for its geometry
            self.warm = files["warm"]
            if settings.cold_adapter is not None:
                self.tiers["cold"] = AdapterTier(
                    settings, max_payload=max_payload, seal=seal
                )
            for name, tier in self.tiers.items():
                if not tier.evicts_itself:  # a store's evictions are unseen
                    tier.on_evict = self._evicted_from(name)
            self.chains = ChainIndex()
            self.policy = self._load_policy()
            # last: its thread must not outlive a constructor that failed
            self.shared = SharedCold(
                files.get("cold"), settings, max_payload=max_payload, seal=seal
            )
        except BaseException:
            for opened in self.tiers.values():
                opened.close()
            raise
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()
        self.puts_not_admitted = 0
        self._closed = False
        # late-bound: a replaced ``store`` (a test's stuck writer) is the one used
        self.writer = Writer(lambda payloads: self.store(payloads))
        self.promoter = Promoter(
            policy=self.policy,
            view=self,
            tiers=self.tiers,
            read_cold=self._read_cold,
            store=self.store,
            # hot_fraction 0: no promotions into LMCache's CPU tier at all
            hot=hot if settings.warmup_hot_fraction > 0 else None,
            bandwidth_bytes_s=settings.warmup_bandwidth_bytes_s,
            hot_budget_bytes=int(
                settings.warmup_hot_fraction
                * (0 if hot is None else cpu_pool_bytes(hot))
            ),
            warm_budget_bytes=int(
                WARM_SHARE * settings.warm.capacity_bytes // local_workers
            ),
            tick_s=settings.warmup_tick_s,
            min_precision=settings.warmup_min_precision,
        )
        #: the read-time admission rule (off without recompute_tokens_per_s)
        self.admission = ReadAdmission(
            settings.recompute_tokens_per_s,
            full_chunk_bytes=max_payload,
            chunk_tokens=chunk_tokens,
        )
        self.reader = DemandReader(
            admission=self.admission,
            order=self._read_order,
            hot=hot,
            allocate=allocate,
            promoter=self.promoter,
            writer=self.writer,
            on_hit=lambda key, tier: self._plan(self.policy.on_hit, key, tier),
            changed=self._changed,
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
        """Seconds on the policies' clock: ``time.monotonic()``."""
        return time.monotonic()

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

    def describe(self) -> str:
        """The tiers and the policy, for the faces' one ready line."""
        tiers = ", ".join(
            f"{name} {len(t.paths)} path(s), {len(t)} chunks, "
            f"engine {t.engine_name}, O_DIRECT {t.direct_io}"
            for name, t in self.tiers.items()
        )
        return f"{tiers}; warm-up policy {self.settings.warmup_policy}"

    # ---------------------------------------------------------------- lookups

    def lookup(
        self,
        keys: Sequence[StoreKey],
        pin: bool = False,
        *,
        prefix: bool = False,
        rooted: bool = False,
    ) -> list[bool]:
        """Which of ``keys`` (one prefix chain, in order) warm or cold holds;
        those are pinned on request where they are and their recency is
        refreshed. With ``prefix`` the keys after the first miss count as
        misses and are left alone; ``rooted``: ``keys`` start at a prompt's
        first chunk. The policy sees the whole lookup, with the leading run
        of hits as the prefix found: lookups are its signal."""
        held = [False] * len(keys)
        cold = self.tiers.get("cold")
        if cold is not None and cold.supports_discovery:
            # chunks other hosts or processes put in the store: one round trip
            cold.discover([k for k in keys if self.warm.header(k) is None])
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
        self.chains.learn(keys, rooted)
        hits = next((i for i, h in enumerate(held) if not h), len(held))
        self.promoter.scheduled(keys)
        self._plan(self.policy.on_lookup, keys, hits)
        return held

    def prefix_hits(self, keys: Sequence[StoreKey], pin: bool = False) -> int:
        """Length of the prefix of ``keys`` held in warm or cold that the
        tiers can deliver before it would be recomputed (pinned on request,
        recency refreshed); the policy sees the whole lookup."""
        return self.admitted(keys, sum(self.lookup(keys, pin, prefix=True)), pin)

    def admitted(self, keys: Sequence[StoreKey], hits: int, pin: bool) -> int:
        """Of the first ``hits`` of ``keys`` (held), how many to answer: the
        read-time admission's prefix (:mod:`lmcache_tiered.cache.admission`);
        those left out are unpinned again (LMCache will not). Only a pinning
        lookup is judged: vLLM's lookups pin what they will load, and an
        unpinned check (LMCache asking whether a chunk exists before it
        stores it) reads nothing."""
        if self.admission.recompute_tokens_per_s is None or not hits or not pin:
            return hits  # the rule is off, or nothing will be read: all held
        chunks: list[tuple[TierName, int]] = []
        order = self._read_order()  # a shared cold tier's other hosts too
        for key in keys[:hits]:
            found = next(((n, h) for n, tier in order if (h := tier.header(key))), None)
            if found is None:
                break  # gone since the lookup
            chunks.append((found[0], found[1].payload_size))
        admitted = self.admission.admit(keys, chunks)
        for key in keys[admitted:hits]:
            self.unpin(key)
        return admitted

    def register_memory(self, address: int, nbytes: int) -> None:
        """Register memory that reads land in (LMCache's CPU pool, the L1
        arena) with each io_uring engine as fixed buffers: no page pinning
        per request. The memory must stay mapped while the tiers are open."""
        region = memoryview((ctypes.c_ubyte * nbytes).from_address(address))
        for tier in self.tiers.values():
            tier.register_buffers([region])

    def stored_keys(self) -> list[StoreKey]:
        keys = {k: None for t in self.tiers.values() for k in t.stored_keys()}
        return list(keys)

    def pin(self, key: StoreKey) -> bool:
        tier = self.tier_of(key)
        return tier is not None and self.tiers[tier].pin(key)

    def unpin(self, key: StoreKey) -> bool:
        self.admission.unpinned(key)
        return any(t.unpin(key) for t in self.tiers.values())

    def remove(self, key: StoreKey) -> bool:
        removed = sum(t.remove(key) for t in self.tiers.values()) > 0
        if removed:
            self._changed([key])
        return removed

    def is_pending(self, key: StoreKey) -> bool:
        return self.writer.is_pending(key)

    # ------------------------------------------------------------------ reads

    def read(
        self,
        keys: Sequence[StoreKey],
        into: Sequence[MemoryObj | None] | None = None,
    ) -> list[MemoryObj | None]:
        """Demand read of ``keys`` from every tier at once (see
        :meth:`lmcache_tiered.cache.reads.DemandReader.read`)."""
        return self.reader.read(keys, into)

    def _read_order(self) -> list[tuple[TierName, StorageTier]]:
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
        self.writer.enqueue(items, callback)

    @contextlib.contextmanager
    def stores_held(self) -> Iterator[None]:
        """While held, nothing is written to any tier (puts, demotions and
        promotions' copies wait): what a tier holds stays as it is, for a
        consistent look at it (tests, ops)."""
        with self._store_lock:
            yield

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every put queued so far is written, or ``timeout``
        seconds; False if some were still queued then."""
        return self.writer.flush(timeout)

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
        with self.stores_held():
            evictable = None
            if cold is not None and not through:
                evictable = self._demote(self.warm.victims(len(payloads)), cold)
            # a victim read (touched) meanwhile is kept, never a chunk not in cold
            stored = self.warm.write_payloads(payloads, evict_only=evictable)
            if cold is not None:
                # through: every chunk goes below too; back: what warm refused
                below = [i for i, ok in enumerate(stored) if through or not ok]
                if below:
                    cold_ok = cold.write_payloads([payloads[i] for i in below])
                    for i, ok in zip(below, cold_ok, strict=True):
                        stored[i] = stored[i] or ok
        self._changed([p.key for p in payloads])
        return stored

    def _demote(self, victims: list[StoreKey], cold: StorageTier) -> list[StoreKey]:
        """Copy warm's next victims to cold before they are overwritten; the
        ones warm may evict: those cold now holds. A victim whose copy failed
        stays in warm, and the chunk that wanted its room is refused instead:
        a stored chunk is not dropped for a new one while cold works. A
        degraded cold tier takes nothing until it recovers, so warm is the
        last tier meanwhile and evicts as one."""
        if cold.degraded is not None:
            return victims
        missing = [k for k in victims if cold.header(k) is None]
        if missing:
            payloads = [p for p in self.warm.read_payloads(missing) if p is not None]
            cold.write_payloads(payloads)
        return [k for k in victims if cold.header(k) is not None]

    # --------------------------------------------------------------- metrics

    def snapshot(self) -> dict[str, Any]:
        """Counters of every tier and of the warm-up policy, as plain data."""
        warmup = asdict(self.promoter.stats)
        warmup["policy"] = self.settings.warmup_policy
        warmup["precision"] = self.promoter.stats.precision
        warmup["precision_warm"] = self.promoter.stats.precision_warm
        return {
            "tiers": {
                name: asdict(t.stats)
                | {
                    "used_bytes": t.used_bytes,
                    "chunks": len(t),
                    "degraded": t.degraded,
                    "writes_refused": t.writes_refused,
                }
                for name, t in self.tiers.items()
            },
            "warmup": warmup,
            "puts_dropped": self.writer.puts_dropped,
            "puts_not_admitted": self.puts_not_admitted,
            "reads_from_hot": self.reader.reads_from_hot,
            "admission": asdict(self.admission.stats),
        }

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Write every queued put, stop the threads, close the tiers. A part
        that fails to close is logged and the others still close: a tier left
        open keeps its threads (a store tier's prober) and files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        parts: list[tuple[str, Callable[[], None]]] = [
            ("the promoter", self.promoter.close),
            ("the writer", self.writer.close),
            ("the reader", self.reader.close),
            ("the shared cold tier", self.shared.close),
        ]
        parts += [(f"tier {name}", t.close) for name, t in self.tiers.items()]
        for what, close in parts:
            try:
                close()
            except Exception:
                logger.exception("lmcache_tiered: closing %s failed", what)
