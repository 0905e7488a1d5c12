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
import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_tiered.bench import trace
from lmcache_tiered.bench.link import LinkModel
from lmcache_tiered.bench.profiles import (
    BenchShape,
    ModelProfile,
    bench_shape,
    get_profile,
)

#: LMCache's chunk size (tokens per key) in every variant.
CHUNK_TOKENS = 256
GIB = 1 << 30


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
    #: the cold tier on a real store (LMCache's ``--l2-adapter`` JSON)
    cold_adapter: Mapping[str, Any] | None = None

    @property
    def clock(self) -> float:
        """Production seconds per wall second (= the KV scale-down factor)."""
        return self.shape.kv_scale

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


def split_list(text: str | None) -> list[str]:
    """A comma-separated option's non-empty parts."""
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
    warm = split_list(args.warm) or [base]
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
        hot_gb=(max(unique / 4, staging) / GIB) if args.hot_gb is None else args.hot_gb,
        staging_gb=staging / GIB,
        warm_gb=args.warm_gb or max(unique / 2, staging) / GIB,
        cold_gb=args.cold_gb or (2 * unique + staging) / GIB,
        warm_paths=tuple(warm),
        cold_paths=tuple(cold),
        baseline_paths=tuple(split_list(args.baseline_disk) or warm),
        io_engine=args.io_engine,
        cold_link=args.cold_link if cold else None,
        warm_link=args.warm_link,
        gpu_kv_tokens=gpu_kv_tokens(profile, args.gpu_kv_gb),
        cold_adapter=args.cold_adapter,
    )


def gpu_kv_tokens(profile: ModelProfile, gb: float | None) -> int:
    """Tokens of vLLM's GPU KV cache: ``gb`` production GB per rank, or the
    profile's budget."""
    if gb is None:
        return profile.gpu_kv_tokens
    if not 0 <= gb < math.inf:
        raise ValueError(f"--gpu-kv-gb must be >= 0, got {gb}")
    return int(gb * 1e9 // profile.kv_bytes_per_token)


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
    link = f"; cold link model: {setup.cold_link}" if setup.cold_link else ""
    if setup.warm_link is not None:
        link += f"; warm link model: {setup.warm_link}"
    cold = (
        f"{','.join(setup.cold_paths)} ({setup.cold_gb:.1f} GiB)"
        if setup.cold_paths
        else "none"
    )
    if setup.cold_adapter is not None:
        cold = f"the store {json.dumps(setup.cold_adapter)} (real, no link model)"
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
            f"concurrency {', '.join(map(str, concurrencies or [setup.concurrency]))}; "
            "vLLM's GPU prefix cache "
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
            + (
                " (local NVMe only: the cold tier is remote)"
                if setup.cold_remote
                else ""
            ),
        ]
    )


def compared(setup: Setup, baseline: bool) -> str:
    """What the run compares, in words, for the summary line and the picture."""
    if setup.cold_adapter is not None:
        tiers = (
            "warm tier on the local disk, cold tier on a real "
            f"{setup.cold_adapter['type']} store"
        )
        stock = "the local disk only"
    elif setup.cold_link is not None:
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
        "cold_adapter": None
        if setup.cold_adapter is None
        else dict(setup.cold_adapter),
        "cold_link": None
        if setup.cold_link is None
        else {"gbps": setup.cold_link.gbps, "latency_s": setup.cold_link.latency_s},
        "warm_link": None
        if setup.warm_link is None
        else {"gbps": setup.warm_link.gbps, "latency_s": setup.warm_link.latency_s},
    }
