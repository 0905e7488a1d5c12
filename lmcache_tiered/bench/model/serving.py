"""The serving model of one variant: a modelled vLLM instance driving a real
LMCache engine (the frontend thread, the engine loop with its slots, chunked
prefill and decode steps on a GPU clock), as the bench's help describes it
(the help text of :mod:`lmcache_tiered.cli.bench`).

May touch: the engine through LMCache's calls (lookup with pins, retrieve,
store, unpin, removal from its CPU tier), its GPU connector's copies (timed),
the backend's hint endpoint and ``cache.where``; no tier's files, no
configuration.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import torch

from lmcache_tiered import testing
from lmcache_tiered.bench.common.progress import ProgressSink
from lmcache_tiered.bench.common.report import RequestRecord
from lmcache_tiered.bench.model.baseline import GpuPrefixCache
from lmcache_tiered.bench.model.gpu_copies import CopyTime, GpuCopies
from lmcache_tiered.bench.model.live import Live
from lmcache_tiered.bench.model.prefetch_road import PrefetchRoad, WarmPrefetch
from lmcache_tiered.bench.model.scenario import (
    CHUNK_TOKENS,
    Setup,
    Workload,
    whole_chunks,
)
from lmcache_tiered.integration.backend import TieredBackend
from lmcache_tiered.integration.vllm_plugin import HintForwarder
from lmcache_tiered.testing.lmcache import LMCacheEngine

#: Where LMCache's lookup reports each backend's hits (StorageManager names).
_TIER_OF_LOCATION = {testing.CPU_TIER: "hot", testing.DISK_TIER: "warm"}


class Replay:
    """The serving model of one variant (see the module docstring).

    The engine loop keeps a GPU clock (``self.gpu``, production seconds since
    the start, which are wall seconds: the replay is not sped up, see
    :mod:`lmcache_tiered.bench.model.devices`): modelled compute and the measured
    time of real LMCache calls (their GPU copies charged at the profile's
    PCIe rate, see :class:`GpuCopies`) advance it, and the loop sleeps until
    the wall clock reaches it. A late wake-up (another thread holding the
    GIL) thus delays no later step: the loop catches up, as a GPU that never
    waited would, and the lag is noted (:attr:`lag_max`).

    A variant without an engine (vLLM alone, the all-hot bound) has no real
    work to wait for: it runs on virtual time (:attr:`virtual`), the GPU
    clock alone, with no threads and no sleeping, in a fraction of a second.
    """

    def __init__(
        self,
        setup: Setup,
        workload: Workload,
        engine: LMCacheEngine | None,
        backend: TieredBackend | None,
        name: str,
        progress: ProgressSink,
        gpu_kv_tokens: int | None = None,
        hints: HintForwarder | None = None,
        warm_prefetches: bool = False,
    ) -> None:
        """``gpu_kv_tokens``: vLLM's GPU prefix cache (default: the setup's);
        ``hints``: the production hint path into the backend, where it has one
        (:mod:`lmcache_tiered.integration.vllm_plugin`'s forwarder);
        ``warm_prefetches``: on the prefetch road, the same forwarder sends
        each arrival to the server's warm prefetch instead."""
        self.setup = setup
        self.workload = workload
        self.engine = engine
        self.backend = backend
        self.name = name
        self.progress = progress
        self.requests = workload.requests
        self.records: list[RequestRecord | None] = [None] * len(self.requests)
        self.followers: dict[int, list[int]] = {}
        for index, request in enumerate(self.requests):
            if request.after is not None:
                self.followers.setdefault(request.after, []).append(index)
        self.cond = threading.Condition()
        #: (release time, index) of requests not yet arrived
        self.pending: list[tuple[float, int]] = [
            (r.arrival_s, i) for i, r in enumerate(self.requests) if r.after is None
        ]
        heapq.heapify(self.pending)
        self.waiting: deque[Live] = deque()
        self.prefilling: list[Live] = []
        self.decoding: list[Live] = []
        self.finished = 0
        self.failure: BaseException | None = None
        self.copies = None if engine is None else GpuCopies(engine, setup)
        #: loads run off the engine loop, as LMCache's multi-process server
        #: prefetches them (:mod:`lmcache_tiered.bench.model.prefetch_road`)
        self.road = (
            None if engine is None or not setup.prefetch_road else PrefetchRoad(self)
        )
        if warm_prefetches and self.road is not None:
            assert engine is not None
            hints = HintForwarder([WarmPrefetch(engine, self.road.pool, self.fail)])
        self.hints = hints
        self.gpu_cache = GpuPrefixCache(
            setup.gpu_kv_tokens if gpu_kv_tokens is None else gpu_kv_tokens
        )
        #: no real work: the GPU clock is the only clock
        self.virtual = engine is None
        self.start = 0.0
        self.gpu = 0.0
        #: most seconds the wall clock ran ahead of the GPU clock at a step
        self.lag_max = 0.0

    def now(self) -> float:
        if self.virtual:
            return self.gpu
        return time.monotonic() - self.start

    def done(self) -> bool:
        return self.finished >= len(self.requests)

    def run(self) -> list[RequestRecord]:
        self.start = time.monotonic()
        frontend = threading.Thread(
            target=self._frontend, name="bench-frontend", daemon=True
        )
        if not self.virtual:
            frontend.start()
        try:
            while not self.done():
                self._admit()
                if self.prefilling:
                    self._mixed_step()
                elif self.decoding:
                    self._decode_steps()
                else:
                    self._wait_for_arrival()
        finally:
            with self.cond:
                self.finished = len(self.requests)
                self.cond.notify_all()
            if frontend.is_alive():
                frontend.join()
            if self.hints is not None:
                self.hints.close()
            if self.road is not None:
                self.road.shutdown()
        if self.failure is not None:
            raise RuntimeError("the bench frontend failed") from self.failure
        return [r for r in self.records if r is not None]

    @contextlib.contextmanager
    def real_work(self) -> Iterator[None]:
        """Real LMCache calls block the GPU for as long as they take, their
        GPU copies for as long as the modelled link takes; with prefetching
        the copies are the multi-process server's, off the loop: not at all."""
        began = self.now()
        copies = self.copies
        measured = 0.0 if copies is None else copies.measured_s
        modelled = 0.0 if copies is None else copies.modelled_s
        off_loop = CopyTime()
        try:
            if copies is not None and self.road is not None:
                with copies.off_loop() as off_loop:
                    yield
            else:
                yield
        finally:
            elapsed = self.now() - began - off_loop.measured_s
            if copies is not None:
                elapsed += copies.modelled_s - modelled - (copies.measured_s - measured)
            self.gpu += elapsed

    # -------------------------------------------------------------- frontend

    def _frontend(self) -> None:
        """Release requests at their arrival times: hint, then queue."""
        try:
            while True:
                with self.cond:
                    while not self.pending and not self.done():
                        self.cond.wait()
                    if self.done():
                        return
                    release, index = self.pending[0]
                    delay = release - self.now()
                    if delay > 0:
                        self.cond.wait(delay)
                        continue
                    heapq.heappop(self.pending)
                if self.hints is not None:  # as vLLM's API server would
                    self.hints.submit(self.workload.tokens[index].tolist())
                with self.cond:
                    self.waiting.append(Live(index, arrival=release))
                    self.cond.notify_all()
        except BaseException as exc:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """A helper thread failed: the loop stops, and run() raises it."""
        self.failure = exc
        with self.cond:
            self.finished = len(self.requests)
            self.cond.notify_all()

    def _release_due(self) -> None:
        """Virtual time: queue the requests that arrived by the GPU clock."""
        while self.pending and self.pending[0][0] <= self.gpu:
            release, index = heapq.heappop(self.pending)
            self.waiting.append(Live(index, arrival=release))

    def _next_arrival(self) -> float:
        """Virtual time: when the next request arrives (inf: none is due)."""
        return self.pending[0][0] if self.pending else math.inf

    def _wait_for_arrival(self) -> None:
        """Idle until a request arrives; the GPU clock jumps to then."""
        if self.virtual:
            self.gpu = max(self.gpu, self._next_arrival())
            self._release_due()
            return
        with self.cond:
            while not self._to_admit() and not self.done():
                self.cond.wait()
        self.gpu = max(self.gpu, self.now())

    # ------------------------------------------------------------ scheduling

    def _admit(self) -> None:
        """Schedule waiting requests into free slots: lookups, then retrieves."""
        free = self.setup.concurrency - len(self.prefilling) - len(self.decoding)
        if self.virtual:
            self._release_due()
        if self.road is not None:
            self.road.admit(free)
            return
        with self.cond:
            count = min(free, len(self.waiting))
            admitted = [self.waiting.popleft() for _ in range(count)]
        if not admitted:
            return
        # the step cannot start before its requests arrived (the GPU clock
        # may lag the wall clock a little)
        self.gpu = max(self.gpu, *(live.arrival for live in admitted))
        for live in admitted:
            self.take_gpu_share(live)
        with self.real_work():
            for live in admitted:
                live.scheduled = self.gpu
                if self.engine is not None:
                    live.hits = self.lookup(live)
            for live in admitted:
                if self.engine is not None:
                    self._retrieve(live)
        for live in admitted:
            live.loaded = self.gpu
            self.gpu_cache.hold(live.index, self.requests[live.index], live.computed)
        self.prefilling.extend(admitted)

    def _to_admit(self) -> bool:
        """Whether a request waits for the engine loop (call under the lock)."""
        return bool(self.waiting) or (self.road is not None and self.road.waiting())

    def take_gpu_share(self, live: Live) -> None:
        """The prompt tokens vLLM's GPU prefix cache holds count as computed,
        and the request holds them from now on."""
        request = self.requests[live.index]
        live.gpu_cached = live.cached = live.computed = self.gpu_cache.hit_tokens(
            request
        )
        self.gpu_cache.hold(live.index, request, live.computed)

    def hit_tokens(self, live: Live) -> int:
        """Prompt tokens of the hit prefix LMCache's lookup found."""
        return min(
            len(live.hits) * CHUNK_TOKENS, self.requests[live.index].input_length
        )

    def lookup_id(self, live: Live) -> str:
        return f"{self.name}-{live.index}"

    def lookup(self, live: Live) -> list[str]:
        """LMCache lookup with pins; the tier of each hit chunk, prefix order."""
        assert self.engine is not None
        lookup_id = self.lookup_id(live)
        self.engine.lookup(
            self.workload.tokens[live.index], lookup_id=lookup_id, pin=True
        )
        tiers: list[str] = []
        for location, keys in self.engine.lookup_pins.get(lookup_id, {}).items():
            if location != testing.CPU_TIER:
                live.below_cpu.extend(keys)
            if location in _TIER_OF_LOCATION:
                tiers.extend([_TIER_OF_LOCATION[location]] * len(keys))
            else:
                tiers.extend(self._plugin_tier(key) for key in keys)
        return tiers

    def _plugin_tier(self, key: Any) -> str:
        """Where the plugin will serve ``key`` from: LMCache's CPU tier when
        it holds the chunk (past the prefix LMCache's lookup found there),
        else the plugin's highest tier holding it."""
        cache = None if self.backend is None else self.backend.cache
        return (cache and cache.where(key)) or "warm"

    def _retrieve(self, live: Live) -> None:
        """Load the hit prefix past what the GPU holds (the worker's blocking
        load; vLLM's connector masks the GPU's share, chunk-aligned), then
        unpin."""
        assert self.engine is not None
        tokens = self.workload.tokens[live.index]
        hit_tokens = self.hit_tokens(live)
        skip = whole_chunks(live.gpu_cached)
        lookup_id = self.lookup_id(live)
        if hit_tokens > live.gpu_cached:
            mask = torch.ones(hit_tokens, dtype=torch.bool)
            mask[:skip] = False
            loaded = self.engine.retrieve(
                tokens[:hit_tokens],
                mask=mask,
                kvcaches=self.workload.kv,
                req_id=lookup_id,
            )
            self.count_loaded(live, int(loaded.sum()))
        self.unpin(live)

    def count_loaded(self, live: Live, tokens: int) -> None:
        """``tokens`` loaded past vLLM's share (from its whole chunks on)
        count as computed."""
        live.loaded_tokens = tokens
        if tokens:
            live.cached = live.computed = max(
                live.gpu_cached, whole_chunks(live.gpu_cached) + tokens
            )

    def unpin(self, live: Live) -> None:
        """Drop the pins of ``live``'s lookup."""
        assert self.engine is not None
        self.engine.lookup_unpin(self.lookup_id(live))

    # ----------------------------------------------------------------- steps

    def _mixed_step(self) -> None:
        """One step: a budget of prompt tokens, one token per decoding request."""
        profile = self.setup.profile
        budget = self.setup.token_budget
        seconds = 0.0
        chunks: list[tuple[Live, int]] = []
        for live in self.prefilling:
            # the last prompt token is always computed (vLLM needs its logits)
            left = max(self.requests[live.index].input_length - live.computed, 1)
            take = min(left, budget)
            if take <= 0:
                break
            seconds += profile.prefill_s(take, live.computed)
            chunks.append((live, take))
            budget -= take
        seconds += profile.decode_step_s(len(self.decoding), self._context())
        self.gpu += seconds
        self._sleep_until(self.gpu)
        self._advance_decoders(1)
        for live, take in chunks:
            request = self.requests[live.index]
            live.computed = min(live.computed + take, request.input_length)
            self.gpu_cache.hold(live.index, request, live.computed)
            if live.computed >= request.input_length:
                self._prefilled(live)

    def _prefilled(self, live: Live) -> None:
        """Store the new KV (what vLLM's LMCache connector saves), first token."""
        self.prefilling.remove(live)
        tokens = self.workload.tokens[live.index]
        skip = whole_chunks(live.cached)
        if self.engine is not None and len(tokens) - skip >= CHUNK_TOKENS:
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[:skip] = False
            with self.real_work():
                self.engine.store(tokens, mask=mask, kvcaches=self.workload.kv)
        live.first_token = self.gpu + self.setup.profile.request_latency_s
        live.output_left = self.requests[live.index].output_length - 1
        if live.output_left > 0:
            self.decoding.append(live)
        else:
            self._finish(live)

    def _decode_steps(self) -> None:
        """Decode steps up to the next finish, or until an arrival can be
        admitted (at the end of the step in progress)."""
        dt = self.setup.profile.decode_step_s(len(self.decoding), self._context())
        steps = min(live.output_left for live in self.decoding)
        began = self.gpu
        slot_free = len(self.decoding) < self.setup.concurrency
        if not slot_free:
            pass  # no slot for an arrival: decode up to the next finish
        elif self.virtual:
            arrival = self._next_arrival()
            if arrival < began + steps * dt:
                steps = max(1, math.ceil((arrival - began) / dt))
        else:
            with self.cond:
                self.cond.wait_for(
                    lambda: self._to_admit() or self.done(),
                    timeout=began + steps * dt - self.now(),
                )
            steps = min(steps, max(1, math.ceil((self.now() - began) / dt)))
        self.gpu = began + steps * dt
        self._sleep_until(self.gpu)
        self._advance_decoders(steps)

    def _advance_decoders(self, steps: int) -> None:
        for live in list(self.decoding):
            live.output_left -= steps
            if live.output_left <= 0:
                self.decoding.remove(live)
                self._finish(live)

    def _context(self) -> int:
        """Tokens of context the decoding requests attend to (for the KV reads)."""
        return sum(
            self.requests[live.index].input_length
            + self.requests[live.index].output_length
            - live.output_left
            for live in self.decoding
        )

    def _sleep_until(self, deadline: float) -> None:
        """Sleep to the GPU clock; note how far the wall clock ran ahead of it
        (the loop woke late or its own work was slow, e.g. on a busy
        machine: background threads then had time a GPU server would not
        have given them)."""
        if self.virtual:
            return
        delay = deadline - self.now()
        if delay > 0:
            time.sleep(delay)
        else:
            self.lag_max = max(self.lag_max, -delay)

    def _finish(self, live: Live) -> None:
        request = self.requests[live.index]
        self.gpu_cache.release(live.index, request)
        on_gpu = live.gpu_cached // CHUNK_TOKENS
        loaded = on_gpu + math.ceil(live.loaded_tokens / CHUNK_TOKENS)
        gpu = {"gpu": on_gpu} if on_gpu else {}
        # the prefetch read every chunk found (see PrefetchRoad)
        read = live.hits if self.road is not None else live.hits[on_gpu:loaded]
        self.records[live.index] = RequestRecord(
            arrival=live.arrival,
            scheduled=live.scheduled,
            loaded=live.loaded,
            first_token=live.first_token,
            finished=self.gpu,
            input_length=request.input_length,
            output_length=request.output_length,
            prompt_chunks=math.ceil(request.input_length / CHUNK_TOKENS),
            found=gpu | dict(Counter(live.hits[on_gpu:])),
            served=gpu | dict(Counter(live.hits[on_gpu:loaded])),
            read=dict(Counter(read)),
        )
        with self.cond:
            for index in self.followers.get(live.index, ()):
                follower = self.requests[index]
                release = max(follower.arrival_s, self.gpu + follower.think_s)
                heapq.heappush(self.pending, (release, index))
            self.finished += 1
            self.cond.notify_all()
        self.progress.advance()
