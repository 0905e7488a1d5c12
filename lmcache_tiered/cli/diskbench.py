"""``lmcache-tiered diskbench``: cold-read bandwidth of each way to store KV.

In one run, on the same paths and the same chunks:

1. the device ceiling: fio (io_uring, O_DIRECT, iodepth 32) over the very
   blocks that hold the tiered data (its slab files), else our raw loop;
2. LMCache's stock ``LocalDiskBackend`` (``use_odirect: true``);
3. LMCache's ``RustRawBlockBackend`` on a file, when its package is installed;
4. ``TieredBackend``, with LMCache's CPU pool registered as io_uring fixed
   buffers (``tiered.register_cpu_pool: always``), as it is on a GPU host,
   where LMCache pins the pool; a CPU-only host's pool is pageable;
5. with ``--mp``, the multi-process L2 adapters, through the interface
   LMCache's ``lmcache server`` drives them by
   (:mod:`lmcache_tiered.bench.disk.mpbench`), on files of their own, read
   after the others in every round:
   ``TieredL2Adapter`` over every path, and LMCache's own ``fs``,
   ``fs_native`` and ``raw_block`` (when its Rust package is installed) on the
   first path and one per path, as LMCache's store and prefetch policies place
   them, and ``raw_block`` one path per key (a placement LMCache has proposed,
   not released).
   With ``--store``, stores a cold tier runs on too, each as one adapter:
   any ``tiered.cold.adapter`` JSON (Redis through LMCache's ``resp``), or
   ``mooncake``, a Mooncake pool diskbench starts itself on loopback (the run
   then goes in a network namespace of its own with only loopback up, which
   needs root: Mooncake listens on all addresses). Their figures are a store
   on this host, in memory: no drive, no NIC.

2-4 are driven through LMCache's own ``StorageManager.batched_get`` after the
CPU tier is emptied and the page cache dropped, so every byte comes from disk.

Where data lands matters as much as how it is read: two identical
TieredBackends can read at steadily different speeds, depending only on the
blocks their files got (docs/diskbench.md has the figures). So the comparison
is repeated over ``--placements`` fresh sets of files (filled in a rotated
order), with ``--rounds`` interleaved cold rounds on each; figures are
medians over all rounds, and ratios are taken round by round.
"""

from __future__ import annotations

import argparse

from lmcache_tiered.cli.shared import store_arg

SUMMARY = "cold-read GB/s: device ceiling vs LMCache's disk tiers vs TieredBackend"
RUN = "lmcache_tiered.bench.disk.diskbench:main"


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument(
        "--placements",
        type=int,
        default=3,
        help="fresh sets of files, filled in a rotated order (default: 3)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaved cold rounds per placement"
    )
    parser.add_argument(
        "--io-engine",
        default="auto",
        choices=["auto", "uring", "threads"],
        help="TieredBackend's I/O engine (tiered.io_engine)",
    )
    parser.add_argument(
        "--queue-depth",
        type=int,
        default=64,
        help="TieredBackend's reads in flight per ring (tiered.queue_depth)",
    )
    parser.add_argument(
        "--mp",
        action="store_true",
        help="also measure the multi-process L2 adapters: ours, and LMCache's fs, "
        "fs_native and raw_block on one path and one per path",
    )
    parser.add_argument(
        "--store",
        action="append",
        default=[],
        type=store_arg("--store"),
        metavar="JSON|mooncake",
        help="with --mp, also a store a cold tier runs on, as one L2 adapter: "
        'the JSON LMCache\'s --l2-adapter takes (e.g. \'{"type": "resp", '
        '"host": "127.0.0.1", "port": 6379}\'), or mooncake: a Mooncake pool '
        "of diskbench's own on loopback, in a network namespace of its own "
        "(root); repeatable (default: none); its chunks are deleted after each "
        "placement",
    )
    parser.add_argument("--json", help="write the results to this JSON file")
