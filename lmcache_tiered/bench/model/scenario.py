"""What one bench run replays and on what: the workload (requests, their
token ids, the shared "GPU" KV) and the setup every variant shares (model
profile, tier sizes and paths, links, the GPU prefix cache), resolved from the
command's options, checked, and described in words and as the JSON's
``config``.

May touch: the trace file it loads, ``/proc/mounts`` and the tiers' free
space (it only reads them); no engine, no tier.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_tiered.bench.common import trace
from lmcache_tiered.bench.common.args import OWN_MOONCAKE, split_list
from lmcache_tiered.bench.common.stores import store_kind
from lmcache_tiered.bench.model.baseline import NO_EXTERNAL_CACHE
from lmcache_tiered.bench.model.devices import Device, DeviceSpec
from lmcache_tiered.bench.model.options import (
    DEFAULT_WARM_DRIVES,
    LOADING_PREFETCH,
    LOADING_SYNC,
)
from lmcache_tiered.bench.model.profiles import (
    BenchShape,
    Profile,
    bench_shape,
    get_profile,
)
from lmcache_tiered.storage.filesystems import IN_MEMORY_FILESYSTEMS, filesystem_type

#: LMCache's chunk size (tokens per key) in every variant.
CHUNK_TOKENS = 256
GIB = 1 << 30


def whole_chunks(tokens: int) -> int:
    """``tokens`` rounded down to LMCache's chunks (a masked load or store
    skips only whole chunks)."""
    return tokens // CHUNK_TOKENS * CHUNK_TOKENS


@dataclass(frozen=True, slots=True)
class Setup:
    """Everything that is the same for all variants of one run."""

    profile: Profile
    shape: BenchShape
    concurrency: int
    #: prompt tokens per step (vLLM's max_num_batched_tokens)
    token_budget: int
    #: copies between LMCache's buffers and the engine's KV cache (bytes/s;
    #: the profile's PCIe unless ``--kv-link`` says otherwise)
    kv_link_bytes_per_s: float
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
    #: the cold tier's link (None: local drives like the warm ones, or a store)
    cold_link: DeviceSpec | None
    #: one warm directory's drive, also the stock backend's (None: this
    #: machine's disk as it is, true only at F = 1)
    warm_drive: DeviceSpec | None = None
    #: vLLM's GPU prefix cache in front of every variant (tokens; 0: none)
    gpu_kv_tokens: int = 0
    #: the cold tier on a real store (LMCache's ``--l2-adapter`` JSON)
    cold_adapter: Mapping[str, Any] | None = None
    #: how LMCache's hits are loaded (``--loading``, see
    #: :data:`lmcache_tiered.bench.model.options.LOADING_SYNC`)
    loading: str = LOADING_SYNC
    #: ``--restart``: each variant with an engine starts with every distinct
    #: prompt on its drives and nothing in memory
    restart: bool = False
    #: the rate admission variants (``NAME+admit``) recompute at: the
    #: profile's prefill of the workload's median prompt, from scratch
    recompute_tokens_per_s: float = 0.0

    @property
    def prefetch_road(self) -> bool:
        """Whether hits load as on LMCache's multi-process road
        (``--loading prefetch``): prefetched off the engine loop, the stock
        baseline reading as the server's ``fs`` adapter."""
        return self.loading == LOADING_PREFETCH

    def tier_devices(self) -> dict[str, Device]:
        """Fresh modelled devices for the plugin's tiers: one drive per warm
        directory striped together; the cold link, or without one a drive
        per cold directory."""
        scale = self.shape.kv_scale
        devices = {}
        if self.warm_drive is not None:
            devices["warm"] = Device(self.warm_drive, scale, len(self.warm_paths))
        if self.cold_link is not None:
            devices["cold"] = Device(self.cold_link, scale)
        elif self.cold_paths and self.warm_drive is not None:
            devices["cold"] = Device(self.warm_drive, scale, len(self.cold_paths))
        return devices

    def stock_device(self) -> Device | None:
        """A fresh modelled drive for the stock LocalDiskBackend: one of the
        warm kind (LMCache's backend uses one of the paths it is given)."""
        if self.warm_drive is None:
            return None
        return Device(self.warm_drive, self.shape.kv_scale)

    @property
    def cold_remote(self) -> bool:
        """The cold tier is behind a link: modelled, or a real store."""
        return self.cold_link is not None or self.cold_adapter is not None

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
    #: what the token ids and the KV were drawn from
    seed: int

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
        return Workload(requests, [blocks.tokens(r) for r in requests], kv, seed)


def default_base() -> str:
    """The temp directory, unless it is in memory (tmpfs): then the current one.

    Tiers must sit on a real disk for the I/O to mean anything.
    """
    base = tempfile.gettempdir()
    return os.getcwd() if filesystem_type(base) in IN_MEMORY_FILESYSTEMS else base


def load_requests(args: argparse.Namespace) -> list[trace.Request]:
    requests = (
        trace.load_mooncake(args.trace, args.limit)
        if args.trace
        else trace.generate(args.workload, args.seed)[: args.limit]
    )
    return trace.scale_times(requests, args.time_scale)


def make_setup(args: argparse.Namespace, requests: list[trace.Request]) -> Setup:
    """Resolve defaults: sizes follow the workload's distinct KV bytes.

    Hot holds a quarter of them, and at least what vLLM's HBM cache holds (a
    GPU host's DRAM per rank is at least its HBM; a CPU tier smaller would
    hold only what HBM holds), up to all of them, and at least four of the
    longest prompts (it also stages every read and write); warm holds all of
    them (local NVMe is large), cold all of them twice.
    """
    profile = get_profile(args.profile)
    if args.kv_link is not None and not 0 < args.kv_link < math.inf:
        raise ValueError(f"--kv-link must be a rate above 0 GB/s, got {args.kv_link}")
    shape = bench_shape(profile, args.kv_scale)
    per_token = shape.bytes_per_token
    unique = trace.unique_tokens(requests) * per_token
    longest = max(r.input_length for r in requests) * per_token
    staging = max(4 * longest, 64 << 20)
    hbm_tokens = gpu_kv_tokens(profile, args.gpu_kv_gb)
    hot = max(unique / 4, min(hbm_tokens * per_token, unique), staging)
    base = default_base()
    warm = split_list(args.warm) or [base] * DEFAULT_WARM_DRIVES
    cold = [] if args.cold == "none" else split_list(args.cold) or [base]
    if args.cold_adapter is not None:
        if args.cold not in (None, "none"):
            raise ValueError(
                "--cold-adapter and --cold both name a cold tier: give one of them"
            )
        cold = []
    return Setup(
        profile=profile,
        shape=shape,
        # the first of --concurrency's values; the bench replaces it for the others
        concurrency=args.concurrency[0],
        token_budget=args.token_budget,
        kv_link_bytes_per_s=profile.pcie_bytes_per_s
        if args.kv_link is None
        else args.kv_link * 1e9,
        hot_gb=hot / GIB if args.hot_gb is None else args.hot_gb,
        staging_gb=staging / GIB,
        warm_gb=args.warm_gb or (unique + staging) / GIB,
        cold_gb=args.cold_gb or (2 * unique + staging) / GIB,
        warm_paths=tuple(warm),
        cold_paths=tuple(cold),
        baseline_paths=tuple(split_list(args.baseline_disk) or warm),
        io_engine=args.io_engine,
        cold_link=args.cold_link if cold else None,
        warm_drive=args.warm_drive,
        gpu_kv_tokens=hbm_tokens,
        # the bench's own store gets its JSON once started (command.main)
        cold_adapter=None if args.cold_adapter == OWN_MOONCAKE else args.cold_adapter,
        loading=args.loading,
        restart=args.restart,
        recompute_tokens_per_s=prefill_rate(profile, requests),
    )


def prefill_rate(profile: Profile, requests: Sequence[trace.Request]) -> float:
    """Tokens a second the profile prefills the workload's median prompt at,
    from scratch (what a user measures for ``tiered.recompute_tokens_per_s``:
    docs/warmup.md); longer prompts are slower per token (attention)."""
    median = int(statistics.median(r.input_length for r in requests))
    return median / profile.prefill_s(median, 0)


def gpu_kv_tokens(profile: Profile, gb: float | None) -> int:
    """Tokens of vLLM's GPU KV cache: ``gb`` production GB per rank, or the
    profile's budget."""
    if gb is None:
        return profile.gpu_kv_tokens
    if not 0 <= gb < math.inf:
        raise ValueError(f"--gpu-kv-gb must be >= 0, got {gb}")
    return int(gb * 1e9 // profile.kv_bytes_per_token)


def drives_text(paths: Sequence[str], drive: DeviceSpec | None) -> str:
    """A tier's directories and the drives modelled under them, in words."""
    where = ", ".join(dict.fromkeys(paths))
    if drive is None:
        return f"{where} (this machine's disk as it is)"
    count = f"{len(paths)} modelled drives" if len(paths) > 1 else "a modelled drive"
    return f"{count} of {drive} in {where}"


def describe(
    setup: Setup,
    requests: list[trace.Request],
    source: str,
    concurrencies: Sequence[int] = (),
) -> str:
    """The run in words; ``concurrencies``: the levels it runs at (default:
    the setup's)."""
    shape, profile = setup.shape, setup.profile
    unique = trace.unique_tokens(requests) * shape.bytes_per_token
    if setup.cold_adapter is not None:
        cold = (
            f"on a real {store_kind(setup.cold_adapter)} store "
            f"{json.dumps(setup.cold_adapter)} (no link model)"
        )
    elif setup.cold_link is not None:
        size = f"{setup.cold_gb:.1f} GiB"
        cold = f"remote behind a modelled link of {setup.cold_link} ({size})"
    elif setup.cold_paths:
        drives = drives_text(setup.cold_paths, setup.warm_drive)
        cold = f"{drives} ({setup.cold_gb:.1f} GiB)"
    else:
        cold = "none"
    lines = [
        f"workload: {source}, {len(requests)} requests, "
        f"{sum(r.input_length for r in requests):,} prompt tokens "
        f"({trace.unique_tokens(requests):,} distinct), prefix reuse "
        f"{trace.prefix_reuse(requests):.2f} (an infinite cache's hit ratio)",
        f"profile: {profile.name} ({profile.kv_bytes_per_token:,} KV bytes/token "
        f"per rank); KV bytes scaled down {shape.kv_scale:g}x to "
        f"{shape.bytes_per_token:,} bytes/token ({setup.chunk_bytes / 2**20:.2f} MiB "
        f"chunks, {unique / 1e9:.2f} GB distinct on this machine), times on the "
        "production clock (the devices are modelled at production rates)",
        f"tiers: hot {setup.hot_gb:.2f} GiB CPU (this run's bytes), warm "
        f"{drives_text(setup.warm_paths, setup.warm_drive)} ({setup.warm_gb:.1f} GiB), "
        f"cold {cold}, io engine {setup.io_engine}; concurrency "
        f"{', '.join(map(str, concurrencies or [setup.concurrency]))}; LMCache's "
        f"loading {setup.loading}; vLLM's GPU "
        f"prefix cache {setup.gpu_kv_tokens:,} tokens "
        f"({setup.gpu_kv_tokens * profile.kv_bytes_per_token / 1e9:.1f} GB per rank) "
        "in front of every variant",
        "stock: LMCache LocalDiskBackend on one "
        + (
            "warm drive"
            if setup.baseline_paths == setup.warm_paths
            else "drive in " + ", ".join(dict.fromkeys(setup.baseline_paths))
        )
        + f", {setup.baseline_disk_gb:.1f} GiB"
        + (" (local NVMe only: the cold tier is remote)" if setup.cold_remote else ""),
    ]
    if setup.restart:
        lines.append(
            "restart: each variant with LMCache first stores every distinct prompt "
            "once, untimed, and waits until it is on its drives; then LMCache's CPU "
            "tier is emptied: the replay starts as a server restarted over full "
            "drives (serve-bench --restart); vLLM's prefix cache starts empty, "
            "but for the all-hot bound's, which starts holding every prompt"
        )
    if setup.warm_drive is None and shape.kv_scale != 1:
        lines.append(
            f"note: --warm-drive none at --kv-scale {shape.kv_scale:g}: this disk "
            f"moves {shape.kv_scale:g}x fewer bytes than production, so it counts "
            f"{shape.kv_scale:g}x faster than it is; model the drive, or use "
            "--kv-scale 1"
        )
    if setup.cold_adapter is not None and shape.kv_scale != 1:
        lines.append(
            f"note: the store moves {shape.kv_scale:g}x fewer bytes than production: "
            f"its transfers count {shape.kv_scale:g}x faster than they are"
        )
    return "\n".join(lines)


def compared(setup: Setup) -> str:
    """What the run compares, in words, for the summary line and the picture."""
    drives = len(setup.warm_paths)
    warm = f"warm on {drives} drive{'s' if drives > 1 else ''}"
    if setup.cold_adapter is not None:
        cold = f"cold on a real {store_kind(setup.cold_adapter)} store"
    elif setup.cold_link is not None:
        cold = f"cold remote behind {setup.cold_link}"
    elif setup.cold_paths:
        cold = "cold on local drives"
    else:
        cold = "no cold tier"
    return (
        f"vLLM + LMCache with TieredBackend ({warm}, {cold}) or with LMCache's "
        f"stock LocalDiskBackend (one drive), against vLLM alone ({NO_EXTERNAL_CACHE})"
    )


def check_space(setup: Setup, requests: list[trace.Request]) -> None:
    """Refuse to start a run whose tiers would fill a disk.

    Each tier may hold every distinct chunk once (a variant's files are
    removed before the next one starts), spread over its directories; a
    directory named for several drives holds all their shares.
    """
    distinct = trace.unique_tokens(requests) * setup.shape.bytes_per_token * 1.1
    for paths in (setup.warm_paths, setup.cold_paths, setup.baseline_paths):
        for path, drives in Counter(paths).items():
            need = distinct * drives / len(paths)
            free = shutil.disk_usage(path).free
            if need > free:
                raise ValueError(
                    f"the run may store {need / 1e9:.1f} GB in {path}, which has "
                    f"{free / 1e9:.1f} GB free; raise --kv-scale or lower --limit"
                )


def config_json(
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
        "chunk_bytes": setup.chunk_bytes,
        "concurrency": setup.concurrency,
        "token_budget": setup.token_budget,
        "kv_link_gbps": setup.kv_link_bytes_per_s / 1e9,
        "loading": setup.loading,
        "restart": setup.restart,
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
        "cold_adapter": None
        if setup.cold_adapter is None
        else dict(setup.cold_adapter),
        "cold_link": None
        if setup.cold_link is None
        else {"gbps": setup.cold_link.gbps, "latency_s": setup.cold_link.latency_s},
        "warm_drive": None
        if setup.warm_drive is None
        else {"gbps": setup.warm_drive.gbps, "latency_s": setup.warm_drive.latency_s},
        "warm_drives": len(setup.warm_paths),
    }
