"""``lmcache-tiered bench``: replay a workload through real LMCache and real I/O.

Only the GPU is modelled. The serving model is one vLLM instance with
LMCache's synchronous loading, its default:

- a frontend thread releases each request at its arrival time, sends the
  arrival hint the way the deployed wiring does (prompt token ids POSTed to
  the backend's loopback endpoint by a forwarder thread), then queues it;
- the engine loop has ``--concurrency`` slots (vLLM's ``max_num_seqs``). With
  slots free it takes requests from the queue, runs LMCache's lookup for each
  (pinning the hits, as the scheduler does), then retrieves the hits (as the
  worker does at the start of the step, blocking it);
- each step computes up to ``--token-budget`` prompt tokens (chunked prefill)
  and one token for every decoding request, for the profile's modelled time,
  slept, so background I/O (writes, demotion, warm-up) overlaps it as on a
  GPU server; a request's new KV is stored when its prefill completes;
- follow-up turns of a session arrive a think time after the previous turn
  finished.

The loop keeps a GPU clock that modelled compute and the measured time of
real LMCache calls advance; it sleeps until the wall clock catches up, so a
late wake-up (another thread holding the GIL) delays no later step.

Every variant (each ``--policies`` entry, then LMCache's stock
``LocalDiskBackend`` as the no-plugin baseline) gets a fresh engine and fresh
directories under ``--warm``/``--cold``. All run in this one process, so
LMCache's token hashing (PYTHONHASHSEED) is the same for all of them. KV
bytes and the clock are scaled down together (``--kv-scale``, see
:mod:`lmcache_tiered.bench.profiles`); reported times are production seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lmcache.v1.config import LMCacheEngineConfig

from lmcache_tiered import testing
from lmcache_tiered._lmcache import LMCacheEngine
from lmcache_tiered.backend import TieredBackend
from lmcache_tiered.bench import presets, report, trace
from lmcache_tiered.bench.baseline import NO_EXTERNAL_CACHE, GpuPrefixCache
from lmcache_tiered.bench.profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    BenchShape,
    ModelProfile,
    bench_shape,
    get_profile,
)
from lmcache_tiered.bench.report import RequestRecord, RunResult
from lmcache_tiered.tier import Tier
from lmcache_tiered.vllm_plugin import HintForwarder
from lmcache_tiered.warmup import installed_policies

#: Name of the no-plugin baseline: LMCache's own LocalDiskBackend.
LOCAL_DISK = "lmcache_local_disk"
#: A variant named again runs again as NAME#2, NAME#3, ...: ``none,none`` is
#: an A/A pair whose paired change is the bench's own run-to-run noise.
TWIN_MARK = "#"
#: LMCache's chunk size (tokens per key) in every variant.
CHUNK_TOKENS = 256
#: Where LMCache's lookup reports each backend's hits (StorageManager names).
_TIER_OF_LOCATION = {"LocalCPUBackend": "hot", "LocalDiskBackend": "warm"}
GIB = 1 << 30
#: Production seconds the replay may fall behind its GPU clock unremarked.
LAG_NOTE_S = 1.0
#: The deployment the plugin is built for: local NVMe (warm) in front of a
#: remote cold tier (NVMe-oF, a shared file system), here 2 GB/s + 1 ms.
DEFAULT_COLD_LINK = "2,1"
#: Where the picture goes unless --plot says otherwise.
DEFAULT_PLOT = "lmcache-tiered-bench.png"


class VariantUnavailable(RuntimeError):
    """A variant's backend did not load (e.g. a policy that is not installed)."""


@dataclass(frozen=True, slots=True)
class LinkModel:
    """A remote cold tier emulated on a local disk: bandwidth and latency in
    production units, added after each real read and write of the cold tier."""

    gbps: float
    latency_s: float

    @staticmethod
    def parse(text: str) -> LinkModel:
        """``GBPS`` or ``GBPS,LATENCY_MS`` (e.g. ``2.5,0.5``)."""
        gbps_text, _, latency_text = text.partition(",")
        try:
            gbps, latency_ms = float(gbps_text), float(latency_text or 0)
        except ValueError:
            gbps = latency_ms = math.nan
        if not (0 < gbps < math.inf and 0 <= latency_ms < math.inf):
            raise ValueError(
                f"cold link {text!r}: expected GBPS[,LATENCY_MS], GBPS > 0"
            )
        return LinkModel(gbps, latency_ms / 1000.0)

    def delay_s(self, nbytes: int, clock: float) -> float:
        """Wall seconds to add to a read of ``nbytes`` (bench) bytes.

        Production moves ``nbytes * clock`` bytes in ``latency + bytes / bw``;
        the bench clock runs ``clock`` times faster.
        """
        return self.latency_s / clock + nbytes / (self.gbps * 1e9)

    def __str__(self) -> str:
        return f"{self.gbps:g} GB/s + {self.latency_s * 1000:g} ms per read"


@dataclass(frozen=True, slots=True)
class Setup:
    """Everything that is the same for all variants of one run."""

    profile: ModelProfile
    shape: BenchShape
    concurrency: int
    #: prompt tokens per step (vLLM's max_num_batched_tokens)
    token_budget: int
    #: LMCache's CPU tier; 0: none (LMCache then only stages reads and writes)
    hot_gb: float
    #: CPU memory that stages reads and writes when there is no hot tier
    staging_gb: float
    warm_gb: float
    cold_gb: float
    warm_paths: tuple[str, ...]
    cold_paths: tuple[str, ...]
    #: where the stock LocalDiskBackend baseline stores (default: warm's)
    baseline_paths: tuple[str, ...]
    io_engine: str
    cold_link: LinkModel | None
    #: the warm tier's device modelled as a link too (None: this disk as is)
    warm_link: LinkModel | None = None
    #: vLLM's GPU prefix cache in front of every variant (tokens; 0: none)
    gpu_kv_tokens: int = 0

    @property
    def clock(self) -> float:
        """Production seconds per wall second (= the KV scale-down factor)."""
        return self.shape.kv_scale

    @property
    def baseline_disk_gb(self) -> float:
        """Capacity of the stock LocalDiskBackend baseline: as much as warm
        and cold together (it never loses a chunk the plugin keeps), but with
        a remote cold tier only the warm tier's: the stock backend has the
        local NVMe only (the remote tier is what the plugin adds), and
        without a cold tier (``--cold none``) the warm tier's."""
        local_cold = bool(self.cold_paths) and self.cold_link is None
        return self.warm_gb + (self.cold_gb if local_cold else 0.0)

    @property
    def chunk_bytes(self) -> int:
        return self.shape.chunk_bytes(CHUNK_TOKENS)


@dataclass(slots=True)
class Workload:
    """The requests, their token ids and the shared "GPU" KV buffer."""

    requests: list[trace.Request]
    tokens: list[torch.Tensor]
    #: [1, 2, max_tokens, 1, head_size]: source of stores, target of retrieves
    kv: torch.Tensor

    @staticmethod
    def build(requests: list[trace.Request], shape: BenchShape, seed: int) -> Workload:
        """Made once, before any variant runs, so none of them pays for it.
        The KV content is random bits: only its bytes matter."""
        blocks = trace.TokenBlocks(seed)
        longest = max(r.input_length for r in requests)
        generator = torch.Generator().manual_seed(seed)
        kv = torch.randint(
            -(1 << 15),
            1 << 15,
            (1, 2, longest, 1, shape.head_size),
            generator=generator,
            dtype=torch.int16,
        ).view(torch.bfloat16)
        return Workload(requests, [blocks.tokens(r) for r in requests], kv)


# ------------------------------------------------------------ backend hooks


def hint_forwarder(backend: TieredBackend | None) -> HintForwarder | None:
    """The production hint path into ``backend``, or None where it has none.

    As deployed (:mod:`lmcache_tiered.vllm_plugin`): a forwarder thread POSTs
    each arrival's prompt to the backend's loopback endpoint.
    """
    if backend is None or backend.hint_server is None:
        return None
    return HintForwarder(backend.hint_server.url)


def send_arrival_hint(hints: HintForwarder | None, tokens: torch.Tensor) -> None:
    """Tell the backend a request arrived, as vLLM's API server would."""
    if hints is not None:
        hints.submit(tokens.tolist())


def warmup_quality(metrics: dict[str, Any]) -> tuple[float | None, float | None]:
    """(precision, timeliness) of the warm-up, None where there was none.

    Precision = promoted-to-hot bytes used / promoted; timeliness = timely /
    (timely + late) demand reads of promoted chunks (see
    :class:`lmcache_tiered.metrics.WarmupStats`).
    """
    warmup = metrics.get("warmup") or {}
    demanded = warmup.get("timely", 0) + warmup.get("late", 0)
    timeliness = warmup["timely"] / demanded if demanded else None
    return warmup.get("precision"), timeliness


class GpuCopies:
    """Times the CPU connector's copies (the stand-in for GPU uploads and
    downloads) and what the profile's PCIe link would take for them, so the
    GPU clock charges the link, not this machine's memcpy."""

    def __init__(self, engine: LMCacheEngine, setup: Setup) -> None:
        self.bytes_per_token = setup.shape.bytes_per_token
        self.pcie_bytes_per_s = setup.profile.pcie_bytes_per_s
        self.measured_s = 0.0
        self.modelled_s = 0.0
        connector = engine.gpu_connector
        for name in ("batched_to_gpu", "batched_from_gpu"):
            setattr(connector, name, self._timed(getattr(connector, name)))

    def _timed(self, copy: Callable[..., None]) -> Callable[..., None]:
        def timed_copy(
            memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any
        ) -> None:
            began = time.perf_counter()
            copy(memory_objs, starts, ends, **kwargs)
            self.measured_s += time.perf_counter() - began
            nbytes = (sum(ends) - sum(starts)) * self.bytes_per_token
            self.modelled_s += nbytes / self.pcie_bytes_per_s

        return timed_copy


def emulate_link(tier: Tier, link: LinkModel, clock: float) -> None:
    """Make ``tier`` remote: every read and write of it pays the link model
    after the real I/O, for the bytes it moved.

    Wraps the instance's I/O entry points (demand reads into MemoryObjs,
    payload reads for copies between tiers, payload writes, which ``write``
    goes through) until Tier has a hook for it.
    """

    def over_link(
        io: Callable[..., list[Any]], moved: Callable[[Any, list[Any]], int]
    ) -> Callable[..., list[Any]]:
        def paid(*args: Any, **kwargs: Any) -> list[Any]:
            results = io(*args, **kwargs)
            nbytes = moved(args[0], results)
            if nbytes:
                time.sleep(link.delay_s(nbytes, clock))
            return results

        return paid

    def read_bytes(_: Any, objs: list[Any]) -> int:
        return sum(o.get_size() for o in objs if o is not None)

    def payload_bytes(_: Any, payloads: list[Any]) -> int:
        return sum(len(p.view) for p in payloads if p is not None)

    def written_bytes(payloads: Sequence[Any], stored: list[bool]) -> int:
        return sum(len(p.view) for p, ok in zip(payloads, stored, strict=True) if ok)

    # instance attributes shadow the methods (B010: setattr is what mypy allows)
    setattr(tier, "read", over_link(tier.read, read_bytes))  # noqa: B010
    setattr(tier, "read_payloads", over_link(tier.read_payloads, payload_bytes))  # noqa: B010
    setattr(tier, "write_payloads", over_link(tier.write_payloads, written_bytes))  # noqa: B010


# ----------------------------------------------------------------- variants


@dataclass(slots=True)
class _Dirs:
    """A variant's fresh directories, removed when it is done."""

    warm: list[str]
    cold: list[str]
    baseline: list[str]

    @staticmethod
    def create(setup: Setup, name: str) -> _Dirs:
        def fresh(bases: Sequence[str], kind: str) -> list[str]:
            return [
                tempfile.mkdtemp(prefix=f"lmcache-bench-{name}-{kind}{i}-", dir=base)
                for i, base in enumerate(bases)
            ]

        return _Dirs(
            fresh(setup.warm_paths, "warm"),
            fresh(setup.cold_paths, "cold"),
            fresh(setup.baseline_paths, "baseline")
            if name == LOCAL_DISK and setup.baseline_paths != setup.warm_paths
            else [],
        )

    def remove(self) -> None:
        for path in self.warm + self.cold + self.baseline:
            shutil.rmtree(path, ignore_errors=True)


def policy_of(variant: str) -> str:
    """The policy (or the stock baseline) a variant runs: its name, less any
    twin number."""
    return variant.partition(TWIN_MARK)[0]


def number_twins(variants: Sequence[str]) -> list[str]:
    """Each variant once: a name given again becomes NAME#2, NAME#3, ..."""
    numbered: list[str] = []
    for name in variants:
        label, count = name, 1
        while label in numbered:
            count += 1
            label = f"{name}{TWIN_MARK}{count}"
        numbered.append(label)
    return numbered


def engine_config(name: str, setup: Setup, dirs: _Dirs) -> LMCacheEngineConfig:
    """LMCache config of variant ``name``: the plugin with its policy, or stock."""
    policy = policy_of(name)
    memory: dict[str, Any] = {
        "chunk_size": CHUNK_TOKENS,
        "local_cpu": setup.hot_gb > 0,
        "max_local_cpu_size_gb": setup.hot_gb or setup.staging_gb,
    }
    if policy == LOCAL_DISK:
        return testing.build_config(
            **memory,
            local_disk=",".join(dirs.baseline or dirs.warm),
            max_local_disk_size_gb=setup.baseline_disk_gb,
            # O_DIRECT, as the plugin: the page cache must not serve reads
            extra_config={"use_odirect": True},
        )
    extra: dict[str, Any] = {
        "storage_plugin.tiered.module_path": "lmcache_tiered.backend",
        "storage_plugin.tiered.class_name": "TieredBackend",
        "tiered.warm.paths": dirs.warm,
        "tiered.warm.capacity_gb": setup.warm_gb,
        "tiered.io_engine": setup.io_engine,
        "tiered.warmup.policy": policy,
        # arrival hints reach the backend over loopback HTTP, as deployed
        "tiered.warmup.hint_port": 0,
    }
    if dirs.cold:
        extra["tiered.cold.paths"] = dirs.cold
        extra["tiered.cold.capacity_gb"] = setup.cold_gb
    return testing.build_config(
        **memory, extra_config=extra, storage_plugins=["tiered"]
    )


class _ErrorCapture(logging.Filter):
    """Holds back the plugin's ERROR records while an engine is built.

    LMCache only logs a plugin that fails to load; the captured message
    becomes the reason a variant is unavailable instead of log noise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.records.append(record)
            return False
        return True


def build_variant(
    name: str, setup: Setup, dirs: _Dirs
) -> tuple[LMCacheEngine, TieredBackend | None]:
    """A fresh engine for the variant; VariantUnavailable if the plugin failed."""
    plugin_logger = logging.getLogger("lmcache_tiered")
    capture = _ErrorCapture()
    plugin_logger.addFilter(capture)
    try:
        engine, _ = testing.build_engine(
            engine_config(name, setup, dirs),
            num_layers=1,
            num_kv_heads=1,
            head_size=setup.shape.head_size,
            log_level=logging.ERROR,
            require_plugins=False,  # checked below, with the reason
        )
    finally:
        plugin_logger.removeFilter(capture)
    if policy_of(name) == LOCAL_DISK:
        return engine, None
    backend = testing.get_backends(engine).get("tiered")
    if not isinstance(backend, TieredBackend):
        testing.destroy_engine(engine)
        reason = "; ".join(r.getMessage() for r in capture.records) or "see the log"
        raise VariantUnavailable(f"the tiered backend did not load: {reason}")
    for record in capture.records:
        plugin_logger.handle(record)
    if (cache := backend.cache) is not None:
        # policies' time settings are production seconds: run their clock as
        # fast as the replay's
        cache.time_scale = setup.clock
        for tier, link in (
            (cache.tiers.get("cold"), setup.cold_link),
            (cache.tiers.get("warm"), setup.warm_link),
        ):
            if link is not None and tier is not None:
                emulate_link(tier, link, setup.clock)
    return engine, backend


def run_variant(name: str, setup: Setup, workload: Workload, label: str) -> RunResult:
    """Replay the workload on a fresh engine and fresh directories
    (``no_external_cache``: no engine, vLLM's GPU prefix cache only)."""
    dirs = _Dirs.create(setup, name)
    try:
        engine, backend = (
            (None, None)
            if policy_of(name) == NO_EXTERNAL_CACHE
            else build_variant(name, setup, dirs)
        )
        progress = report.Progress(label, len(workload.requests))
        try:
            started = time.monotonic()
            replay = Replay(setup, workload, engine, backend, name, progress)
            records = replay.run()
            wall = time.monotonic() - started
            result = _result(name, setup, records, backend, wall, replay.lag_max)
            result.backend_metrics["gpu_prefix_cache"] = replay.gpu_cache.metrics()
        except BaseException:
            progress.close("failed")
            raise
        finally:
            if engine is not None:
                testing.destroy_engine(engine)
        progress.close(f"done in {wall:.0f}s")
        return result
    finally:
        dirs.remove()
        gc.collect()


def _result(
    name: str,
    setup: Setup,
    records: list[RequestRecord],
    backend: TieredBackend | None,
    wall: float,
    lag: float,
) -> RunResult:
    metrics = {} if backend is None else backend.metrics_snapshot()
    tiers = metrics.get("tiers", {})
    precision, timeliness = warmup_quality(metrics)
    return RunResult(
        name=name,
        records=records,
        chunk_bytes=setup.chunk_bytes,
        tier_bytes_read=None
        if backend is None
        else {tier: stats["bytes_read"] for tier, stats in tiers.items()},
        backend_metrics=metrics,
        warmup_precision=precision,
        warmup_timeliness=timeliness,
        wall_s=wall,
        lag_max=lag,
    )


# ------------------------------------------------------------ serving model


@dataclass(slots=True)
class _Live:
    """A request in the server (times: GPU clock, wall seconds since start)."""

    index: int
    arrival: float
    scheduled: float = 0.0
    loaded: float = 0.0
    #: tier of each chunk the lookup found, in prefix order
    hits: list[str] = field(default_factory=list)
    #: prompt tokens vLLM's GPU prefix cache held
    gpu_cached: int = 0
    #: prompt tokens LMCache loaded (past the GPU's share, chunk-aligned)
    loaded_tokens: int = 0
    cached: int = 0
    #: prompt tokens computed so far (cached ones included)
    computed: int = 0
    output_left: int = 0
    first_token: float = 0.0


class Replay:
    """The serving model of one variant (see the module docstring).

    The engine loop keeps a GPU clock (``self.gpu``, wall seconds since the
    start): modelled compute and the measured time of real LMCache calls
    (their GPU copies charged at the profile's PCIe rate, see
    :class:`GpuCopies`) advance it, and the loop sleeps until the wall clock
    reaches it. A late wake-up (another thread holding the GIL) thus delays
    no later step: the loop catches up, as a GPU that never waited would.
    """

    def __init__(
        self,
        setup: Setup,
        workload: Workload,
        engine: LMCacheEngine | None,
        backend: TieredBackend | None,
        name: str,
        progress: report.Progress,
    ) -> None:
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
            (r.arrival_s / setup.clock, i)
            for i, r in enumerate(self.requests)
            if r.after is None
        ]
        heapq.heapify(self.pending)
        self.waiting: deque[_Live] = deque()
        self.prefilling: list[_Live] = []
        self.decoding: list[_Live] = []
        self.finished = 0
        self.failure: BaseException | None = None
        self.hints = hint_forwarder(backend)
        self.copies = None if engine is None else GpuCopies(engine, setup)
        self.gpu_cache = GpuPrefixCache(setup.gpu_kv_tokens)
        self.start = 0.0
        self.gpu = 0.0
        self.lag_max = 0.0

    def now(self) -> float:
        return time.monotonic() - self.start

    def done(self) -> bool:
        return self.finished >= len(self.requests)

    def run(self) -> list[RequestRecord]:
        self.start = time.monotonic()
        frontend = threading.Thread(
            target=self._frontend, name="bench-frontend", daemon=True
        )
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
            frontend.join()
            if self.hints is not None:
                self.hints.close()
        if self.failure is not None:
            raise RuntimeError("the bench frontend failed") from self.failure
        return [r for r in self.records if r is not None]

    @contextlib.contextmanager
    def _real_work(self) -> Iterator[None]:
        """Real LMCache calls block the GPU for as long as they take, their
        GPU copies for as long as the modelled link takes."""
        began = self.now()
        copies = self.copies
        measured = 0.0 if copies is None else copies.measured_s
        modelled = 0.0 if copies is None else copies.modelled_s
        try:
            yield
        finally:
            elapsed = self.now() - began
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
                send_arrival_hint(self.hints, self.workload.tokens[index])
                with self.cond:
                    self.waiting.append(_Live(index, arrival=release))
                    self.cond.notify_all()
        except BaseException as exc:  # surfaced by run()
            self.failure = exc
            with self.cond:
                self.finished = len(self.requests)
                self.cond.notify_all()

    def _wait_for_arrival(self) -> None:
        """Idle until a request arrives; the GPU clock jumps to then."""
        with self.cond:
            while not self.waiting and not self.done():
                self.cond.wait()
        self.gpu = max(self.gpu, self.now())

    # ------------------------------------------------------------ scheduling

    def _admit(self) -> None:
        """Schedule waiting requests into free slots: lookups, then retrieves."""
        free = self.setup.concurrency - len(self.prefilling) - len(self.decoding)
        with self.cond:
            count = min(free, len(self.waiting))
            admitted = [self.waiting.popleft() for _ in range(count)]
        if not admitted:
            return
        # the step cannot start before its requests arrived (the GPU clock
        # may lag the wall clock a little)
        self.gpu = max(self.gpu, *(live.arrival for live in admitted))
        for live in admitted:
            live.gpu_cached = live.cached = live.computed = self.gpu_cache.hit_tokens(
                self.requests[live.index]
            )
        with self._real_work():
            for live in admitted:
                live.scheduled = self.gpu
                if self.engine is not None:
                    live.hits = self._lookup(live)
            for live in admitted:
                if self.engine is not None:
                    self._retrieve(live)
        for live in admitted:
            live.loaded = self.gpu
        self.prefilling.extend(admitted)

    def _lookup_id(self, live: _Live) -> str:
        return f"{self.name}-{live.index}"

    def _lookup(self, live: _Live) -> list[str]:
        """LMCache lookup with pins; the tier of each hit chunk, prefix order."""
        assert self.engine is not None
        lookup_id = self._lookup_id(live)
        self.engine.lookup(
            self.workload.tokens[live.index], lookup_id=lookup_id, pin=True
        )
        tiers: list[str] = []
        for location, keys in self.engine.lookup_pins.get(lookup_id, {}).items():
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

    def _retrieve(self, live: _Live) -> None:
        """Load the hit prefix past what the GPU holds (the worker's blocking
        load; vLLM's connector masks the GPU's share, chunk-aligned), then
        unpin."""
        assert self.engine is not None
        tokens = self.workload.tokens[live.index]
        hit_tokens = min(len(live.hits) * CHUNK_TOKENS, len(tokens))
        skip = live.gpu_cached // CHUNK_TOKENS * CHUNK_TOKENS
        lookup_id = self._lookup_id(live)
        if hit_tokens > live.gpu_cached:
            mask = torch.ones(hit_tokens, dtype=torch.bool)
            mask[:skip] = False
            loaded = self.engine.retrieve(
                tokens[:hit_tokens],
                mask=mask,
                kvcaches=self.workload.kv,
                req_id=lookup_id,
            )
            live.loaded_tokens = int(loaded.sum())
            if live.loaded_tokens:
                live.cached = live.computed = max(
                    live.gpu_cached, skip + live.loaded_tokens
                )
        self.engine.lookup_unpin(lookup_id)

    # ----------------------------------------------------------------- steps

    def _mixed_step(self) -> None:
        """One step: a budget of prompt tokens, one token per decoding request."""
        profile = self.setup.profile
        budget = self.setup.token_budget
        seconds = 0.0
        chunks: list[tuple[_Live, int]] = []
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
        self.gpu += seconds / self.setup.clock
        self._sleep_until(self.gpu)
        self._advance_decoders(1)
        for live, take in chunks:
            request = self.requests[live.index]
            live.computed = min(live.computed + take, request.input_length)
            if live.computed >= request.input_length:
                self._prefilled(live)

    def _prefilled(self, live: _Live) -> None:
        """Store the new KV (what vLLM's LMCache connector saves), first token."""
        self.prefilling.remove(live)
        self.gpu_cache.hold(self.requests[live.index])
        tokens = self.workload.tokens[live.index]
        skip = live.cached // CHUNK_TOKENS * CHUNK_TOKENS
        if self.engine is not None and len(tokens) - skip >= CHUNK_TOKENS:
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[:skip] = False
            with self._real_work():
                self.engine.store(tokens, mask=mask, kvcaches=self.workload.kv)
        live.first_token = self.gpu
        live.output_left = self.requests[live.index].output_length - 1
        if live.output_left > 0:
            self.decoding.append(live)
        else:
            self._finish(live)

    def _decode_steps(self) -> None:
        """Decode steps up to the next finish, or until an arrival can be
        admitted (at the end of the step in progress)."""
        dt = (
            self.setup.profile.decode_step_s(len(self.decoding), self._context())
            / self.setup.clock
        )
        steps = min(live.output_left for live in self.decoding)
        began = self.gpu
        if len(self.decoding) < self.setup.concurrency:
            with self.cond:
                self.cond.wait_for(
                    lambda: bool(self.waiting) or self.done(),
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
        (real work slower than modelled, e.g. on a busy machine)."""
        delay = deadline - self.now()
        if delay > 0:
            time.sleep(delay)
        else:
            self.lag_max = max(self.lag_max, -delay)

    def _finish(self, live: _Live) -> None:
        request = self.requests[live.index]
        self.gpu_cache.release(request)
        on_gpu = live.gpu_cached // CHUNK_TOKENS
        loaded = on_gpu + math.ceil(live.loaded_tokens / CHUNK_TOKENS)
        gpu = {"gpu": on_gpu} if on_gpu else {}
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
        )
        with self.cond:
            for index in self.followers.get(live.index, ()):
                follower = self.requests[index]
                release = max(
                    follower.arrival_s / self.setup.clock,
                    self.gpu + follower.think_s / self.setup.clock,
                )
                heapq.heappush(self.pending, (release, index))
            self.finished += 1
            self.cond.notify_all()
        self.progress.advance()


# ---------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> None:
    """Register ``bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="replay a workload through LMCache with each warm-up policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        choices=list(presets.PRESETS),
        help="a named operating point; an option given on the command line at "
        "another value than its default wins ("
        + "; ".join(f"{n}: {p.description}" for n, p in presets.PRESETS.items())
        + ")",
    )
    load = parser.add_argument_group("workload")
    load.add_argument(
        "--trace",
        metavar="FILE",
        help="Mooncake JSON-lines trace (default: the built-in generator)",
    )
    load.add_argument(
        "--workload",
        choices=list(trace.WORKLOADS),
        default="multi-turn",
        help="built-in workload when no --trace is given (default: multi-turn)",
    )
    load.add_argument(
        "--limit", type=int, metavar="N", help="replay only the first N requests"
    )
    load.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply arrival and think times; < 1 is more load (default: 1)",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="generator and token seed (default: 0)"
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--profile",
        choices=list(PROFILES),
        default=DEFAULT_PROFILE,
        help=f"model and GPUs whose compute is modelled (default: {DEFAULT_PROFILE})",
    )
    model.add_argument(
        "--kv-scale",
        type=float,
        metavar="F",
        help="divide KV bytes and the modelled clock by F (default: the profile's)",
    )
    model.add_argument(
        "--concurrency",
        type=int,
        default=8,
        metavar="N",
        help="request slots, vLLM's max_num_seqs (default: 8)",
    )
    model.add_argument(
        "--token-budget",
        type=int,
        default=8192,
        metavar="N",
        help="prompt tokens per step, vLLM's max_num_batched_tokens (default: 8192)",
    )
    tiers = parser.add_argument_group("tiers")
    tiers.add_argument(
        "--policies",
        metavar="LIST",
        help="warm-up policies to compare, comma-separated (default: every "
        "installed one, none first); a name given twice runs twice, as "
        "NAME#2: 'none,none' measures the run-to-run noise",
    )
    tiers.add_argument(
        "--no-baseline",
        action="store_true",
        help=f"skip the baselines: LMCache's stock LocalDiskBackend ({LOCAL_DISK}) "
        f"and vLLM's GPU prefix cache alone ({NO_EXTERNAL_CACHE})",
    )
    tiers.add_argument(
        "--gpu-kv-gb",
        type=float,
        metavar="GB",
        help="HBM per rank for vLLM's KV cache, its GPU prefix cache in front "
        "of every variant, in production GB; 0: none (default: the profile's "
        "budget, 0.9 x GPU memory - weights - activations)",
    )
    tiers.add_argument(
        "--hot-gb",
        type=float,
        metavar="GB",
        help="LMCache CPU tier size, 0 for none (default: a quarter of the "
        "workload's distinct KV)",
    )
    tiers.add_argument(
        "--warm-gb",
        type=float,
        metavar="GB",
        help="warm tier cap (default: half of the distinct KV)",
    )
    tiers.add_argument(
        "--cold-gb",
        type=float,
        metavar="GB",
        help="cold tier cap (default: twice the distinct KV)",
    )
    tiers.add_argument(
        "--warm",
        metavar="DIRS",
        help="warm tier directories, one per device, comma-separated (default: "
        "the temp directory, or the current one if that is in memory)",
    )
    tiers.add_argument(
        "--baseline-disk",
        metavar="DIRS",
        help="directories of the stock LocalDiskBackend baseline (default: as "
        "--warm); e.g. one drive of --warm's, to compare LMCache's disk tier on "
        "one NVMe with the plugin striping over all of them",
    )
    tiers.add_argument(
        "--cold",
        metavar="DIRS",
        help="cold tier directories, or 'none' (default: as for --warm)",
    )
    tiers.add_argument(
        "--cold-link",
        type=_link_arg,
        default=DEFAULT_COLD_LINK,
        metavar="GBPS[,MS]|none",
        help="the cold tier is remote: a link of this bandwidth and latency "
        "(production units) is paid after each real read and write of it "
        f"(default: {DEFAULT_COLD_LINK}, i.e. 2 GB/s + 1 ms); 'none': warm and "
        "cold on one local disk, the stock baseline then gets both capacities",
    )
    tiers.add_argument(
        "--warm-link",
        type=_link_arg,
        default="none",
        metavar="GBPS[,MS]|none",
        help="model the warm tier's device as a link of this bandwidth and "
        "latency too (production units; default: none, this disk as it is)",
    )
    tiers.add_argument(
        "--io-engine",
        choices=["auto", "uring", "threads"],
        default="auto",
        help="the plugin's I/O engine (default: auto)",
    )
    model.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the variants N times, interleaved, and report medians (default: 1)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the results as JSON")
    out.add_argument(
        "--plot",
        metavar="FILE|none",
        default=DEFAULT_PLOT,
        help="write TTFT CDFs, TTFT p50 and throughput bars as a PNG "
        f"(default: {DEFAULT_PLOT} in the current directory; 'none': no picture)",
    )
    parser.set_defaults(
        func=main,
        preset_defaults={
            dest: _PARSE.get(dest, _same)(parser.get_default(dest))
            for preset in presets.PRESETS.values()
            for dest in preset.settings
        },
    )


def _same(value: Any) -> Any:
    return value


def default_policies() -> list[str]:
    """Every installed warm-up policy, ``none`` (the reference) first."""
    return sorted(installed_policies(), key=lambda name: (name != "none", name))


def _link_arg(text: str) -> LinkModel | None:
    if text == "none":
        return None
    try:
        return LinkModel.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: How a preset's text settings become values, as their options' types do.
_PARSE: dict[str, Callable[[Any], Any]] = {
    "cold_link": _link_arg,
    "warm_link": _link_arg,
}


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def default_base() -> str:
    """The temp directory, unless it is in memory (tmpfs): then the current one.

    Tiers must sit on a real disk for the I/O to mean anything.
    """
    base = tempfile.gettempdir()
    return os.getcwd() if _filesystem_type(base) in ("tmpfs", "ramfs") else base


def _filesystem_type(path: str) -> str:
    best, kind = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            mount = fields[1]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(
                mount
            ) > len(best):
                best, kind = mount, fields[2]
    return kind


def load_requests(args: argparse.Namespace) -> list[trace.Request]:
    requests = (
        trace.load_mooncake(args.trace, args.limit)
        if args.trace
        else trace.generate(args.workload, args.seed)[: args.limit]
    )
    return trace.scale_times(requests, args.time_scale)


def make_setup(args: argparse.Namespace, requests: list[trace.Request]) -> Setup:
    """Resolve defaults: sizes follow the workload's distinct KV bytes.

    Hot holds a quarter of them (and at least four of the longest prompts:
    it also stages every read and write), warm half, cold all of them twice.
    """
    profile = get_profile(args.profile)
    shape = bench_shape(profile, args.kv_scale)
    per_token = shape.bytes_per_token
    unique = trace.unique_tokens(requests) * per_token
    longest = max(r.input_length for r in requests) * per_token
    staging = max(4 * longest, 64 << 20)
    base = default_base()
    warm = _split(args.warm) or [base]
    cold = [] if args.cold == "none" else _split(args.cold) or [base]
    return Setup(
        profile=profile,
        shape=shape,
        concurrency=args.concurrency,
        token_budget=args.token_budget,
        hot_gb=(max(unique / 4, staging) / GIB) if args.hot_gb is None else args.hot_gb,
        staging_gb=staging / GIB,
        warm_gb=args.warm_gb or max(unique / 2, staging) / GIB,
        cold_gb=args.cold_gb or (2 * unique + staging) / GIB,
        warm_paths=tuple(warm),
        cold_paths=tuple(cold),
        baseline_paths=tuple(_split(args.baseline_disk) or warm),
        io_engine=args.io_engine,
        cold_link=args.cold_link if cold else None,
        warm_link=args.warm_link,
        gpu_kv_tokens=gpu_kv_tokens(profile, args.gpu_kv_gb),
    )


def gpu_kv_tokens(profile: ModelProfile, gb: float | None) -> int:
    """Tokens of vLLM's GPU KV cache: ``gb`` production GB per rank, or the
    profile's budget."""
    if gb is None:
        return profile.gpu_kv_tokens
    if not 0 <= gb < math.inf:
        raise ValueError(f"--gpu-kv-gb must be >= 0, got {gb}")
    return int(gb * 1e9 // profile.kv_bytes_per_token)


def describe(setup: Setup, requests: list[trace.Request], source: str) -> str:
    shape, profile = setup.shape, setup.profile
    unique = trace.unique_tokens(requests) * shape.bytes_per_token
    link = f"; cold link model: {setup.cold_link}" if setup.cold_link else ""
    if setup.warm_link is not None:
        link += f"; warm link model: {setup.warm_link}"
    cold = (
        f"{','.join(setup.cold_paths)} ({setup.cold_gb:.1f} GiB)"
        if setup.cold_paths
        else "none"
    )
    return "\n".join(
        [
            f"workload: {source}, {len(requests)} requests, "
            f"{sum(r.input_length for r in requests):,} prompt tokens, "
            f"{unique / 1e9:.2f} GB of distinct KV on this run, prefix reuse "
            f"{trace.prefix_reuse(requests):.2f} (an infinite cache's hit ratio)",
            f"profile: {profile.name} ({profile.kv_bytes_per_token:,} KV bytes/token "
            f"per rank) scaled down {shape.kv_scale:g}x to "
            f"{shape.bytes_per_token:,} bytes/token "
            f"({setup.chunk_bytes / 2**20:.2f} MiB chunks); times are "
            f"production-equivalent (wall x {setup.clock:g})",
            f"tiers: hot {setup.hot_gb:.2f} GiB CPU, warm {','.join(setup.warm_paths)}"
            f" ({setup.warm_gb:.1f} GiB), cold {cold}, io engine "
            f"{setup.io_engine}{link}; "
            f"concurrency {setup.concurrency}; vLLM's GPU prefix cache "
            f"{setup.gpu_kv_tokens:,} tokens "
            f"({setup.gpu_kv_tokens * profile.kv_bytes_per_token / 1e9:.1f} GB "
            "per rank in production) in front of every variant",
            "baseline: LMCache LocalDiskBackend on "
            + (
                "the warm directories, "
                if setup.baseline_paths == setup.warm_paths
                else f"{','.join(setup.baseline_paths)}, "
            )
            + f"{setup.baseline_disk_gb:.1f} GiB"
            + (" (local NVMe only: the cold tier is remote)" if link else ""),
        ]
    )


def compared(setup: Setup, baseline: bool) -> str:
    """What the run compares, in words, for the summary line and the picture."""
    if setup.cold_link is not None:
        tiers = (
            "warm tier on the local disk, cold tier remote behind a modelled "
            f"link of {setup.cold_link}"
        )
        stock = "the local disk only"
    elif setup.cold_paths:
        tiers = "warm and cold tiers on one local disk (--cold-link none)"
        stock = "that disk with warm + cold capacity"
    else:
        tiers = "a warm tier only (--cold none)"
        stock = "the same disk"
    if setup.baseline_paths != setup.warm_paths:
        stock = f"on {','.join(setup.baseline_paths)} (--baseline-disk)"
    plugin = f"TieredBackend with each warm-up policy ({tiers})"
    if not baseline:
        return f"{plugin} against its policy none (no warm-up)"
    return (
        f"{plugin} vs LMCache's stock LocalDiskBackend ({stock}, "
        f"{setup.baseline_disk_gb:.1f} GiB)"
    )


def check_plot_path(path: str) -> None:
    """Fail before the run, not after it, where the picture cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(
            f"--plot {path}: cannot write there ({folder} is not a writable "
            "directory); give another FILE, or --plot none for no picture"
        )


def check_space(setup: Setup, requests: list[trace.Request]) -> None:
    """Refuse to start a run whose tiers would fill a disk.

    Each tier may hold every distinct chunk once (a variant's files are
    removed before the next one starts), spread over its directories.
    """
    distinct = trace.unique_tokens(requests) * setup.shape.bytes_per_token * 1.1
    for paths in (setup.warm_paths, setup.cold_paths, setup.baseline_paths):
        for path in paths:
            need, free = distinct / len(paths), shutil.disk_usage(path).free
            if need > free:
                raise ValueError(
                    f"the run may store {need / 1e9:.1f} GB in {path}, which has "
                    f"{free / 1e9:.1f} GB free; raise --kv-scale or lower --limit"
                )


def main(args: argparse.Namespace) -> int:
    """Run every variant on the same workload; print, and write JSON/PNG."""
    presets.apply(args.preset, args, args.preset_defaults, _PARSE)
    policies = _split(args.policies) if args.policies else default_policies()
    plot = None if args.plot == "none" else args.plot
    try:
        if plot is not None:
            check_plot_path(plot)
        for option in ("repeat", "concurrency", "token_budget"):
            if getattr(args, option) < 1:
                raise ValueError(f"--{option.replace('_', '-')} must be at least 1")
        requests = load_requests(args)
        if not requests:
            raise ValueError("the workload has no requests")
        setup = make_setup(args, requests)
        check_space(setup, requests)
    except (OSError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    source = args.trace or (
        f"built-in {args.workload} ({trace.WORKLOADS[args.workload].description})"
    )
    print(describe(setup, requests, source), flush=True)
    baselines = [] if args.no_baseline else [NO_EXTERNAL_CACHE, LOCAL_DISK]
    variants = number_twins(
        policies + [name for name in baselines if name not in policies]
    )
    runs: dict[str, list[RunResult]] = {}
    unavailable: dict[str, str] = {}
    workload = Workload.build(requests, setup.shape, args.seed)
    total = len(variants) * args.repeat
    # interleaved, each round starting one variant later (A B C, B C A, ...):
    # drift of the disk or of other load on the machine then touches every
    # variant alike, and no variant always runs first
    rounds = (
        (r, variants[(r + i) % len(variants)])
        for r in range(args.repeat)
        for i in range(len(variants))
    )
    for number, (repeat, name) in enumerate(rounds, 1):
        if name in unavailable:
            continue
        label = f"[{number}/{total}] {name}"
        if args.repeat > 1:
            label += f" ({repeat + 1}/{args.repeat})"
        try:
            result = run_variant(name, setup, workload, label)
        except VariantUnavailable as exc:
            unavailable[name] = str(exc)
            print(f"{label}: skipped: {exc}", file=sys.stderr)
            continue
        runs.setdefault(name, []).append(result)
    summaries = {
        name: report.combine([report.summarize(r, setup.clock) for r in results])
        for name, results in runs.items()
    }
    print()
    print(report.table(summaries))
    line = report.summary_line(
        # a twin (none#2) is the noise, the GPU-only baseline no tiered variant
        {
            n: s
            for n, s in summaries.items()
            if TWIN_MARK not in n and policy_of(n) != NO_EXTERNAL_CACHE
        },
        compared(setup, LOCAL_DISK in summaries),
        LOCAL_DISK,
    )
    if line is not None:
        print(line)
    if args.repeat > 1:
        print(f"(medians of {args.repeat} interleaved runs per variant)")
        changes = report.paired_changes(summaries)
        if changes:
            print()
            print(report.spread_table(changes))
            for name, change in changes.items():
                summaries[name]["paired_change_vs_none"] = change
            twins = [name for name in changes if policy_of(name) == "none"]
            if twins:
                print(
                    f"({', '.join(twins)}: none again, so its change is this "
                    "machine's run-to-run noise; a change within it is not resolved)"
                )
    else:
        print(
            "(one run per variant: single runs of one variant can differ by tens "
            "of percent; --repeat 6 with none named twice shows by how much)"
        )
    targets = presets.targets_line(
        summaries,
        report.paired_changes(summaries),
        setup.concurrency,
        [n for n in policies if n not in (NO_EXTERNAL_CACHE, LOCAL_DISK)],
    )
    if targets is not None:
        print(targets)
    for name, summary in summaries.items():
        if summary["lag_max_s"] > LAG_NOTE_S:
            print(
                f"{name}: the replay fell up to {summary['lag_max_s']:.1f}s behind "
                "the modelled GPU (real work slower than modelled: a busy or slow "
                "machine), so background I/O had extra time; rerun on an idle one"
            )
    for name, reason in unavailable.items():
        print(f"{name}: not run ({reason})")
    if args.json:
        report.write_json(
            args.json,
            {
                "config": _config_json(setup, requests, source, args),
                "policies": summaries,
                "unavailable": unavailable,
            },
        )
    if plot is not None and runs:
        report.plot(
            plot,
            runs,
            summaries,
            setup.clock,
            compared(setup, LOCAL_DISK in summaries),
            LOCAL_DISK,
        )
        print(f"picture: {os.path.abspath(plot)}")
    return 1 if unavailable else 0


def _config_json(
    setup: Setup, requests: list[trace.Request], source: str, args: argparse.Namespace
) -> dict[str, Any]:
    return {
        "workload": source,
        "requests": len(requests),
        "time_scale": args.time_scale,
        "seed": args.seed,
        "repeat": args.repeat,
        "preset": args.preset,
        "profile": setup.profile.name,
        "profile_source": setup.profile.source,
        "kv_bytes_per_token_production": setup.profile.kv_bytes_per_token,
        "kv_bytes_per_token_bench": setup.shape.bytes_per_token,
        "kv_scale": setup.shape.kv_scale,
        "clock_factor": setup.clock,
        "chunk_bytes": setup.chunk_bytes,
        "concurrency": setup.concurrency,
        "token_budget": setup.token_budget,
        "hot_gb": setup.hot_gb,
        "staging_gb": setup.staging_gb,
        "warm_gb": setup.warm_gb,
        "cold_gb": setup.cold_gb,
        "warm_paths": list(setup.warm_paths),
        "cold_paths": list(setup.cold_paths),
        "baseline_paths": list(setup.baseline_paths),
        "io_engine": setup.io_engine,
        "gpu_kv_tokens": setup.gpu_kv_tokens,
        "gpu_kv_bytes_per_rank_production": setup.gpu_kv_tokens
        * setup.profile.kv_bytes_per_token,
        "cold_link": None
        if setup.cold_link is None
        else {"gbps": setup.cold_link.gbps, "latency_s": setup.cold_link.latency_s},
        "warm_link": None
        if setup.warm_link is None
        else {"gbps": setup.warm_link.gbps, "latency_s": setup.warm_link.latency_s},
    }
