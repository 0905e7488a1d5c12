"""What ``lmcache-tiered diskbench`` runs: the device ceiling, LMCache's disk
backends and ``TieredBackend`` read cold on the same paths, placement by
placement, round by round. Its options and help text are in
:mod:`lmcache_tiered.cli.diskbench`.

May touch: files under ``--paths`` / ``--workdir`` (removed at the end); the
page cache (dropped between rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lmcache_tiered import testing
from lmcache_tiered.bench.common.args import OWN_MOONCAKE
from lmcache_tiered.bench.common.stores import mooncake_pool, rerun_isolated
from lmcache_tiered.bench.disk import mpbench
from lmcache_tiered.bench.disk.disk_report import (
    CONTENDERS,
    Placement,
    median_of,
    mp_result,
    paired_median,
    table,
    unsteady_writes,
)
from lmcache_tiered.bench.disk.rawio import (
    drop_page_cache,
    fio_read_gbps,
    raw_read_gbps,
    reads_capped,
)
from lmcache_tiered.config import plugin_extra_config
from lmcache_tiered.io.uring import UringEngine
from lmcache_tiered.storage.filesystems import IN_MEMORY_FILESYSTEMS, filesystem_type
from lmcache_tiered.testing import netns
from lmcache_tiered.testing.lmcache import RUST_RAW_BLOCK_EXTENSION

#: Why ``--store mooncake`` and other stores are refused together outside a
#: network namespace.
OWN_POOL_ALONE = (
    "--store mooncake runs diskbench in a network namespace of its own, with "
    "only loopback, where the other --store cannot be reached: measure them in "
    "a run of their own, or start them inside a namespace with the run "
    "(docs/cold-tier.md shows how)"
)
#: tokens per LMCache chunk and KV heads x head size of the synthetic model;
#: the layer count is chosen so a chunk has the requested size
CHUNK_TOKENS, HEADS, HEAD_SIZE = 256, 8, 128
#: chunks stored and read per request (one batched_get call)
REQUEST_CHUNKS = 32
#: LMCache's wrapper (always installed with LMCache) and the Rust extension it
#: needs (a separate package): only the extension says whether it can run
RUST_MODULE = "lmcache.v1.storage_backend.plugins.rust_raw_block_backend"
RUST_EXTENSION = RUST_RAW_BLOCK_EXTENSION
RUST_MISSING = (
    f"LMCache's RustRawBlockBackend needs the Rust extension {RUST_EXTENSION}, "
    "which is not installed (pip install --pre lmcache-rust-raw-block-io)"
)
#: seconds a contender may store nothing before its fill counts as failed
STALL_S = 10.0
#: our multi-process adapter's name among the contenders' figures (``--mp``);
#: the multi-process contenders are read after the others in every round, on
#: files of their own
MP = mpbench.OURS


class StoreFailed(RuntimeError):
    """A contender could not store its chunks (a full disk, a write error)."""


@dataclass
class Contender:
    """One LMCache configuration under test, with its engine once built."""

    name: str
    location: str
    config: dict[str, Any]
    extra: dict[str, Any]
    #: where its data lands (for the space check and a failed fill's reason)
    dirs: list[str]
    engine: Any = None
    requests: list[torch.Tensor] = field(default_factory=list)


def contenders(
    paths: list[str],
    work: str,
    args: argparse.Namespace,
    stored_bytes: int,
    mp_stores: list[tuple[str, list[str], int]],
) -> list[Contender]:
    """Every contender that can run here, each to store ``stored_bytes``
    (and the multi-process ones, name, directories and bytes, ``mp_stores``);
    ValueError before anything is written where they would fill a disk."""
    total_gb = args.total_gb * 1.5  # headroom for the last request's chunks
    stock_dir = os.path.join(work, "local_disk")
    os.makedirs(stock_dir, exist_ok=True)
    found = [
        Contender(
            "lmcache_local_disk",
            "LocalDiskBackend",
            {"local_disk": stock_dir, "max_local_disk_size_gb": total_gb},
            {"use_odirect": True},
            [stock_dir],
        ),
        Contender(
            "tiered",
            "tiered",
            {"storage_plugins": ["tiered"]},
            plugin_extra_config(
                {
                    "tiered.warm.paths": paths,
                    "tiered.warm.capacity_gb": total_gb,
                    "tiered.io_engine": args.io_engine,
                    # as on a GPU host, where LMCache pins the pool and ``auto``
                    # registers it; a CPU-only host's pool is pageable
                    "tiered.register_cpu_pool": "always",
                    "tiered.queue_depth": args.queue_depth,
                    "tiered.warmup.policy": "none",
                }
            ),
            paths,
        ),
    ]
    if rust_unavailable() is None:
        device = os.path.join(work, "rust_raw_block.img")
        capacity = int(total_gb * 2**30)
        # its metadata region must fit well inside the capacity
        meta = min(64 << 20, capacity // 4 >> 20 << 20)
        found.append(
            Contender(
                "rust_raw_block",
                "rrb",
                {"storage_plugins": ["rrb"]},
                {
                    "storage_plugin.rrb.module_path": RUST_MODULE,
                    "storage_plugin.rrb.class_name": "RustRawBlockBackend",
                    "rust_raw_block.device_path": device,
                    # its capacity counts the metadata region in
                    "rust_raw_block.capacity_bytes": capacity + meta,
                    "rust_raw_block.meta_total_bytes": meta,
                    "rust_raw_block.use_odirect": True,
                    "rust_raw_block.io_engine": "io_uring",
                },
                [work],
            )
        )
    check_space([(c.name, c.dirs, stored_bytes) for c in found] + mp_stores)
    if found[-1].location == "rrb":
        device = found[-1].extra["rust_raw_block.device_path"]
        try:
            with open(device, "wb") as f:
                f.truncate(capacity + meta)
        except OSError as exc:
            raise StoreFailed(
                f"rust_raw_block: cannot create its device file {device} of "
                f"{(capacity + meta) / 1e9:.2f} GB: {exc.strerror or exc}"
            ) from None
    return found


def rust_unavailable() -> str | None:
    """Why RustRawBlockBackend cannot run here, or None where it can."""
    if importlib.util.find_spec(RUST_EXTENSION) is None:
        return RUST_MISSING
    try:
        importlib.import_module(RUST_MODULE)
    except ImportError as exc:
        return f"LMCache's RustRawBlockBackend does not import: {exc}"
    return None


def fill(
    contender: Contender, chunk_bytes: int, n_requests: int, log_level: int
) -> float:
    """Build the contender's engine (LMCache logging at ``log_level``) and
    store ``n_requests`` x 32 chunks; the write GB/s."""
    layers = chunk_bytes // (2 * CHUNK_TOKENS * HEADS * HEAD_SIZE * 2)
    config = testing.build_config(
        chunk_size=CHUNK_TOKENS,
        max_local_cpu_size_gb=max(1.0, 3 * REQUEST_CHUNKS * chunk_bytes / 2**30),
        extra_config=contender.extra,
        **contender.config,
    )
    contender.engine, connector = testing.build_engine(
        config,
        num_layers=layers,
        num_kv_heads=HEADS,
        head_size=HEAD_SIZE,
        log_level=log_level,
    )
    tokens_per_request = REQUEST_CHUNKS * CHUNK_TOKENS
    kv = testing.make_kv(connector, tokens_per_request, seed=1)
    started = time.perf_counter()
    for i in range(n_requests):
        tokens = testing.make_tokens(tokens_per_request, seed=1000 + i)
        testing.store_tokens(contender.engine, tokens, kv)
        contender.requests.append(tokens)
    wait_stored(contender, chunk_bytes)
    elapsed = time.perf_counter() - started
    return n_requests * REQUEST_CHUNKS * chunk_bytes / elapsed / 1e9


def wait_stored(contender: Contender, chunk_bytes: int) -> None:
    """Block until every chunk stored is durable in the contender.

    LMCache drops a backend's failed write silently (the key just stays in
    flight), so a contender that stored nothing for :data:`STALL_S` seconds
    has failed: StoreFailed, with what a test write in its directories says.
    """
    backend = testing.get_backends(contender.engine)[contender.location]
    keys = [
        key
        for tokens in contender.requests
        for key in testing.chunk_keys(contender.engine, tokens)
    ]
    pending, progressed = keys, time.monotonic()
    while pending:
        left = [
            k
            for k in pending
            if backend.exists_in_put_tasks(k) or not backend.contains(k)
        ]
        if len(left) < len(pending):
            progressed = time.monotonic()
        elif time.monotonic() - progressed > STALL_S:
            raise StoreFailed(
                f"{contender.name} stored {len(keys) - len(left)} of {len(keys)} "
                f"chunks, none in the last {STALL_S:g} s; "
                + "; ".join(write_probe(path, chunk_bytes) for path in contender.dirs)
            )
        pending = left
        time.sleep(0.005)


def write_probe(directory: str, nbytes: int) -> str:
    """What writing (and syncing) ``nbytes`` in ``directory`` says: the error a
    backend's own write most likely hit (a full disk), or that it works."""
    free = shutil.disk_usage(directory).free / 1e9
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"\0" * nbytes)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        return (
            f"a test write of {nbytes / 2**20:g} MiB in {directory} "
            f"({free:.2f} GB free) fails: {exc.strerror or exc}"
        )
    return (
        f"a test write of {nbytes / 2**20:g} MiB in {directory} ({free:.2f} GB "
        "free) works, so the backend's own write failed: rerun with -v for its log"
    )


def check_space(stores: list[tuple[str, list[str], int]]) -> None:
    """Refuse a placement whose contenders (name, directories, bytes spread
    over them) would fill a file system, all stored at once."""
    need: dict[int, float] = {}
    names: dict[int, str] = {}
    for _, dirs, nbytes in stores:
        for path in dirs:
            device = os.stat(path).st_dev
            need[device] = need.get(device, 0.0) + nbytes / len(dirs)
            names.setdefault(device, path)
    for device, needed in need.items():
        free = shutil.disk_usage(names[device]).free
        if needed * 1.05 > free:
            raise ValueError(
                f"the contenders ({', '.join(name for name, *_ in stores)}) would "
                f"store {needed / 1e9:.2f} GB on the file system of {names[device]}, "
                f"which has {free / 1e9:.2f} GB free: lower --total-gb, or point "
                "--workdir/--paths at a larger file system"
            )


@dataclass(frozen=True)
class Round:
    """One contender's cold read of everything it stored."""

    gbps: float
    #: bytes the kernel read from storage per byte served (1.0: every byte
    #: came from disk, not from a cache somewhere)
    disk_share: float
    #: this process's CPU seconds (all threads, user + system) per GB served
    cpu_s_per_gb: float


def read_round(contender: Contender, chunk_bytes: int) -> Round:
    """Cold-read every stored chunk through StorageManager.batched_get."""
    engine = contender.engine
    testing.clear_cpu_tier(engine)
    drop_page_cache()
    disk_before = storage_bytes_read()
    cpu_before = time.process_time()
    started = time.perf_counter()
    for tokens in contender.requests:
        objs = testing.get_chunks(engine, tokens, contender.location)
        missing = sum(obj is None for obj in objs)
        if missing:
            raise RuntimeError(f"{contender.name}: {missing} chunks not served")
        for obj in objs:
            assert obj is not None
            obj.ref_count_down()
        testing.clear_cpu_tier(engine)
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    served = len(contender.requests) * REQUEST_CHUNKS * chunk_bytes
    disk_share = (storage_bytes_read() - disk_before) / served
    return Round(served / elapsed / 1e9, disk_share, cpu / (served / 1e9))


def storage_bytes_read() -> int:
    """Bytes this process made the kernel fetch from storage (/proc/self/io)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"])


def ceiling(files: list[str], chunk_bytes: int, total_bytes: int) -> tuple[float, str]:
    """Raw read GB/s of up to ``total_bytes`` of ``files`` (the tiered slabs:
    never written here, so at most what the shortest one holds, per file)."""
    per_file = min(os.path.getsize(name) for name in files) // chunk_bytes
    total_bytes = min(total_bytes, per_file * chunk_bytes * len(files))
    drop_page_cache()
    fio = fio_read_gbps(files, chunk_bytes, total_bytes)
    if fio is not None:
        return fio, "fio io_uring iodepth=32"
    drop_page_cache()
    return raw_read_gbps(files, chunk_bytes, total_bytes), "lmcache-tiered raw loop"


def run_placement(
    index: int,
    args: argparse.Namespace,
    chunk_bytes: int,
    n_requests: int,
    store_specs: Sequence[Mapping[str, Any]] = (),
) -> tuple[Placement, str, str]:
    """Fill fresh files (contenders rotated by ``index``) and the stores
    ``store_specs`` names (their JSON), then read them in ``args.rounds``
    interleaved cold rounds. Returns the placement, the ceiling's method and
    the tiered engine's name."""
    work = tempfile.mkdtemp(prefix="lmcache-tiered-diskbench-", dir=args.workdir)
    bases = args.paths.split(",") if args.paths else [work]
    paths = [tempfile.mkdtemp(prefix="nvme-", dir=base) for base in bases]
    mp_dirs = (
        [tempfile.mkdtemp(prefix="mp-", dir=base) for base in bases] if args.mp else []
    )
    total_bytes = n_requests * REQUEST_CHUNKS * chunk_bytes
    try:
        mp: list[mpbench.MpContender] = []
        if mp_dirs:
            arena = mpbench.Arena(chunk_bytes, total_bytes)
            mp, missing = mpbench.contenders(
                mp_dirs, arena, io_engine=args.io_engine, queue_depth=args.queue_depth
            )
            mp += mpbench.store_contenders(store_specs, arena)
        mp_stores = [(c.name, c.dirs, total_bytes * c.copies) for c in mp]
        runs = contenders(paths, work, args, total_bytes, mp_stores)
        # Every contender stores in turn, the order rotated each placement,
        # the multi-process ones too: on drives in a VM's RAM the first
        # gigabytes written can be ten times faster than the next ones, where
        # the host must find memory for them (docs/diskbench.md)
        order: list[Contender | mpbench.MpContender] = [*runs, *mp]
        shift = index % len(order)
        order = order[shift:] + order[:shift]
        placement = Placement([c.name for c in order])
        for position, contender in enumerate(order):
            progress(f"placement {index + 1}: storing through {contender.name}")
            if isinstance(contender, mpbench.MpContender):
                placement.write_gbps[contender.name] = mpbench.fill(contender)
                continue
            # LMCache's start-up warnings (hash seed, controller) once a run,
            # from the first engine, not again for every engine built
            first = index == 0 and position == 0
            placement.write_gbps[contender.name] = fill(
                contender,
                chunk_bytes,
                n_requests,
                logging.WARNING if first else logging.ERROR,
            )
        placement.mp = {a.name: a.describe() for a in mp}
        if mp:
            placement.mp_unavailable = missing
        # and they read in turn each round, in an order rotated the same way
        shift = index % len(runs)
        runs = runs[shift:] + runs[:shift]
        tiered = next(c for c in runs if c.name == "tiered")
        warm = testing.get_backends(tiered.engine)["tiered"].cache.warm
        slabs = warm.slab_paths
        method = ""
        for round_ in range(args.rounds):
            progress(f"placement {index + 1}: round {round_ + 1}/{args.rounds}")
            gbps, method = ceiling(slabs, chunk_bytes, total_bytes)
            placement.ceiling_gbps.append(gbps)
            for contender in runs:
                measured = read_round(contender, chunk_bytes)
                placement.record(contender.name, measured.gbps, measured.cpu_s_per_gb)
                placement.disk_share.setdefault(contender.name, []).append(
                    measured.disk_share
                )
            # every round one later, so none is always read first
            readable = [c for c in mp if c.restart == "recovered"]
            shift = round_ % len(readable) if readable else 0
            for adapter in readable[shift:] + readable[:shift]:
                disk_before = storage_bytes_read()
                placement.record(adapter.name, *mpbench.read_round(adapter))
                read = storage_bytes_read() - disk_before
                if not adapter.store:  # a store reads no drive
                    placement.disk_share.setdefault(adapter.name, []).append(
                        read / (mpbench.READ_PASSES * total_bytes)
                    )
        for store in (c for c in mp if c.store):
            mpbench.forget(store)
        engine = warm.engine
        if isinstance(engine, UringEngine) and engine.stats()["fixed"]:
            return placement, method, f"{engine.name}, CPU pool registered"
        return placement, method, engine.name
    finally:
        testing.destroy_all_engines()
        shutil.rmtree(work, ignore_errors=True)
        for path in paths + mp_dirs:
            shutil.rmtree(path, ignore_errors=True)


def in_memory_filesystems(args: argparse.Namespace) -> list[str]:
    """The in-memory file systems (tmpfs) among those the files are on."""
    bases = (args.paths or args.workdir or tempfile.gettempdir()).split(",")
    kinds = {filesystem_type(os.path.realpath(base)) for base in bases}
    return sorted(kinds & set(IN_MEMORY_FILESYSTEMS))


def requests_of(args: argparse.Namespace) -> int:
    """Requests of :data:`REQUEST_CHUNKS` chunks each contender stores."""
    request_bytes = REQUEST_CHUNKS * (args.chunk_mb << 20)
    return max(1, round(args.total_gb * 2**30 / request_bytes))


def run(
    args: argparse.Namespace, store_specs: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """Every placement; the results. ``store_specs``: each ``--store``'s JSON."""
    chunk_bytes = args.chunk_mb << 20
    n_requests = requests_of(args)
    placements: list[Placement] = []
    method = io_engine = ""
    for index in range(args.placements):
        placement, method, io_engine = run_placement(
            index, args, chunk_bytes, n_requests, store_specs
        )
        placements.append(placement)

    result: dict[str, Any] = {
        "device_ceiling_gbps": statistics.median(
            g for p in placements for g in p.ceiling_gbps
        ),
        "device_ceiling_method": method + " over the tiered slab files",
        **{
            f"{name}_{what}": median_of(placements, name, what)
            for name in CONTENDERS
            for what in ("read_gbps", "cpu_s_per_gb", "write_gbps")
        },
        "rust_raw_block_unavailable": rust_unavailable(),
        "chunk_mb": args.chunk_mb,
        "chunks": n_requests * REQUEST_CHUNKS,
        "paths": args.paths.split(",") if args.paths else ["(a temporary directory)"],
        "in_memory_filesystems": in_memory_filesystems(args),
        "io_engine": io_engine,
        "placements": args.placements,
        "rounds": args.rounds,
        "paired_ratios": {
            "tiered_vs_ceiling": paired_median(placements, "tiered"),
            "tiered_vs_local_disk": paired_median(
                placements, "tiered", "lmcache_local_disk"
            ),
            "tiered_vs_rust_raw_block": paired_median(
                placements, "tiered", "rust_raw_block"
            ),
        },
        "disk_share": {
            name: median_of(placements, name, "disk_share")
            for name in placements[0].disk_share
        },
        "per_placement": [asdict(p) for p in placements],
        "unsteady_writes": unsteady_writes(placements),
    }
    if args.mp:
        result |= mp_result(placements, reads_capped(), result["unsteady_writes"])
        result["stores"] = [dict(spec) for spec in store_specs]
    return result


def progress(message: str) -> None:
    print(f"diskbench: {message}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    """The run, printed and written; with ``--store mooncake``, first in a
    network namespace of its own (this command again, there), then with a
    Mooncake pool of its own."""
    testing.set_lmcache_log_level(logging.ERROR)
    own_pool = OWN_MOONCAKE in args.store
    with contextlib.ExitStack() as stack:
        try:
            for option, path in [("--workdir", args.workdir)] + [
                ("--paths", p) for p in (args.paths or "").split(",") if args.paths
            ]:
                if path is not None and not os.path.isdir(path):
                    raise ValueError(f"{option} {path}: not a directory")
            if args.store and not args.mp:
                raise ValueError("--store adds contenders to --mp: give --mp too")
            if own_pool and not netns.isolated():
                if len(args.store) > 1:  # the others are out of reach there
                    raise ValueError(OWN_POOL_ALONE)
                return rerun_isolated(args.command_line, "--store mooncake")
            specs = args.store
            if own_pool:  # the next placement's upserts may meet leased chunks
                stored = requests_of(args) * REQUEST_CHUNKS * (args.chunk_mb << 20)
                mine = stack.enter_context(mooncake_pool(2 * stored))
                specs = [mine if s == OWN_MOONCAKE else s for s in specs]
        except (RuntimeError, ValueError) as exc:  # options; the pool's start
            print(f"diskbench: {exc}", file=sys.stderr)
            return 2
        try:
            result = run(args, specs)
        except (StoreFailed, ValueError) as exc:
            print(f"diskbench: {exc}", file=sys.stderr)
            return 2
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
