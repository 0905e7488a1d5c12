"""``--loading prefetch``: ``lmcache server``'s road in the serving model.

What it models (lmcache 0.5.6 with vLLM's ``LMCacheMPConnector``):

* vLLM looks a waiting request up only while a running slot is free (its
  scheduler's waiting loop stops at ``max_num_seqs``); every request it then
  reaches is looked up, and one with hits waits, without a slot, while the
  server prefetches all of them into its L1 (LMCache's CPU tier here), those
  vLLM's GPU prefix cache holds included, at most
  :data:`PREFETCHES_IN_FLIGHT` at once. The server's default prefetch policy
  keeps nothing it loaded from L2 once read.
* Then the request takes vLLM's GPU share; the chunks past it are copied
  into the KV cache over the modelled link, off the engine loop, and the
  request waits for a slot.
* Our tiers sit below L1 with no hot tier of ours (the variant runs with
  ``tiered.warmup.hot_fraction: 0``, as the adapter has none).
* Arrival hints (the ``hinted`` variant) are the server's warm prefetches
  (:class:`WarmPrefetch`, what ``LMCACHE_TIERED_PREFETCH_URL`` asks the
  server for): the prompt's chunks loaded from L2 into L1 and kept there,
  evictable, on the same prefetch slots.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lmcache_tiered import testing
from lmcache_tiered.bench.model.live import Live
from lmcache_tiered.bench.model.scenario import CHUNK_TOKENS, whole_chunks
from lmcache_tiered.integration.hint_targets import Outcome
from lmcache_tiered.testing.lmcache import LMCacheEngine

if TYPE_CHECKING:
    import contextlib

    from lmcache_tiered.bench.common.trace import Request
    from lmcache_tiered.bench.model.baseline import GpuPrefixCache
    from lmcache_tiered.bench.model.gpu_copies import GpuCopies
    from lmcache_tiered.bench.model.scenario import Workload

#: Prefetches in flight at once: LMCache's multi-process server's default
#: (``--l2-prefetch-max-in-flight``); its warm prefetches share them
PREFETCHES_IN_FLIGHT = 8


class Loop(Protocol):
    """What the road uses of the engine loop
    (:class:`lmcache_tiered.bench.model.serving.Replay`)."""

    cond: threading.Condition
    waiting: deque[Live]
    prefilling: list[Live]
    gpu: float
    requests: list[Request]
    gpu_cache: GpuPrefixCache
    copies: GpuCopies | None
    engine: LMCacheEngine | None
    workload: Workload

    def real_work(self) -> contextlib.AbstractContextManager[None]: ...
    def lookup(self, live: Live) -> list[str]: ...
    def unpin(self, live: Live) -> None: ...
    def take_gpu_share(self, live: Live) -> None: ...
    def hit_tokens(self, live: Live) -> int: ...
    def count_loaded(self, live: Live, tokens: int) -> None: ...
    def lookup_id(self, live: Live) -> str: ...
    def fail(self, exc: BaseException) -> None: ...


class PrefetchRoad:
    """The requests of one replay on their way through the server's prefetch
    (see the module docstring); the replay's engine loop calls
    :meth:`admit` with the slots free."""

    def __init__(self, replay: Loop) -> None:
        self.replay = replay
        self.pool = ThreadPoolExecutor(PREFETCHES_IN_FLIGHT, "bench-prefetch")
        #: requests whose prefetch is done, to be scheduled (vLLM's GPU share
        #: taken, the load started) in order
        self.prefetched: deque[Live] = deque()
        #: requests loaded into the KV cache, for a slot
        self.ready: deque[Live] = deque()

    def waiting(self) -> bool:
        """Whether a request waits for the loop (call under the replay's lock)."""
        return bool(self.prefetched or self.ready)

    def admit(self, free: int) -> None:
        """With a slot free: look up the arrivals (a hit is prefetched), then
        schedule, loaded requests first, then in order those whose prefetch
        is done: each takes vLLM's GPU share, and one with chunks past it
        starts their copy instead of taking a slot."""
        if free <= 0:
            return  # vLLM's scheduler looks nothing up: no slot to run it in
        replay = self.replay
        with replay.cond:
            arrived = list(replay.waiting)
            replay.waiting.clear()
        for live in arrived:
            replay.gpu = max(replay.gpu, live.arrival)
            with replay.real_work():
                live.scheduled = replay.gpu
                live.hits = replay.lookup(live)
            if live.hits:
                self.pool.submit(self._prefetch, live)
            else:
                replay.unpin(live)
                self.prefetched.append(live)
        with replay.cond:
            admitted = [self.ready.popleft() for _ in range(min(free, len(self.ready)))]
        free -= len(admitted)
        while free > 0:
            with replay.cond:
                if not self.prefetched:
                    break
                live = self.prefetched.popleft()
            replay.gpu = max(replay.gpu, live.arrival)
            replay.take_gpu_share(live)
            if replay.hit_tokens(live) > live.gpu_cached:
                self._start_copy(live)
                continue
            admitted.append(live)
            free -= 1
        for live in admitted:
            live.loaded = replay.gpu
        replay.prefilling.extend(admitted)

    def _start_copy(self, live: Live) -> None:
        """Copy the hit chunks past vLLM's share into the KV cache over the
        modelled link; then the request waits for a slot. vLLM allocates the
        blocks a load will fill when it starts it."""
        replay = self.replay
        hit_tokens = replay.hit_tokens(live)
        replay.gpu_cache.hold(live.index, replay.requests[live.index], hit_tokens)
        replay.count_loaded(live, hit_tokens - whole_chunks(live.gpu_cached))
        assert replay.copies is not None
        copy = threading.Timer(
            replay.copies.link_s(live.loaded_tokens), self._loaded, (live,)
        )
        copy.daemon = True
        copy.start()

    def _prefetch(self, live: Live) -> None:
        """Read every chunk a request's lookup found, off the engine loop,
        into the KV buffer (a stand-in for the server's memory: the copy to
        the KV cache is timed at the link's rate when vLLM schedules the
        request), then drop those read from below L1 from it. Not charged to
        the GPU clock."""
        replay = self.replay
        try:
            assert replay.engine is not None and replay.copies is not None
            hit_tokens = replay.hit_tokens(live)
            with replay.copies.off_loop():
                loaded = replay.engine.retrieve(
                    replay.workload.tokens[live.index][:hit_tokens],
                    kvcaches=replay.workload.kv,
                    req_id=replay.lookup_id(live),
                )
            # a chunk lost since the lookup ends the prefix vLLM is told of
            whole = int(loaded.to(torch.int64).cumprod(0).sum())
            del live.hits[math.ceil(whole / CHUNK_TOKENS) :]
            replay.unpin(live)
            testing.drop_from_cpu_tier(replay.engine, live.below_cpu)
        except BaseException as exc:
            replay.fail(exc)
            return
        with replay.cond:
            self.prefetched.append(live)
            replay.cond.notify_all()

    def _loaded(self, live: Live) -> None:
        """A request's chunks are in the KV cache: it waits for a slot."""
        with self.replay.cond:
            self.ready.append(live)
            self.replay.cond.notify_all()

    def shutdown(self) -> None:
        self.pool.shutdown()


class WarmPrefetch:
    """The server's warm prefetch (``POST /cache/prefetches``), as a hint
    target: what L2 holds of a prompt loaded into L1 and left there,
    evictable, on the server's prefetch slots. It goes through LMCache's
    lookup, as the server's does through the adapter's lookup-and-lock."""

    kind = "prefetch"
    url = "lmcache server (modelled)"

    def __init__(
        self,
        engine: LMCacheEngine,
        pool: ThreadPoolExecutor,
        fail: Callable[[BaseException], None],
    ) -> None:
        """``fail``: told of an exception a load raised (the replay stops)."""
        self.engine = engine
        self.pool = pool
        self.fail = fail
        self._ids = itertools.count()

    def send(
        self, token_ids: list[int], cache_salt: str, engine_config: Any
    ) -> tuple[Outcome, str]:
        if len(token_ids) < CHUNK_TOKENS:
            return "noop", ""
        self.pool.submit(self._load, token_ids, f"warm-prefetch-{next(self._ids)}")
        return "submitted", ""

    def _load(self, token_ids: list[int], lookup_id: str) -> None:
        engine = self.engine
        try:
            engine.lookup(torch.tensor(token_ids), lookup_id=lookup_id, pin=True)
            manager = testing.get_storage_manager(engine)
            for location, keys in engine.lookup_pins.get(lookup_id, {}).items():
                if location == testing.CPU_TIER or not keys:
                    continue
                # read from where the lookup found them (LMCache's batched_get
                # stops at the first tier answering a list, hits or not); it
                # copies what it reads from below into its CPU tier
                for obj in manager.batched_get(keys, location=location):
                    if obj is not None:
                        obj.ref_count_down()
            engine.lookup_unpin(lookup_id)
        except BaseException as exc:
            self.fail(exc)
