"""``lmcache-tiered diskbench``: cold-read bandwidth of each way to store KV.

In one run, on the same paths and the same chunks, interleaved round by round
(the disk's speed drifts over minutes, so A B A B and medians):

1. the device ceiling: fio (io_uring, O_DIRECT, iodepth 32), else our raw loop;
2. LMCache's stock ``LocalDiskBackend`` (``use_odirect: true``);
3. LMCache's ``RustRawBlockBackend`` on a file, when its package is installed;
4. ``TieredBackend``.

2-4 are driven through LMCache's own ``StorageManager.batched_get`` after the
CPU tier is emptied and the page cache dropped, so every byte comes from disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_tiered.bench import harness
from lmcache_tiered.bench.rawio import drop_page_cache, fio_read_gbps, raw_read_gbps

logger = logging.getLogger("lmcache_tiered")

#: tokens per LMCache chunk and KV heads x head size of the synthetic model;
#: the layer count is chosen so a chunk has the requested size
CHUNK_TOKENS, HEADS, HEAD_SIZE = 256, 8, 128
#: chunks stored and read per request (one batched_get call)
REQUEST_CHUNKS = 32
RUST_MODULE = "lmcache.v1.storage_backend.plugins.rust_raw_block_backend"


@dataclass
class Contender:
    """One LMCache configuration under test, with its engine once built."""

    name: str
    location: str
    config: dict[str, Any]
    extra: dict[str, Any]
    engine: Any = None
    requests: list[torch.Tensor] = field(default_factory=list)
    read_gbps: list[float] = field(default_factory=list)
    #: bytes the kernel read from storage / bytes served, per round: 1.0 means
    #: every byte came from disk (not from a cache somewhere)
    disk_share: list[float] = field(default_factory=list)
    write_gbps: float | None = None


def contenders(
    paths: list[str], work: str, args: argparse.Namespace
) -> list[Contender]:
    total_gb = args.total_gb * 1.5  # headroom for the last request's chunks
    stock_dir = os.path.join(work, "local_disk")
    os.makedirs(stock_dir, exist_ok=True)
    found = [
        Contender(
            "lmcache_local_disk",
            "LocalDiskBackend",
            {"local_disk": stock_dir, "max_local_disk_size_gb": total_gb},
            {"use_odirect": True},
        ),
        Contender(
            "tiered",
            "tiered",
            {"storage_plugins": ["tiered"]},
            {
                "storage_plugin.tiered.module_path": "lmcache_tiered.backend",
                "storage_plugin.tiered.class_name": "TieredBackend",
                "tiered.warm.paths": paths,
                "tiered.warm.capacity_gb": total_gb,
                "tiered.io_engine": args.io_engine,
                "tiered.queue_depth": args.queue_depth,
                "tiered.warmup.policy": "none",
            },
        ),
    ]
    try:
        __import__(RUST_MODULE)
    except ImportError:
        logger.warning("RustRawBlockBackend is not installed: its column is null")
    else:
        device = os.path.join(work, "rust_raw_block.img")
        capacity = int(total_gb * 2**30)
        with open(device, "wb") as f:
            f.truncate(capacity + (64 << 20))
        found.append(
            Contender(
                "rust_raw_block",
                "rrb",
                {"storage_plugins": ["rrb"]},
                {
                    "storage_plugin.rrb.module_path": RUST_MODULE,
                    "storage_plugin.rrb.class_name": "RustRawBlockBackend",
                    "rust_raw_block.device_path": device,
                    "rust_raw_block.capacity_bytes": capacity,
                    "rust_raw_block.meta_total_bytes": 64 << 20,
                    "rust_raw_block.use_odirect": True,
                    "rust_raw_block.io_engine": "io_uring",
                },
            )
        )
    return found


def fill(contender: Contender, chunk_bytes: int, n_requests: int) -> None:
    """Build the contender's engine and store ``n_requests`` x 32 chunks."""
    layers = chunk_bytes // (2 * CHUNK_TOKENS * HEADS * HEAD_SIZE * 2)
    config = harness.build_config(
        chunk_size=CHUNK_TOKENS,
        max_local_cpu_size_gb=max(1.0, 3 * REQUEST_CHUNKS * chunk_bytes / 2**30),
        extra_config=contender.extra,
        **contender.config,
    )
    contender.engine, connector = harness.build_engine(
        config, num_layers=layers, num_kv_heads=HEADS, head_size=HEAD_SIZE
    )
    tokens_per_request = REQUEST_CHUNKS * CHUNK_TOKENS
    kv = harness.make_kv(connector, tokens_per_request, seed=1)
    started = time.perf_counter()
    for i in range(n_requests):
        tokens = harness.make_tokens(tokens_per_request, seed=1000 + i)
        harness.store_tokens(contender.engine, tokens, kv)
        contender.requests.append(tokens)
    for tokens in contender.requests:
        harness.wait_for_puts(contender.engine, tokens, timeout=600)
    elapsed = time.perf_counter() - started
    contender.write_gbps = n_requests * REQUEST_CHUNKS * chunk_bytes / elapsed / 1e9


def read_round(contender: Contender, chunk_bytes: int) -> float:
    """Cold-read every stored chunk through StorageManager.batched_get."""
    engine = contender.engine
    harness.clear_cpu_tier(engine)
    drop_page_cache()
    disk_before = storage_bytes_read()
    started = time.perf_counter()
    for tokens in contender.requests:
        objs = harness.get_chunks(engine, tokens, contender.location)
        missing = sum(obj is None for obj in objs)
        if missing:
            raise RuntimeError(f"{contender.name}: {missing} chunks not served")
        for obj in objs:
            assert obj is not None
            obj.ref_count_down()
        harness.clear_cpu_tier(engine)
    elapsed = time.perf_counter() - started
    served = len(contender.requests) * REQUEST_CHUNKS * chunk_bytes
    contender.disk_share.append((storage_bytes_read() - disk_before) / served)
    return served / elapsed / 1e9


def storage_bytes_read() -> int:
    """Bytes this process made the kernel fetch from storage (/proc/self/io)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"])


def ceiling(paths: list[str], chunk_bytes: int, total_bytes: int) -> tuple[float, str]:
    drop_page_cache()
    fio = fio_read_gbps(paths, chunk_bytes, total_bytes)
    if fio is not None:
        return fio, "fio io_uring iodepth=32"
    drop_page_cache()
    return raw_read_gbps(paths, chunk_bytes, total_bytes), "lmcache-tiered raw loop"


def run(args: argparse.Namespace) -> dict[str, Any]:
    chunk_bytes = args.chunk_mb << 20
    n_requests = max(1, round(args.total_gb * 2**30 / (REQUEST_CHUNKS * chunk_bytes)))
    total_bytes = n_requests * REQUEST_CHUNKS * chunk_bytes
    owned = args.paths is None
    work = tempfile.mkdtemp(prefix="lmcache-tiered-diskbench-", dir=args.workdir)
    paths = args.paths.split(",") if args.paths else [os.path.join(work, "nvme0")]
    for path in paths:
        os.makedirs(path, exist_ok=True)
    field_of = {
        "lmcache_local_disk": "lmcache_local_disk_read_gbps",
        "rust_raw_block": "rust_raw_block_read_gbps",
        "tiered": "tiered_read_gbps",
    }
    try:
        runs = contenders(paths, work, args)
        for contender in runs:
            progress(f"storing {total_bytes / 2**30:.1f} GiB through {contender.name}")
            fill(contender, chunk_bytes, n_requests)
        ceilings: list[float] = []
        method = ""
        for round_ in range(args.rounds):
            progress(f"round {round_ + 1}/{args.rounds}")
            gbps, method = ceiling(paths, chunk_bytes, total_bytes)
            ceilings.append(gbps)
            for contender in runs:
                contender.read_gbps.append(read_round(contender, chunk_bytes))
        tiered = next(c for c in runs if c.name == "tiered")
        backend = harness.get_backends(tiered.engine)["tiered"]
        io_engine = backend.cache.warm.engine.name
        result: dict[str, Any] = {
            "device_ceiling_gbps": statistics.median(ceilings),
            "device_ceiling_method": method,
            "lmcache_local_disk_read_gbps": None,
            "rust_raw_block_read_gbps": None,
            "tiered_read_gbps": None,
            "tiered_write_gbps": tiered.write_gbps,
            "chunk_mb": args.chunk_mb,
            "chunks": n_requests * REQUEST_CHUNKS,
            "paths": paths,
            "io_engine": io_engine,
            "rounds": args.rounds,
            "per_round_gbps": {"device_ceiling": ceilings}
            | {c.name: c.read_gbps for c in runs},
            "disk_bytes_per_served_byte": {c.name: c.disk_share for c in runs},
        }
        for contender in runs:
            result[field_of[contender.name]] = statistics.median(contender.read_gbps)
        if args.mp:
            from lmcache_tiered.bench.mpbench import mp_read_gbps

            progress("multi-process L2 adapter")
            result["mp_read_gbps"] = mp_read_gbps(paths, chunk_bytes, total_bytes)
        return result
    finally:
        harness.destroy_all_engines()
        shutil.rmtree(work, ignore_errors=True)
        if not owned:
            for path in paths:
                for name in os.listdir(path):
                    if name.startswith("kv-w") or name.startswith("lmcache-tiered-"):
                        os.unlink(os.path.join(path, name))


def progress(message: str) -> None:
    print(f"diskbench: {message}", file=sys.stderr, flush=True)


def table(result: dict[str, Any]) -> str:
    ceiling_gbps = result["device_ceiling_gbps"]
    rows = [("device ceiling (" + result["device_ceiling_method"] + ")", ceiling_gbps)]
    rows += [
        ("LMCache LocalDiskBackend (O_DIRECT)", result["lmcache_local_disk_read_gbps"]),
        ("LMCache RustRawBlockBackend", result["rust_raw_block_read_gbps"]),
        (f"TieredBackend ({result['io_engine']})", result["tiered_read_gbps"]),
    ]
    lines = [
        f"{result['chunks']} chunks of {result['chunk_mb']} MiB on "
        f"{', '.join(result['paths'])}; median of {result['rounds']} cold rounds",
        f"{'read path':45} {'GB/s':>6} {'x ceiling':>10}",
    ]
    for name, gbps in rows:
        if gbps is None:
            lines.append(f"{name:45} {'n/a':>6} {'':>10}")
        else:
            lines.append(f"{name:45} {gbps:6.2f} {gbps / ceiling_gbps:10.2f}")
    lines.append(
        f"{'TieredBackend write (through LMCache store)':45} "
        f"{result['tiered_write_gbps']:6.2f}"
    )
    if "mp_read_gbps" in result:
        lines.append(
            f"{'TieredL2Adapter (multi-process mode)':45} {result['mp_read_gbps']:6.2f}"
        )
    stock = result["lmcache_local_disk_read_gbps"]
    if stock:
        ratio = result["tiered_read_gbps"] / stock
        lines.append(f"TieredBackend / LocalDiskBackend: {ratio:.2f}x")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    harness.set_lmcache_log_level(logging.ERROR)
    result = run(args)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diskbench",
        help="cold-read GB/s: device ceiling vs LMCache's disk tiers vs TieredBackend",
    )
    parser.add_argument(
        "--paths",
        help="comma-separated directories, one per device "
        "(default: a temporary directory in --workdir)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="where temporary files go (default: the system temp dir)",
    )
    parser.add_argument("--chunk-mb", type=int, default=4, help="chunk size in MiB")
    parser.add_argument(
        "--total-gb", type=float, default=1.0, help="data stored and read per backend"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved cold rounds")
    parser.add_argument(
        "--io-engine", default="auto", choices=["auto", "uring", "threads"]
    )
    parser.add_argument("--queue-depth", type=int, default=64)
    parser.add_argument(
        "--mp", action="store_true", help="also measure the multi-process L2 adapter"
    )
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.set_defaults(func=main)
