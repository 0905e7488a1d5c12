"""The variants a bench run compares and their lifecycle: each warm-up policy
on the plugin, LMCache's stock ``LocalDiskBackend``, vLLM's GPU prefix cache
alone, and the all-hot bound; for each a fresh engine and fresh directories,
modelled devices under its tiers, one replay, its result.

May touch: the variant's own directories (created and removed), the engine
it builds and destroys (:mod:`lmcache_tiered.testing`), the I/O hooks of its
tiers and of the stock disk backend (devices,
:mod:`lmcache_tiered.bench.model.devices`); with ``--cold-adapter``, the chunks it
stored in that store (deleted at its end).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache.v1.config import LMCacheEngineConfig

from lmcache_tiered import testing
from lmcache_tiered.bench.common import rules, trace
from lmcache_tiered.bench.common.progress import (
    Progress,
    ProgressSink,
    SharedCount,
    finished_note,
)
from lmcache_tiered.bench.common.report import RequestRecord, RunResult
from lmcache_tiered.bench.model.baseline import (
    ALL_HOT,
    LOCAL_DISK,
    NO_EXTERNAL_CACHE,
    UNBOUNDED,
)
from lmcache_tiered.bench.model.devices import Device, model_disk_backend, model_tier
from lmcache_tiered.bench.model.scenario import CHUNK_TOKENS, Setup, Workload
from lmcache_tiered.bench.model.serving import Replay
from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.config import plugin_extra_config
from lmcache_tiered.integration.backend import TieredBackend
from lmcache_tiered.integration.vllm_plugin import HintForwarder, targets_from
from lmcache_tiered.storage.adapter_tier import AdapterTier
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.storage.tierfiles import SHARED_FILE_SYSTEM_WARNING
from lmcache_tiered.testing.lmcache import LMCacheEngine, read_disk_backend_keys_in_turn
from lmcache_tiered.warmup.policies import HintedPolicy

#: A variant named again runs again as NAME#2, NAME#3, ...: ``none,none`` is
#: an A/A pair whose paired change is the bench's own run-to-run noise.
TWIN_MARK = "#"
#: Seconds a variant waits for a real store to delete its chunks.
STORE_CLEANUP_S = 30.0
#: ``--restart``: seconds one prompt's KV may take to reach the drives.
FILL_PROMPT_TIMEOUT_S = 600.0


class VariantUnavailable(RuntimeError):
    """A variant's backend did not load (e.g. a policy that is not installed)."""


@dataclass(slots=True)
class VariantDirs:
    """A variant's fresh directories, removed when it is done."""

    warm: list[str]
    cold: list[str]
    baseline: list[str]

    @staticmethod
    def create(setup: Setup, name: str) -> VariantDirs:
        def fresh(bases: Sequence[str], kind: str) -> list[str]:
            return [
                tempfile.mkdtemp(prefix=f"lmcache-bench-{name}-{kind}{i}-", dir=base)
                for i, base in enumerate(bases)
            ]

        return VariantDirs(
            fresh(setup.warm_paths, "warm"),
            fresh(setup.cold_paths, "cold"),
            fresh(setup.baseline_paths, "baseline")
            if name == LOCAL_DISK and setup.baseline_paths != setup.warm_paths
            else [],
        )

    def remove(self) -> None:
        for path in self.warm + self.cold + self.baseline:
            shutil.rmtree(path, ignore_errors=True)


#: A policy named with this suffix (``none+admit``) runs with read-time
#: admission on: ``tiered.recompute_tokens_per_s`` at the run's prefill rate.
ADMIT_MARK = "+admit"


def base_of(variant: str) -> str:
    """A variant's name less any twin number (``none+admit#2``: ``none+admit``)."""
    return variant.partition(TWIN_MARK)[0]


def policy_of(variant: str) -> str:
    """The policy (or the stock baseline) a variant runs: its name, less any
    twin number and admission mark."""
    return base_of(variant).removesuffix(ADMIT_MARK)


def admits(variant: str) -> bool:
    """Whether the variant runs with read-time admission on."""
    return base_of(variant).endswith(ADMIT_MARK)


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


def engine_config(name: str, setup: Setup, dirs: VariantDirs) -> LMCacheEngineConfig:
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
    extra = plugin_extra_config(
        {
            "tiered.warm.paths": dirs.warm,
            "tiered.warm.capacity_gb": setup.warm_gb,
            "tiered.io_engine": setup.io_engine,
            "tiered.warmup.policy": policy,
        }
    )
    if setup.prefetch_road:
        # lmcache server's adapter: no hot tier below its L1, no hint endpoint
        extra["tiered.warmup.hot_fraction"] = 0
    else:
        # arrival hints reach the backend over loopback HTTP, as deployed
        extra["tiered.warmup.hint_port"] = 0
    if dirs.cold:
        extra["tiered.cold.paths"] = dirs.cold
        extra["tiered.cold.capacity_gb"] = setup.cold_gb
    if setup.cold_adapter is not None:
        extra["tiered.cold.adapter"] = dict(setup.cold_adapter)
    if admits(name):
        extra["tiered.recompute_tokens_per_s"] = setup.recompute_tokens_per_s
    return testing.build_config(
        **memory, extra_config=extra, storage_plugins=["tiered"]
    )


class _ErrorCapture(logging.Filter):
    """Holds back the plugin's ERROR records while an engine is built, and
    drops its warning that the warm directories share a file system (the
    bench's modelled drives do on purpose).

    LMCache only logs a plugin that fails to load; the captured message
    becomes the reason a variant is unavailable instead of log noise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == SHARED_FILE_SYSTEM_WARNING:
            return False
        if record.levelno >= logging.ERROR:
            self.records.append(record)
            return False
        return True


#: Variants with no LMCache engine: they replay on virtual time.
ENGINELESS = (NO_EXTERNAL_CACHE, ALL_HOT)


@dataclass(slots=True)
class Built:
    """A variant's engine, our backend in it (None for the stock one), and
    the modelled devices under its tiers by tier name."""

    engine: LMCacheEngine
    backend: TieredBackend | None
    devices: dict[str, Device]


def build_variant(name: str, setup: Setup, dirs: VariantDirs) -> Built:
    """A fresh engine for the variant, its tiers on modelled devices;
    VariantUnavailable if the plugin failed."""
    plugin_logger = logging.getLogger("lmcache_tiered")
    capture = _ErrorCapture()
    plugin_logger.addFilter(capture)
    try:
        engine, _ = testing.build_engine(
            engine_config(name, setup, dirs),
            model_name=store_model_name() if setup.cold_adapter else testing.MODEL_NAME,
            num_layers=1,
            num_kv_heads=1,
            head_size=setup.shape.head_size,
            log_level=logging.ERROR,
            require_plugins=False,  # checked below, with the reason
        )
    finally:
        plugin_logger.removeFilter(capture)
    devices: dict[str, Device] = {}
    if policy_of(name) == LOCAL_DISK:
        stock = testing.get_backends(engine)["LocalDiskBackend"]
        if setup.prefetch_road:
            # on the server's road it stands for LMCache's fs L2 adapter
            read_disk_backend_keys_in_turn(stock)
        if (drive := setup.stock_device()) is not None:
            devices["disk"] = drive
            model_disk_backend(stock, drive)
        return Built(engine, None, devices)
    backend = testing.get_backends(engine).get("tiered")
    if not isinstance(backend, TieredBackend):
        testing.destroy_engine(engine)
        reason = "; ".join(r.getMessage() for r in capture.records) or "see the log"
        raise VariantUnavailable(f"the tiered backend did not load: {reason}")
    for record in capture.records:
        plugin_logger.handle(record)
    if (cache := backend.cache) is not None:
        for tier_name, device in setup.tier_devices().items():
            tier = cache.tiers.get(tier_name)  # type: ignore[call-overload]
            # a store cold tier (--cold-adapter) is real: none modelled
            if isinstance(tier, Tier):
                devices[tier_name] = device
                model_tier(tier, device)
    return Built(engine, backend, devices)


def run_variant(
    name: str,
    setup: Setup,
    workload: Workload,
    label: str,
    progress: ProgressSink | None = None,
) -> RunResult:
    """Replay the workload on a fresh engine and fresh directories (the
    engine-less variants: vLLM's GPU prefix cache only, unbounded for the
    all-hot bound, on virtual time), its progress on a bar called ``label``
    unless ``progress`` is given."""
    policy = policy_of(name)
    dirs = VariantDirs.create(setup, name)
    try:
        built = None if policy in ENGINELESS else build_variant(name, setup, dirs)
        engine = None if built is None else built.engine
        backend = None if built is None else built.backend
        if progress is None:
            progress = Progress(label, len(workload.requests))
        try:
            fill = (
                None
                if built is None or not setup.restart
                else fill_drives(built, workload)
            )
            started = time.monotonic()
            replay = Replay(
                setup,
                workload,
                engine,
                backend,
                name,
                progress,
                gpu_kv_tokens=UNBOUNDED if policy == ALL_HOT else None,
                hints=None
                if backend is None or backend.hint_server is None
                else HintForwarder(targets_from(backend.hint_server.url)),
                # lmcache server's road: hints are its warm prefetches
                warm_prefetches=policy == HintedPolicy.name and setup.prefetch_road,
            )
            if setup.restart and policy == ALL_HOT:
                # the bound holds in HBM all that the others hold on drives
                prompts = trace.distinct_prompts(workload.requests)
                replay.gpu_cache.preload(workload.requests[i] for i in prompts)
            records = replay.run()
            wall = time.monotonic() - started
            result = _result(name, setup, records, backend, wall, replay.lag_max)
            result.backend_metrics["gpu_prefix_cache"] = replay.gpu_cache.metrics()
            if fill is not None:
                result.backend_metrics["restart_fill"] = fill
            if built is not None:
                result.device_overrun = overrun_share(built.devices.values())
                result.backend_metrics["devices"] = {
                    tier: device.metrics() for tier, device in built.devices.items()
                }
        except BaseException:
            progress.close("failed")
            raise
        finally:
            if backend is not None and backend.cache is not None:
                _delete_from_store(backend.cache)
            if engine is not None:
                testing.destroy_engine(engine)
        progress.close(finished_note(wall))
        return result
    finally:
        dirs.remove()
        gc.collect()


def fill_drives(built: Built, workload: Workload) -> dict[str, float]:
    """``--restart``'s untimed pass: each distinct prompt's KV stored once and
    on the drives before the next is stored (LMCache's CPU tier never holds
    more than a slow drive has still to take, as serve-bench's fill sends one
    request at a time), then LMCache's CPU tier emptied: the replay starts as
    on a server restarted over full drives. The prompts and seconds it took.
    """
    began = time.monotonic()
    prompts = trace.distinct_prompts(workload.requests)
    for index in prompts:
        tokens = workload.tokens[index]
        testing.store_tokens(built.engine, tokens, workload.kv)
        testing.wait_for_puts(built.engine, tokens, timeout=FILL_PROMPT_TIMEOUT_S)
    left = testing.clear_cpu_tier(built.engine)
    if left:
        raise RuntimeError(
            f"--restart: {left} chunks stayed in LMCache's CPU tier after the fill"
        )
    for device in built.devices.values():
        device.zero_counts()
    return {"prompts": len(prompts), "seconds": time.monotonic() - began}


def run_variant_apart(
    name: str, setup: Setup, requests: list[trace.Request], seed: int, done: Any
) -> RunResult:
    """:func:`run_variant` in a process of its own (``--jobs``): the workload
    is built again from ``requests`` and ``seed`` (the same tokens), and
    each finished request is counted in ``done`` (a shared integer) for the
    parent's progress bar. Its own interpreter, so its own GIL: variants
    replayed at once do not make each other's replays lag."""
    stop_with_parent()
    workload = Workload.build(requests, setup.shape, seed)
    return run_variant(name, setup, workload, name, SharedCount(done))


def stop_with_parent() -> None:
    """Stop this process, as a Ctrl-C would, once the process that started
    it is gone: a bench killed without the chance to stop its variants'
    processes (SIGTERM, SIGKILL) must not leave them replaying, writing to
    the drives and keeping their directories. A thread waits on the parent's
    sentinel (multiprocessing's) and sends this process SIGINT, which wakes
    the main thread wherever it waits; its ``finally`` blocks then remove
    what it made. SIGINT gets Python's handler back first: a bench run in the
    background (``&`` in a script) hands its processes SIGINT ignored."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def watch() -> None:
        parent.join()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="bench-parent-watch", daemon=True).start()


def overrun_share(devices: Iterable[Device]) -> float:
    """By how much real I/O overran its devices, as a share of all their
    modelled time (a device that moved little cannot dominate it)."""
    devices = list(devices)
    modelled = sum(d.modelled_s for d in devices)
    return sum(d.overrun_s for d in devices) / modelled if modelled else 0.0


def store_model_name() -> str:
    """A model name of its own for a variant whose cold tier is a real store:
    the store outlives the variant, and chunks of earlier variants (or runs)
    must not be found there, so their keys differ."""
    return f"bench-{uuid.uuid4().hex[:12]}"


def _delete_from_store(cache: TieredCache) -> None:
    """Leave a real store as the variant found it: once the queued puts (and
    the demotions they cause) are written, delete every chunk stored there."""
    cold = cache.tiers.get("cold")
    if isinstance(cold, AdapterTier):
        cache.flush(STORE_CLEANUP_S)
        cold.remove_many(cold.stored_keys(), wait_s=STORE_CLEANUP_S)


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
    precision, timeliness, held_back = rules.warmup_quality(metrics)
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
        warmup_held_back=held_back,
        wall_s=wall,
        lag_max=lag,
    )
