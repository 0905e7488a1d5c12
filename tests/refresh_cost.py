"""What a shared cold tier's refresh costs (docs/cold-tier.md, issue 50).

``OWNERS`` other hosts, each with ``SLOTS`` slots, every header written; one
of them stores a chunk, then this host's refresh runs; printed: the CPU time
(all threads) and the wall time of each such refresh, and of one with
nothing new. Run from the repository root::

    python tests/refresh_cost.py DIR [OWNERS [SLOTS]]

``DIR`` is made, filled (4 KiB of headers a slot: 3.3 GB by default) and
removed.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered.cache import shared as shared_module
from lmcache_tiered.cache.shared import SharedCold
from lmcache_tiered.config import TieredConfig
from lmcache_tiered.storage.layout import (
    HEADER_SIZE,
    Geometry,
    RecordHeader,
    TierNames,
)
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.tier import Tier

PAYLOAD = 4096
#: header blocks written at a time while filling an owner's header file
FILL = 1024


def key(owner: int, i: int) -> CacheEngineKey:
    return CacheEngineKey("llama", 1, 0, owner << 32 | i, torch.bfloat16)


def header(owner: int, slot: int) -> bytes:
    """A record's header block in ``slot`` (its payload is never read)."""
    shape = torch.Size([PAYLOAD // 2])
    fmt = MemoryFormat.KV_2LTD
    record = RecordHeader(
        key(owner, slot), shape, torch.bfloat16, fmt, PAYLOAD, 0, slot, 0
    )
    return record.encode()


def payload(owner: int, i: int) -> Payload:
    data = memoryview(bytearray(PAYLOAD))
    shape = torch.Size([PAYLOAD // 2])
    fmt = MemoryFormat.KV_2LTD
    return Payload(key(owner, i), shape, torch.bfloat16, fmt, data, False)


def fill(tier: Tier, owner: int, slots: int) -> None:
    """Every slot of ``tier``'s files holding a record: the first written by
    the tier, the others' headers written straight into its files."""
    assert tier.write_payloads([payload(owner, 0)]) == [True]
    first = tier.index.allocated_slots
    tier.close()
    names = TierNames(tier.paths, tier.owner)
    os.truncate(names.slabs[0], slots * tier.geometry.per_device)
    fd = os.open(names.header, os.O_WRONLY)
    try:
        for start in range(first, slots, FILL):
            blocks = [header(owner, s) for s in range(start, min(start + FILL, slots))]
            os.pwrite(fd, b"".join(blocks), Geometry.header_offset(start))
    finally:
        os.close(fd)


def main(root: Path, owners: int = 8, slots: int = 100_000) -> None:
    cold, warm = root / "cold", root / "warm"
    cold.mkdir(parents=True)
    warm.mkdir()
    gb = (slots + 1) * (PAYLOAD + HEADER_SIZE) / 2**30
    settings = TieredConfig.from_extra_config(
        {
            "tiered.warm.paths": [str(warm)],
            "tiered.cold.paths": [str(cold)],
            "tiered.cold.capacity_gb": gb,
        }
    )
    assert settings.cold is not None
    options = settings.tier_options(settings.cold)
    capacity = settings.cold.capacity_bytes

    def open_owner(i: int) -> Tier:
        return Tier(
            options,
            owner=f"kv-w0-host{i}",
            max_payload=PAYLOAD,
            capacity_bytes=capacity,
            change_log=True,
        )

    started = time.perf_counter()
    for i in range(owners):
        fill(open_owner(i), i, slots)
    took = time.perf_counter() - started
    print(f"{owners} owners of {slots} slots made in {took:.0f} s")
    writer = open_owner(owners // 2)
    shared_module.REFRESH_S = 3600.0  # refreshed here only
    own = Tier(options, owner="kv-w0-us", max_payload=PAYLOAD, capacity_bytes=8 << 20)
    started = time.perf_counter()
    shared = SharedCold(own, settings, max_payload=PAYLOAD)
    try:
        chunks = sum(len(t) for t in shared.tiers())
        took = time.perf_counter() - started
        print(f"first look: {chunks} chunks in {took:.1f} s")
        for i in range(1, 6):
            assert writer.write_payloads([payload(owners // 2, i)]) == [True]
            cpu, wall = time.process_time(), time.perf_counter()
            shared.refresh()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            assert shared.find(key(owners // 2, i)) is not None
            print(
                f"refresh after one chunk stored: {cpu * 1e3:.2f} ms CPU, "
                f"{wall * 1e3:.2f} ms wall"
            )
        cpu = time.process_time()
        shared.refresh()
        print(
            f"refresh with nothing new: {(time.process_time() - cpu) * 1e3:.2f} ms CPU"
        )
    finally:
        shared.close()
        own.close()
        writer.close()


if __name__ == "__main__":
    target = Path(sys.argv[1])
    try:
        main(target, *(int(a) for a in sys.argv[2:4]))
    finally:
        shutil.rmtree(target, ignore_errors=True)
