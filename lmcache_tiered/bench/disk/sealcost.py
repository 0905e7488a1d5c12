"""What a fleet secret costs a tier's reads: CPU per GB and GB/s, side by side.

Three tiers over the same directories, each holding the same chunks, read in
turn every round (so drift hits all three alike) through the real read path
(the tier's engine, O_DIRECT, its checks on the verifier pool): records
checked with CRC32C on every read (``verify_reads``, the default), not checked
(``verify_reads: false`` once a record was read), and sealed under a fleet
secret (a BLAKE3 keyed MAC checked on every read, ``cold.auth_key_file``).
Also each check alone on one core, from memory. Run it on the rig::

    python -m lmcache_tiered.bench.disk.sealcost --paths $(nvme-emu paths)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from rich.console import Console
from rich.table import Table

from lmcache_tiered.config import TierOptions
from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.keys import StoreKey
from lmcache_tiered.storage.layout import RecordHeader, align_up, payload_checksum
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.seal import MIN_SECRET_BYTES, RecordSeal
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.testing.crash_check import chunk_key
from lmcache_tiered.testing.lmcache import MixedMemoryAllocator

#: name -> (verify_reads, sealed)
VARIANTS = {
    "crc32c every read": (True, False),
    "no check": (False, False),
    "mac every read": (True, True),
}


def _options(paths: Sequence[str], verify: bool) -> TierOptions:
    return TierOptions(
        name="cold",
        paths=tuple(paths),
        stripe_bytes=1 << 20,
        io_engine="auto",
        queue_depth=64,
        direct_io=True,
        verify_reads=verify,
        fsync=False,
        file_mode=0o600,
        paths_setting="--paths",
        capacity_setting="--total-gb",
        slot_setting="--chunk-mb",
    )


def _chunks(count: int, chunk_bytes: int) -> list[Payload]:
    data = aligned_buffer(align_up(chunk_bytes))[:chunk_bytes]
    data[:] = os.urandom(chunk_bytes)
    shape = torch.Size([chunk_bytes])
    return [
        Payload(chunk_key(i), shape, torch.uint8, MemoryFormat.KV_2LTD, data, True)
        for i in range(count)
    ]


def _timed(read: Callable[[], object]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call: every thread's CPU counts."""
    wall, cpu = time.perf_counter(), time.process_time()
    read()
    return time.perf_counter() - wall, time.process_time() - cpu


def _hash_alone(chunk: memoryview, seal: RecordSeal) -> dict[str, float]:
    """CPU seconds per GB of each check alone, one core, from memory."""
    checks: dict[str, Callable[[], object]] = {
        "crc32c every read": lambda: payload_checksum(chunk),
        "mac every read": lambda: seal.mac(b"", chunk),
    }
    rounds = max(1, (1 << 30) // len(chunk))
    gigabytes = rounds * len(chunk) / 1e9
    return {
        name: min(_timed(partial(_repeat, check, rounds))[1] for _ in "ab") / gigabytes
        for name, check in checks.items()
    }


def _repeat(call: Callable[[], object], times: int) -> None:
    for _ in range(times):
        call()


def run(paths: Sequence[str], total_gb: float, chunk_mb: int, rounds: int) -> Table:
    chunk_bytes = chunk_mb << 20
    count = max(1, int(total_gb * 1e9) // chunk_bytes)
    payloads = _chunks(count, chunk_bytes)
    keys: list[StoreKey] = [p.key for p in payloads]
    seal = RecordSeal(os.urandom(MIN_SECRET_BYTES))
    tiers = {
        name: Tier(
            _options(paths, verify),
            owner=f"sealcost-{i}",
            max_payload=chunk_bytes,
            capacity_bytes=2 * count * (chunk_bytes + (64 << 20)),
            seal=seal if sealed else None,
        )
        for i, (name, (verify, sealed)) in enumerate(VARIANTS.items())
    }
    # LMCache's own allocator, as a demand read lands: the same memory each
    # round, so no round pays for faulting fresh pages in
    allocator = MixedMemoryAllocator(count * align_up(chunk_bytes) + (64 << 20))

    def allocate(header: RecordHeader) -> MemoryObj | None:
        return allocator.allocate(header.shape, header.dtype, header.fmt)

    def read(tier: Tier) -> None:
        objs = tier.read(keys, allocate)
        assert all(obj is not None for obj in objs), f"{tier.owner}: a chunk missed"
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()

    try:
        samples: dict[str, list[tuple[float, float]]] = {n: [] for n in tiers}
        for tier in tiers.values():
            assert all(tier.write_payloads(payloads)), "a chunk was not stored"
            read(tier)  # every record read once: "verified"
        for _ in range(rounds):
            for name, tier in tiers.items():
                samples[name].append(_timed(partial(read, tier)))
    finally:
        for tier in tiers.values():
            tier.close()
        allocator.close()
    alone = _hash_alone(payloads[0].view, seal)
    gigabytes = count * chunk_bytes / 1e9
    base = statistics.median(c for _, c in samples["no check"]) / gigabytes
    table = Table(title=f"{gigabytes:.2f} GB read {rounds}x, {chunk_mb} MiB chunks")
    for column in ("reads", "GB/s", "CPU s/GB", "over no check", "check alone"):
        table.add_column(column, justify="right" if column != "reads" else "left")
    for name, runs in samples.items():
        cpu = statistics.median(c for _, c in runs) / gigabytes
        gbps = gigabytes / statistics.median(w for w, _ in runs)
        alone_cell = f"{alone[name]:.3f}" if name in alone else ""
        table.add_row(
            name, f"{gbps:.2f}", f"{cpu:.3f}", f"{cpu - base:+.3f}", alone_cell
        )
    return table


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", help="comma-separated directories (default: /tmp)")
    parser.add_argument("--total-gb", type=float, default=1.0)
    parser.add_argument("--chunk-mb", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        bases = args.paths.split(",") if args.paths else [scratch]
        work = [tempfile.mkdtemp(prefix="sealcost-", dir=base) for base in bases]
        try:
            table = run(work, args.total_gb, args.chunk_mb, args.rounds)
        finally:
            for directory in work:
                for name in os.listdir(directory):
                    os.remove(os.path.join(directory, name))
                os.rmdir(directory)
    Console().print(table)


if __name__ == "__main__":
    main()
