"""Faults a tier must survive as a cache miss: never a crash, a hang or a
wrong byte.

Every chunk's bytes are a function of its key (:func:`chunk`), so a child
process and the test agree on them and every served chunk is checked. Each
test prints one ``FIGURES`` line (see with ``pytest -s``): operations run,
those that failed cleanly, wrong bytes served (always 0) and what was lost.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    cache_of,
    new_allocator,
    plugin_extra_config,
    random_kv,
    wait_until,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from lmcache_tiered import testing
from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.config import SETTINGS, ConfigError, TieredConfig
from lmcache_tiered.io import base as io_base
from lmcache_tiered.io.base import IOEngine, IORequest
from lmcache_tiered.storage import health, layout
from lmcache_tiered.storage.layout import RecordHeader
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.warmup.base import Plan

SHAPE = torch.Size([2, 2, 64, 128])  # 64 KiB of bf16
CHUNK_BYTES = SHAPE.numel() * 2
#: disk bytes of one slot of a two-device tier of CHUNK_BYTES chunks
SLOT_BYTES = CHUNK_BYTES + 4096
MODEL = "fault-model"
EngineFactory = Callable[..., Any]


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, i, torch.bfloat16, None)


def chunk(i: int) -> torch.Tensor:
    """The bytes stored under key ``i``, in every process."""
    return random_kv(SHAPE, i)


def figures(fault: str, **numbers: float) -> None:
    """One line of figures per fault test (printed with ``pytest -s``)."""
    print(f"\nFIGURES {fault}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()))


def tiered_config(paths: Sequence[Path | str], **settings: Any) -> TieredConfig:
    extra: dict[str, Any] = {
        "tiered.warm.paths": [str(p) for p in paths],
        "tiered.warmup.policy": "none",
    }
    extra.update({f"tiered.{k}": v for k, v in settings.items()})
    return TieredConfig.from_extra_config(extra)


def open_cache(config: TieredConfig, chunks: Chunks) -> TieredCache:
    """A TieredCache of one worker, no CPU tier, reading into ``chunks``."""
    return TieredCache(
        config,
        owner="kv-w0",
        max_payload=CHUNK_BYTES,
        local_workers=1,
        hot=None,
        allocate=chunks.allocate,
    )


def open_tier(paths: Sequence[Path | str], slots: int, **settings: Any) -> Tier:
    config = tiered_config(paths, **settings)
    return Tier(
        config.tier_options(config.warm),
        owner="kv-w0",
        max_payload=CHUNK_BYTES,
        capacity_bytes=slots * SLOT_BYTES,
    )


class Chunks:
    """MemoryObjs holding :func:`chunk` data, from one LMCache allocator."""

    def __init__(self, size: int = 128 << 20) -> None:
        self.allocator = new_allocator(size)

    def make(self, i: int) -> MemoryObj | None:
        obj = self.allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
        if obj is not None:
            assert obj.tensor is not None
            obj.tensor.copy_(chunk(i))
        return obj

    def allocate(self, header: RecordHeader) -> MemoryObj | None:
        return self.allocator.allocate(header.shape, header.dtype, header.fmt)

    def store(self, tier: Tier, ids: Sequence[int]) -> list[bool]:
        """Write chunks ``ids`` to ``tier``, releasing them as LMCache does."""
        items = [(key(i), self.make(i)) for i in ids]
        try:
            return tier.write([(k, o) for k, o in items if o is not None])
        finally:
            for _, obj in items:
                if obj is not None:
                    obj.ref_count_down()


class Verdict:
    """Tally of reads checked against :func:`chunk`."""

    def __init__(self) -> None:
        self.hits = self.misses = self.wrong_bytes = 0
        self.lock = threading.Lock()

    def check(self, ids: Sequence[int], objs: Sequence[MemoryObj | None]) -> list[int]:
        """Count and release the read objects; return the ids served."""
        served = []
        for i, obj in zip(ids, objs, strict=True):
            if obj is None:
                with self.lock:
                    self.misses += 1
                continue
            assert obj.tensor is not None
            got = obj.tensor.view(torch.uint8)
            want = chunk(i).view(torch.uint8)
            wrong = int((got != want).sum())
            obj.ref_count_down()
            with self.lock:
                self.hits += 1
                self.wrong_bytes += wrong
            served.append(i)
        return served


def read_all(
    tier: Tier, ids: Sequence[int], chunks: Chunks, verdict: Verdict
) -> set[int]:
    """Read ``ids`` in batches, check every chunk; the ids served."""
    served: set[int] = set()
    for start in range(0, len(ids), 32):
        batch = list(ids[start : start + 32])
        served.update(
            verdict.check(batch, tier.read([key(i) for i in batch], chunks.allocate))
        )
    return served


# ------------------------------------------------------------------ kill -9


def crash_child(paths: list[str], first: int, slots: int, fsync: bool) -> None:
    """Put keys first, first + 1, ... through TieredCache until killed.

    Prints ``A <id>`` once a put is acknowledged (LMCache's completion
    callback: payload and header written) and ``E <ids>`` when capacity
    evicts keys, before their slots are overwritten.
    """
    config = tiered_config(
        paths, fsync=fsync, **{"warm.capacity_gb": slots * SLOT_BYTES / 2**30}
    )
    chunks = Chunks(64 << 20)
    cache = open_cache(config, chunks)
    on_evict = cache.warm.on_evict
    assert on_evict is not None

    def evicted(keys: list[CacheEngineKey]) -> None:
        print("E", *(k.chunk_hash for k in keys), flush=True)
        on_evict(keys)

    cache.warm.on_evict = evicted
    next_id = first
    while True:
        objs = [o for o in (chunks.make(i) for i in range(next_id, next_id + 8)) if o]
        if not objs:
            time.sleep(0.001)
            continue
        ids = range(next_id, next_id + len(objs))
        cache.put(
            [key(i) for i in ids],
            objs,
            lambda k: print("A", k.chunk_hash, flush=True),
        )
        for obj in objs:
            obj.ref_count_down()
        next_id += len(objs)


def run_until_killed(args: list[str], acks: int) -> tuple[set[int], set[int]]:
    """Start the crash child, SIGKILL it after ``acks`` acknowledged puts;
    return (acknowledged, evicted) as it reported them before it died."""
    with tempfile.TemporaryFile() as log:
        child = subprocess.Popen(
            [sys.executable, __file__, "crash-child", *args],
            stdout=subprocess.PIPE,
            stderr=log,
        )
        assert child.stdout is not None
        acked: set[int] = set()
        evicted: set[int] = set()

        def take(line: bytes) -> None:
            if not line.endswith(b"\n"):
                return  # cut by the kill: never counted
            tag, *ids = line.split()
            (acked if tag == b"A" else evicted).update(int(i) for i in ids)

        deadline = time.monotonic() + 60
        while len(acked) < acks and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            take(line)
        child.send_signal(signal.SIGKILL)
        # through the same buffered reader: communicate() would skip the
        # lines readline() has already buffered
        for line in child.stdout.read().splitlines(keepends=True):
            take(line)
        child.stdout.close()
        child.wait(timeout=30)
        log.seek(0)
        why = log.read().decode(errors="replace")[-2000:]
    assert child.returncode == -signal.SIGKILL, why
    assert len(acked) >= acks, why
    return acked, evicted


def test_kill_9_during_writes_loses_only_unacknowledged_puts(
    device_dirs: list[Path],
) -> None:
    """Three rounds: a child puts chunks as fast as it can and is SIGKILLed at
    a random moment; the restarted tier serves every acknowledged put not
    evicted by capacity, and every chunk it serves is byte-exact. The tier
    holds 96 slots, so slots are reused under the writes (a kill can tear a
    payload whose slot still has an older record's header: the CRC check on
    first read after restart must catch it). The last round fsyncs."""
    paths = [str(d) for d in device_dirs]
    rng = random.Random(5)
    slots, first = 96, 0
    totals = dict.fromkeys(["acked", "served", "torn_caught", "unacked_served"], 0)
    verdict = Verdict()
    chunks = Chunks()
    for fsync in (False, False, True):
        acked, evicted = run_until_killed(
            [",".join(paths), str(first), str(slots), str(int(fsync))],
            acks=rng.randint(60, 400),
        )
        tier = open_tier(paths, slots)
        try:
            stored = sorted(k.chunk_hash for k in tier.stored_keys())
            ids = sorted(set(stored) | acked)
            served = read_all(tier, ids, chunks, verdict)
            totals["torn_caught"] += tier.stats.corrupt
        finally:
            tier.close()
        lost = acked - evicted - served
        assert not lost, f"acknowledged puts lost after kill -9: {sorted(lost)[:10]}"
        totals["acked"] += len(acked)
        totals["served"] += len(served)
        totals["unacked_served"] += len(served - acked)
        first = max(ids) + 1
    assert verdict.wrong_bytes == 0
    figures(
        "kill-9",
        rounds=3,
        puts_acknowledged=totals["acked"],
        chunks_served_after_restart=totals["served"],
        unacknowledged_served_whole=totals["unacked_served"],
        torn_records_caught=totals["torn_caught"],
        wrong_bytes=verdict.wrong_bytes,
        acknowledged_lost=0,
    )


def test_torn_payload_in_a_reused_slot_is_caught(device_dirs: list[Path]) -> None:
    """The crash the kill test can only hit by chance, made certain: a full
    tier evicts its LRU chunk and writes key 9's payload into its slot, then
    "dies" before key 9's header is written. After the restart the victim's
    header still points at that slot: a miss (checksum), counted and
    dropped; the rest serves."""
    chunks = Chunks()
    tier = open_tier(device_dirs, 4)
    assert chunks.store(tier, range(4)) == [True] * 4
    victim = tier.victims(1)[0].chunk_hash
    calls = []

    class DieBeforeHeaders(FailingDevice):
        def submit(self, requests: Sequence[IORequest], write: bool) -> Any:
            calls.append(len(requests))
            if len(calls) == 1:
                return self.inner.submit(requests, write)  # the payloads
            raise SystemExit("killed between payload and header")

    tier.engine = DieBeforeHeaders(tier.engine)
    with pytest.raises(SystemExit):
        chunks.store(tier, [9])
    tier.close()
    tier = open_tier(device_dirs, 4)
    try:
        verdict = Verdict()
        served = read_all(tier, [0, 1, 2, 3, 9], chunks, verdict)
        assert served == {0, 1, 2, 3} - {victim}
        assert tier.stats.corrupt == 1 and not tier.contains(key(victim))
        assert chunks.store(tier, [5]) == [True]
    finally:
        tier.close()
    assert verdict.wrong_bytes == 0
    figures("torn-slot", reads=5, misses=verdict.misses, wrong_bytes=0, lost=1)


# -------------------------------------------------------------- corruption


def _header_path(paths: Sequence[Path]) -> Path:
    return paths[0] / "kv-w0.hdr"


def _slot_of(tier: Tier, i: int) -> int:
    entry = tier.index.get(key(i))
    assert entry is not None
    return entry.slot


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _old_version(block: bytes) -> bytes:
    """The same record as written by format version 0, sealed with a valid
    checksum: only the version check can refuse it."""
    fixed = layout._RECORD.unpack_from(block)
    end = layout._RECORD.size + 8 * fixed[8] + fixed[9] + fixed[10]
    body = bytearray(block[:end])
    body[8:10] = (0).to_bytes(2, "little")
    return bytes(body) + layout._CRC.pack(zlib.crc32(body))


def flip_payload(paths: list[Path], tier: Tier) -> set[int]:
    extent = tier.geometry.extents(_slot_of(tier, 1), CHUNK_BYTES)[0]
    slab = paths[extent.device] / "kv-w0.slab"
    with open(slab, "r+b") as f:
        f.seek(extent.offset + 7)
        byte = f.read(1)[0]
    _patch(slab, extent.offset + 7, bytes([byte ^ 0x40]))
    return {1}


def flip_header(paths: list[Path], tier: Tier) -> set[int]:
    offset = layout.Geometry.header_offset(_slot_of(tier, 2))
    _patch(_header_path(paths), offset + 70, b"\x00\x13")
    return {2}


def older_record_version(paths: list[Path], tier: Tier) -> set[int]:
    offset = layout.Geometry.header_offset(_slot_of(tier, 3))
    with open(_header_path(paths), "rb") as f:
        f.seek(offset)
        block = f.read(layout.HEADER_SIZE)
    _patch(_header_path(paths), offset, _old_version(block))
    return {3}


def truncated_header_file(paths: list[Path], tier: Tier) -> set[int]:
    cut = {i for i in range(6) if _slot_of(tier, i) >= 4}
    os.truncate(_header_path(paths), layout.Geometry.header_offset(4) + 100)
    return cut


def short_slab(paths: list[Path], tier: Tier) -> set[int]:
    cut = {i for i in range(6) if _slot_of(tier, i) >= 3}
    os.truncate(paths[1] / "kv-w0.slab", 3 * tier.geometry.per_device + 4096)
    return cut


def older_superblock(paths: list[Path], tier: Tier) -> set[int]:
    body = bytearray(tier.geometry.encode_superblock()[: layout._SUPER.size])
    body[8:10] = (0).to_bytes(2, "little")
    _patch(_header_path(paths), 0, bytes(body) + layout._CRC.pack(zlib.crc32(body)))
    return set(range(6))


@pytest.mark.parametrize(
    "damage",
    [
        flip_payload,
        flip_header,
        older_record_version,
        truncated_header_file,
        short_slab,
        older_superblock,
    ],
)
def test_damaged_records_are_counted_misses_and_the_rest_serves(
    device_dirs: list[Path],
    damage: Callable[[list[Path], Tier], set[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each damage, done while the tier is closed: the damaged records are
    misses (counted as corrupt, or the whole tier starts empty for a
    superblock of another format), the rest is served exact, and the tier
    takes new writes into the freed slots."""
    chunks = Chunks()
    tier = open_tier(device_dirs, 16)
    chunks.store(tier, range(6))
    bad = damage(device_dirs, tier)
    tier.close()
    verdict = Verdict()
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        tier = open_tier(device_dirs, 16)
        try:
            served = read_all(tier, list(range(6)), chunks, verdict)
            assert served == set(range(6)) - bad
            assert not any(tier.contains(key(i)) for i in bad)  # dropped
            summaries = [
                r.getMessage()
                for r in caplog.records
                if "dropped at start-up" in r.getMessage()
            ]
            if damage is older_superblock:
                # the version it found, not "another layout (None, ...)"
                assert "(format version 0; this release writes" in caplog.text
                assert "None" not in caplog.text
            elif damage is flip_payload:
                assert summaries == []  # found when read, by its checksum
                assert tier.stats.corrupt == len(bad)
            else:
                # one line: what was dropped, and how to look at it
                assert len(summaries) == 1, summaries
                assert "`lmcache-tiered fsck " in summaries[0]
                # a cut header file: one cut header counted, the rest is gone
                cut = damage is truncated_header_file
                assert tier.stats.corrupt == (1 if cut else len(bad))
            assert chunks.store(tier, sorted(bad)) == [True] * len(bad)
            assert read_all(tier, sorted(bad), chunks, verdict) == bad
        finally:
            tier.close()
    assert verdict.wrong_bytes == 0
    figures(
        f"corruption-{damage.__name__}",
        reads=verdict.hits + verdict.misses,
        misses=verdict.misses,
        wrong_bytes=0,
        lost=len(bad),
    )


# --------------------------------------------------------------- full disk


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB ext4 file system on a loop device (tmpfs refuses O_DIRECT)."""
    image, mount_point = tmp_path / "fs.img", tmp_path / "small"
    mount_point.mkdir()
    with open(image, "wb") as f:
        f.truncate(24 << 20)
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True
    )
    mounted = made.returncode == 0 and (
        subprocess.run(
            ["mount", "-o", "loop", str(image), str(mount_point)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("cannot mount a loop ext4 image here (needs root and loop devices)")
    try:
        yield mount_point
    finally:
        # a closed io_uring ring lets go of its files a moment later
        for _ in range(50):
            if subprocess.run(["umount", str(mount_point)]).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_full_disk_stops_growth_evicts_and_keeps_serving(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tier whose capacity (1 GiB) is far beyond its 24 MiB file system:
    growth stops at ENOSPC with one warning, later puts evict the oldest
    chunks, reads stay exact, and the accounting matches the files."""
    dirs = [small_fs / "a", small_fs / "b"]
    for d in dirs:
        d.mkdir()
    chunks = Chunks()
    verdict = Verdict()
    puts = dropped = 0
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        tier = open_tier(dirs, (1 << 30) // SLOT_BYTES)
        try:
            for start in range(0, 800, 8):
                stored = chunks.store(tier, range(start, start + 8))
                puts += len(stored)
                dropped += stored.count(False)
            newest = list(range(800 - len(tier) // 2, 800))
            assert read_all(tier, newest, chunks, verdict) == set(newest)
            assert tier.max_slots < 800 and len(tier) <= tier.max_slots
            assert tier.stats.evictions == 800 - len(tier) - dropped
            disk = sum(os.path.getsize(d / "kv-w0.slab") for d in dirs)
            disk += os.path.getsize(dirs[0] / "kv-w0.hdr") - 4096
            assert disk <= tier.used_bytes <= shutil.disk_usage(small_fs).total
        finally:
            tier.close()
    assert caplog.text.count("cannot grow past") == 1
    assert verdict.wrong_bytes == 0
    figures(
        "full-disk",
        puts=puts,
        dropped_cleanly=dropped,
        evicted=tier.stats.evictions,
        slots=tier.max_slots,
        reads=verdict.hits,
        wrong_bytes=0,
    )


# ------------------------------------------------------- a device fails


class FailingDevice(IOEngine):
    """A mock of a failing device (no dm-error/dm-flakey in this container):
    wraps a tier's real engine and fails every request with EIO while
    ``failing`` is set."""

    name = "failing-device"

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner.fds, inner.queue_depth)
        self.inner = inner
        self.failing = True

    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        if not self.failing:
            return self.inner.submit(requests, write)
        failed: Future[list[int]] = Future()
        failed.set_result([-errno.EIO] * len(requests))
        return failed

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def fast_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "PROBE_S", 0.05)


def degraded_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " degraded: " in r.getMessage()]


def test_io_errors_degrade_the_tier_then_it_recovers(
    device_dirs: list[Path], fast_probe: None, caplog: pytest.LogCaptureFixture
) -> None:
    """EIO on every request: reads are misses and writes drops, never an
    exception; after DEGRADE_AFTER failures one log line marks the tier
    degraded; once the device answers again the probe brings it back with
    its index, and every chunk is still exact."""
    chunks = Chunks()
    verdict = Verdict()
    tier = open_tier(device_dirs, 32)
    try:
        chunks.store(tier, range(8))
        device = FailingDevice(tier.engine)
        tier.engine = device
        with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
            reads = 0
            for i in range(8):
                assert verdict.check([i], tier.read([key(i)], chunks.allocate)) == []
                reads += 1
            assert tier.degraded is not None and not tier.contains(key(0))
            assert chunks.store(tier, [20]) == [False]
            assert len(degraded_lines(caplog)) == 1
            assert "Input/output error" in degraded_lines(caplog)[0]
            time.sleep(0.2)
            assert tier.degraded is not None  # probes fail while the device does
            device.failing = False
            wait_until(lambda: tier.degraded is None)
        assert "recovered" in caplog.text
        assert read_all(tier, list(range(8)), chunks, verdict) == set(range(8))
        assert chunks.store(tier, [20]) == [True]
    finally:
        tier.close()
    assert verdict.wrong_bytes == 0
    figures(
        "io-errors",
        reads_while_failing=reads,
        failed_cleanly=reads + 1,
        reads_after_recovery=8,
        wrong_bytes=0,
        lost=0,
    )


def test_write_path_errors_are_never_acknowledged(
    device_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fdatasync failing (tiered.fsync) fails its whole batch: nothing unsynced
    is acknowledged. Preallocation failing with EIO drops the put but, unlike
    ENOSPC, does not shrink the tier for good."""
    chunks = Chunks()
    verdict = Verdict()
    tier = open_tier(device_dirs, 200, fsync=True)
    try:

        def broken(*_: object) -> None:
            raise OSError(errno.EIO, "Input/output error")

        with monkeypatch.context() as patch:
            patch.setattr(os, "fdatasync", broken)
            assert chunks.store(tier, [0, 1]) == [False, False]
        assert chunks.store(tier, range(64)) == [True] * 64  # one group of slots
        with monkeypatch.context() as patch:
            patch.setattr(os, "posix_fallocate", broken)
            assert chunks.store(tier, [64]) == [False]
        assert tier.max_slots == 200 and tier.degraded is None
        assert chunks.store(tier, [64]) == [True]
        assert read_all(tier, list(range(65)), chunks, verdict) == set(range(65))
    finally:
        tier.close()
    assert verdict.wrong_bytes == 0
    figures("write-errors", puts=68, failed_cleanly=3, wrong_bytes=0, lost=0)


def test_removed_directory_degrades_and_recovers_when_the_path_returns(
    device_dirs: list[Path], fast_probe: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The tier's directory is removed under it: the next operation after a
    check finds its files gone and degrades the tier (one line). A path
    back but unusable (a plain file) keeps it degraded; a directory back
    reopens it, empty, and it takes writes again. Root ignores permission
    bits, so "permission lost" is simulated with the unusable path."""
    chunks = Chunks()
    verdict = Verdict()
    tier = open_tier(device_dirs, 32)
    try:
        chunks.store(tier, range(4))
        with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
            shutil.rmtree(device_dirs[1])
            time.sleep(0.06)
            assert read_all(tier, list(range(4)), chunks, verdict) == set()
            assert tier.degraded is not None and "removed" in tier.degraded
            assert len(degraded_lines(caplog)) == 1
            device_dirs[1].write_text("not a directory")
            time.sleep(0.2)
            assert tier.degraded is not None
            device_dirs[1].unlink()
            device_dirs[1].mkdir()
            wait_until(lambda: tier.degraded is None)
        assert len(tier) == 0  # a slab is gone: its records cannot be served
        assert chunks.store(tier, [9]) == [True]
        assert read_all(tier, [9], chunks, verdict) == {9}
    finally:
        tier.close()
    restarted = open_tier(device_dirs, 32)
    try:
        assert read_all(restarted, [9], chunks, verdict) == {9}
    finally:
        restarted.close()
    assert verdict.wrong_bytes == 0
    figures(
        "directory-removed",
        reads=verdict.hits + verdict.misses,
        failed_cleanly=verdict.misses,
        wrong_bytes=0,
        lost=4,
    )


def test_warm_device_fails_cold_serves_the_engine(
    engine_factory: EngineFactory,
    device_dirs: list[Path],
    tmp_path: Path,
    fast_probe: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real LMCache engine with warm and cold (write-through): the warm
    device fails with EIO; retrieves still return every token exact, from
    cold, with no exception; warm logs one degraded line and comes back."""
    cold = tmp_path / "cold"
    cold.mkdir()
    extra = plugin_extra_config(
        device_dirs, **{"cold.paths": [str(cold)], "cold.write": "through"}
    )
    engine, connector = engine_factory(extra)
    cache = cache_of(engine)
    tokens = testing.make_tokens(1024, seed=3)
    kv = testing.make_kv(connector, 1024, seed=4)
    testing.store_tokens(engine, tokens, kv)
    cache.flush()
    device = FailingDevice(cache.warm.engine)
    cache.warm.engine = device
    retrieved = 0
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        for _ in range(3):
            cache.flush()  # the cold hits' copies to warm hold CPU objects
            assert testing.clear_cpu_tier(engine) == 0
            out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
            assert int(mask.sum()) == 1024 and torch.equal(out, kv)
            retrieved += 1
        assert cache.warm.degraded is not None
        assert cache.tiers["cold"].stats.hits == 12
        assert len(degraded_lines(caplog)) == 1
        device.failing = False
        wait_until(lambda: cache.warm.degraded is None)
    testing.clear_cpu_tier(engine)
    hits = cache.warm.stats.hits
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 1024 and torch.equal(out, kv)
    assert cache.warm.stats.hits == hits + 4
    figures(
        "warm-device-lost",
        retrieves=retrieved + 1,
        served_from_cold=cache.tiers["cold"].stats.hits,
        failed=0,
        wrong_bytes=0,
        lost=0,
    )


# -------------------------------------------------------- io_uring refused


def test_io_uring_unavailable_falls_back_and_serves_the_same_data(
    device_dirs: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Chunks written through io_uring are served by the thread pool when
    io_uring is refused (seccomp, as reported by the probe), with
    a log line that says why; ``io_engine: uring`` then fails loudly."""
    import lmcache_tiered.io as io_pkg
    from lmcache_tiered.io import probe

    chunks = Chunks()
    tier = open_tier(device_dirs, 16, io_engine="uring")
    chunks.store(tier, range(6))
    tier.close()
    monkeypatch.setattr(
        probe, "uring_verdict", lambda: (False, "io_uring_setup failed (EPERM)")
    )
    monkeypatch.setattr(io_pkg, "_fallback_reported", False)
    verdict = Verdict()
    with caplog.at_level(logging.INFO, logger="lmcache_tiered"):
        tier = open_tier(device_dirs, 16, io_engine="auto")
    try:
        assert tier.engine.name == "threads"
        assert "io_uring unusable: io_uring_setup failed (EPERM)" in caplog.text
        assert read_all(tier, list(range(6)), chunks, verdict) == set(range(6))
    finally:
        tier.close()
    with pytest.raises(RuntimeError, match="tiered.io_engine: threads"):
        open_tier(device_dirs, 16, io_engine="uring")
    assert verdict.wrong_bytes == 0
    figures("no-io-uring", reads=6, wrong_bytes=0, lost=0)


# ------------------------------------------------------- memory pressure


@pytest.mark.parametrize("async_loading", [False, True], ids=["sync", "async"])
def test_full_cpu_pool_is_a_miss_not_a_hang(
    engine_factory: EngineFactory, device_dirs: list[Path], async_loading: bool
) -> None:
    """Every byte of LMCache's CPU pool held (allocate returns None): a
    retrieve of chunks on disk is a quick miss, with no busy loop; once
    memory is free again the same retrieve is a full, exact hit."""
    engine, connector = engine_factory(
        plugin_extra_config(device_dirs),
        async_loading=async_loading,
        max_local_cpu_size_gb=4 / 1024,
    )
    cache = cache_of(engine)
    tokens = testing.make_tokens(1024, seed=7)
    kv = testing.make_kv(connector, 1024, seed=8)
    testing.store_tokens(engine, tokens, kv)
    testing.wait_for_puts(engine, tokens)
    testing.clear_cpu_tier(engine)
    cpu = testing.get_local_cpu_backend(engine)
    assert cpu is not None
    held = []
    shape = testing.kv_chunk_shape(256)
    while (obj := cpu.allocate(shape, torch.bfloat16, busy_loop=False)) is not None:
        held.append(obj)
    assert held

    def retrieve(lookup_id: str) -> int:
        if async_loading:
            hit = testing.async_lookup(engine, tokens, lookup_id)
            if not hit:
                testing.release_async_lookup(engine, lookup_id)
                return 0
            _, mask = testing.retrieve_tokens(
                engine, tokens, connector=connector, req_id=lookup_id
            )
            testing.release_async_lookup(engine, lookup_id)
        else:
            _, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
        return int(mask.sum())

    wall, cpu_time = time.monotonic(), time.process_time()
    assert retrieve("starved") == 0
    wall, cpu_time = time.monotonic() - wall, time.process_time() - cpu_time
    assert wall < 5 and cpu_time < 2, (wall, cpu_time)
    misses = cache.warm.stats.misses
    assert misses >= 1
    for obj in held:
        obj.ref_count_down()
    out_kv = testing.make_kv(connector, 1024, seed=None)
    if async_loading:
        assert testing.async_lookup(engine, tokens, "fed") == 1024
        out, mask = testing.retrieve_tokens(engine, tokens, kv=out_kv, req_id="fed")
        testing.release_async_lookup(engine, "fed")
    else:
        out, mask = testing.retrieve_tokens(engine, tokens, kv=out_kv)
    assert int(mask.sum()) == 1024 and torch.equal(out, kv)
    figures(
        f"cpu-pool-full-{'async' if async_loading else 'sync'}",
        retrieves=2,
        failed_cleanly=1,
        seconds_starved=round(wall, 3),
        wrong_bytes=0,
        lost=0,
    )


# -------------------------------------------------------------- overload


SOAK_S = float(os.environ.get("LMCACHE_TIERED_SOAK_S", "15"))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_overload_soak(device_dirs: list[Path], tmp_path: Path) -> None:
    """Threads put, read, pin and remove chains of 4 chunks over 96 keys for
    LMCACHE_TIERED_SOAK_S seconds (15 in CI) against a warm tier of 12 slots
    demoting to a cold one of 24: constant eviction, demotion and promotion.
    Every read is checked; no thread may hang; descriptors stay the same and
    RSS flat after the warm-up third; every MemoryObj is freed at the end.
    RSS before the cache opens, after the warm-up third and at the end are
    reported (``pytest -s``)."""
    rss_start = _rss_bytes()
    cold = tmp_path / "cold"
    cold.mkdir()
    config = tiered_config(
        device_dirs,
        **{
            "warm.capacity_gb": 12 * SLOT_BYTES / 2**30,
            "cold.paths": [str(cold)],
            "cold.capacity_gb": 24 * (CHUNK_BYTES + 4096) / 2**30,
        },
    )
    chunks = Chunks(64 << 20)
    cache = open_cache(config, chunks)
    verdict = Verdict()
    counts = dict.fromkeys(["puts", "acked", "no_memory", "pins", "removes"], 0)
    count_lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def bump(name: str, n: int = 1) -> None:
        with count_lock:
            counts[name] += n

    def chain(rng: random.Random) -> list[int]:
        start = rng.randrange(0, 96, 4)
        return list(range(start, start + 4))

    def putter(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            ids = chain(rng)
            objs = [chunks.make(i) for i in ids]
            if None in objs:
                bump("no_memory")
                for obj in objs:
                    if obj is not None:
                        obj.ref_count_down()
                time.sleep(0.001)
                continue
            cache.put(
                [key(i) for i in ids],
                [o for o in objs if o is not None],
                lambda _k: bump("acked"),
            )
            for obj in objs:
                assert obj is not None
                obj.ref_count_down()
            bump("puts", len(ids))

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            ids = chain(rng)
            verdict.check(ids, cache.read([key(i) for i in ids]))

    def pinner(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            keys = [key(i) for i in chain(rng)]
            hits = cache.prefix_hits(keys, pin=True)
            time.sleep(0.002)
            for k in keys[:hits]:
                cache.unpin(k)
            bump("pins", hits)

    def remover(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            bump("removes", cache.remove(key(rng.randrange(96))))
            time.sleep(0.005)

    def guarded(work: Callable[[int], None], seed: int) -> None:
        try:
            work(seed)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    workers = [putter, putter, reader, reader, pinner, remover]
    threads = [
        threading.Thread(target=guarded, args=(w, n), daemon=True)
        for n, w in enumerate(workers)
    ]
    try:
        for thread in threads:
            thread.start()
        time.sleep(SOAK_S / 3)
        fds, rss = _open_fds(), _rss_bytes()
        time.sleep(SOAK_S * 2 / 3)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        assert not [t for t in threads if t.is_alive()], "a worker hung"
        assert not errors, errors
        cache.flush()
        fds_end, rss_end = _open_fds(), _rss_bytes()
    finally:
        stop.set()
        cache.close()
    assert verdict.wrong_bytes == 0 and verdict.hits > 0
    assert fds_end == fds
    assert rss_end - rss < 48 << 20, (rss, rss_end)
    assert chunks.allocator.pin_allocator.num_active_allocations == 0
    snap = cache.snapshot()["tiers"]
    figures(
        "overload-soak",
        seconds=int(SOAK_S),
        puts=counts["puts"],
        acked=counts["acked"],
        puts_without_memory=counts["no_memory"],
        reads=verdict.hits + verdict.misses,
        hits=verdict.hits,
        pins=counts["pins"],
        removes=counts["removes"],
        evictions=snap["warm"]["evictions"] + snap["cold"]["evictions"],
        wrong_bytes=verdict.wrong_bytes,
        rss_start_mib=rss_start >> 20,
        rss_warm_mib=rss >> 20,
        rss_end_mib=rss_end >> 20,
        rss_growth_kib=(rss_end - rss) >> 10,
        fd_growth=fds_end - fds,
    )


# ---------------------------------------------------------- hostile input


def seal(
    dims: Sequence[int],
    size: int,
    *,
    dtype: bytes = b"uint8",
    text: str = f"{MODEL}@1@0@7@bfloat16",
    version: int = layout.FORMAT_VERSION,
    digest: bytes | None = None,
) -> bytes:
    """A header block with any field values and a valid checksum: what a
    hostile writer can put on disk (the checksum only stops accidents)."""
    text_bytes = text.encode()
    if digest is None:
        digest = hashlib.blake2b(text_bytes, digest_size=16).digest()
    body = (
        layout._RECORD.pack(
            layout.RECORD_MAGIC,
            version,
            MemoryFormat.KV_2LTD.value,
            size,
            0,
            1,
            0,
            digest,
            len(dims),
            len(dtype),
            len(text_bytes),
        )
        + struct.pack(f"<{len(dims)}Q", *dims)
        + dtype
        + text_bytes
    )
    return (body + layout._CRC.pack(zlib.crc32(body))).ljust(layout.HEADER_SIZE, b"\0")


def test_crafted_headers_are_refused_before_any_allocation(
    device_dirs: list[Path],
) -> None:
    """Headers with valid checksums claiming a huge payload, a shape whose
    element count wraps around 64 bits, or dimensions past int64: each is
    counted corrupt at start-up and never reaches the allocator."""
    open_tier(device_dirs, 16).close()
    crafted = [
        seal([1 << 31, 1 << 31], 1 << 62),
        seal([1 << 62, 4], 0),  # numel() wraps to 0 == size
        seal([(1 << 64) - 1], CHUNK_BYTES),
        seal([0, 1 << 63], 0),  # a zero dimension hides one past int64
        seal([CHUNK_BYTES], CHUNK_BYTES, dtype=b"complex128"),
        seal([CHUNK_BYTES], CHUNK_BYTES, text="no@key"),
    ]
    with open(_header_path(device_dirs), "r+b") as f:
        for slot, block in enumerate(crafted):
            f.seek(layout.Geometry.header_offset(slot))
            f.write(block)
    asked: list[RecordHeader] = []
    tier = open_tier(device_dirs, 16)
    try:
        assert len(tier) == 0 and tier.stats.corrupt == len(crafted)
        tier.read([key(7)], lambda h: asked.append(h))  # type: ignore[func-returns-value]
        assert asked == []
    finally:
        tier.close()
    figures("crafted-headers", headers=len(crafted), refused=len(crafted), allocated=0)


def test_keys_never_become_paths(device_dirs: list[Path], tmp_path: Path) -> None:
    """A model name full of path syntax is data in a header, never a file name."""
    evil = CacheEngineKey("../../../evil/..", 1, 0, 1, torch.bfloat16, None)
    chunks = Chunks()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    tier = open_tier(device_dirs, 8)
    obj = chunks.make(1)
    assert obj is not None
    try:
        assert tier.write([(evil, obj)]) == [True]
        (got,) = tier.read([evil], chunks.allocate)
        assert got is not None and torch.equal(got.tensor, chunk(1))
        got.ref_count_down()
    finally:
        obj.ref_count_down()
        tier.close()
    created = sorted(p.name for p in tmp_path.rglob("*"))
    assert set(created) - set(before) == {"kv-w0.slab", "kv-w0.hdr", "kv-w0.lock"}


def test_planted_symlink_is_refused(device_dirs: list[Path], tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (device_dirs[1] / "kv-w0.slab").symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        open_tier(device_dirs, 8)
    assert target.read_bytes() == b"precious"


def test_files_get_the_configured_mode_whatever_the_umask(
    device_dirs: list[Path],
) -> None:
    old = os.umask(0)
    try:
        open_tier(device_dirs, 8).close()
        names = [*(d / "kv-w0.slab" for d in device_dirs), device_dirs[0] / "kv-w0.hdr"]
        assert {oct(p.stat().st_mode & 0o777) for p in names} == {"0o600"}
        os.umask(0o077)
        open_tier(device_dirs, 8, file_mode="0660").close()  # a group-shared tier
        assert {oct(p.stat().st_mode & 0o777) for p in names} == {"0o660"}
    finally:
        os.umask(old)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user needs root"
)


@pytest.mark.parametrize(
    "exposure", ["world-writable", pytest.param("other-owner", marks=needs_root)]
)
def test_exposed_directory_gets_a_warning(
    device_dirs: list[Path], exposure: str, caplog: pytest.LogCaptureFixture
) -> None:
    if exposure == "world-writable":
        device_dirs[1].chmod(0o777)
        expected = "writable by every user"
    else:
        os.chown(device_dirs[1], 65534, 65534)
        expected = "owned by uid 65534"
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        open_tier(device_dirs, 8).close()
    assert f"{device_dirs[1]} is {expected}" in caplog.text
    assert "another user could plant data" in caplog.text


@needs_root
def test_data_file_of_another_user_gets_a_warning(
    device_dirs: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    open_tier(device_dirs, 8).close()
    os.chown(device_dirs[0] / "kv-w0.hdr", 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        open_tier(device_dirs, 8).close()
    assert "kv-w0.hdr is owned by uid 65534" in caplog.text


@settings(max_examples=400, deadline=None)
@given(
    dims=st.lists(st.integers(0, (1 << 64) - 1), max_size=9),
    size=st.integers(0, (1 << 64) - 1),
    dtype=st.sampled_from([b"bfloat16", b"uint8", b"float32", b"bogus", b""]),
    text=st.one_of(
        st.just(f"{MODEL}@1@0@7@bfloat16"),
        st.text(max_size=60),
        st.from_regex(r"[a-z/.]{0,8}@-?[0-9]{1,3}@[0-9]{1,3}@[0-9a-f]{0,9}@\w{0,9}"),
    ),
    version=st.integers(0, 3),
)
def test_sealed_headers_with_any_fields_parse_or_are_refused(
    dims: list[int], size: int, dtype: bytes, text: str, version: int
) -> None:
    """Any field values behind a valid checksum: a RecordHeader whose sizes
    agree and fit the slot, or CorruptRecord; never another exception."""
    try:
        block = seal(dims, size, dtype=dtype, text=text, version=version)
    except (struct.error, ValueError):
        return  # cannot be written into one header block at all
    try:
        header = RecordHeader.decode(block, CHUNK_BYTES)
    except layout.CorruptRecord:
        return
    assert header.payload_size <= CHUNK_BYTES
    assert header.shape.numel() * header.dtype.itemsize == header.payload_size


_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["0", "-1", "1e-9", "0o777", "0777", "4", "65536", "true"]),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=400, deadline=None)
@given(
    values=st.dictionaries(
        st.sampled_from(sorted(k for k in SETTINGS if not k.endswith("paths"))),
        _ANY_VALUE,
        max_size=4,
    )
)
def test_any_value_of_any_setting_is_a_config_or_a_clear_error(
    values: dict[str, Any],
) -> None:
    """Every known key with hostile values (the existing fuzz rarely hits a
    real key): a ConfigError naming the key, or a config a tier can plan."""
    extra: dict[str, Any] = {"tiered.warm.paths": tempfile.gettempdir()}
    extra.update({f"tiered.{k}": v for k, v in values.items()})
    try:
        config = TieredConfig.from_extra_config(extra)
    except ConfigError as exc:
        assert str(exc).startswith("tiered.")
        return
    assert config.queue_depth >= 1 and config.stripe_bytes % 4096 == 0
    assert 0 <= config.file_mode <= 0o777 and -1 <= config.hint_port <= 65535
    assert config.slot_bytes is None or config.slot_bytes >= 4096
    payload = layout.align_up(config.slot_bytes or 4096)
    assert layout.Geometry.plan(2, config.stripe_bytes, payload).is_sane()


if __name__ == "__main__" and sys.argv[1] == "crash-child":
    paths_arg, first_arg, slots_arg, fsync_arg = sys.argv[2:6]
    crash_child(paths_arg.split(","), int(first_arg), int(slots_arg), fsync_arg == "1")


def test_a_part_that_fails_to_close_does_not_keep_the_others_open(
    device_dirs: list[Path], cold_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Warm's close raising (as a descriptor someone else closed makes it):
    logged with the part named, and cold is closed all the same (a store
    tier left open keeps probing its store for good)."""
    config = tiered_config(device_dirs, **{"cold.paths": [str(cold_dir)]})
    cache = open_cache(config, Chunks())
    cold = cache.tiers["cold"]
    assert isinstance(cold, Tier) and cold.files.fds
    warm_close = cache.warm.close

    def failing_close() -> None:
        warm_close()
        raise OSError(errno.EBADF, "Bad file descriptor")

    cache.warm.close = failing_close  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="lmcache_tiered"):
        cache.close()
    assert "closing tier warm failed" in caplog.text
    assert cold.files.fds == []  # closed after warm's failure


def closes_in_time(close: Callable[[], None], stuck: str) -> None:
    """``close`` returns within 3 s although ``stuck`` still hangs."""
    started = time.monotonic()
    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(5)
    assert not closer.is_alive(), f"close() waits for {stuck}"
    assert time.monotonic() - started < 3


def test_close_while_a_promotion_is_stuck_on_a_hung_drive_is_bounded(
    device_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up thread stuck in a promotion's I/O (a stand-in: the
    promoter's before_unit hook blocks, as a read on a hung drive would)
    held the cache's close forever; the promoter gives up after
    CLOSE_WAIT_S."""
    monkeypatch.setattr(io_base, "CLOSE_WAIT_S", 0.3, raising=False)
    cache = open_cache(tiered_config(device_dirs), Chunks())
    entered, hung = threading.Event(), threading.Event()

    def stuck(target: str, keys: tuple[Any, ...]) -> None:
        entered.set()
        hung.wait(30)

    cache.promoter.before_unit = stuck
    try:
        cache.promoter.submit([Plan((key(1),), "warm", cache.now() + 60)])
        assert entered.wait(10)
        closes_in_time(cache.promoter.close, "a stuck promotion")
    finally:
        hung.set()
        cache.close()


class HeldDevice(IOEngine):
    """A stand-in for a hung drive: wraps a tier's real engine and holds every
    batch until ``release`` is set (then does it for real)."""

    name = "held-device"

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner.fds, inner.queue_depth)
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        self.entered.set()
        held: Future[list[int]] = Future()

        def later() -> None:
            self.release.wait(30)
            done = self.inner.submit(requests, write)
            done.add_done_callback(lambda f: held.set_result(f.result()))

        threading.Thread(target=later, daemon=True).start()
        return held

    def close(self) -> None:
        self.inner.close()


def test_close_while_a_demand_read_is_stuck_on_a_hung_drive_is_bounded(
    device_dirs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demand read spanning warm and cold reads cold on the reader's pool;
    with the cold drive hung, closing the reader waited for that pool read
    forever. It now gives up after CLOSE_WAIT_S."""
    monkeypatch.setattr(io_base, "CLOSE_WAIT_S", 0.3, raising=False)
    cold = tmp_path / "cold"
    cold.mkdir()
    chunks = Chunks()
    cache = open_cache(
        tiered_config(device_dirs, **{"cold.paths": [str(cold)]}), chunks
    )
    assert chunks.store(cache.tiers["warm"], [1]) == [True]
    assert chunks.store(cache.tiers["cold"], [2]) == [True]
    device = HeldDevice(cache.tiers["cold"].engine)
    cache.tiers["cold"].engine = device
    reader = threading.Thread(target=lambda: cache.read([key(1), key(2)]), daemon=True)
    reader.start()
    try:
        assert device.entered.wait(10)
        closes_in_time(cache.reader.close, "a stuck pool read")
    finally:
        device.release.set()
        reader.join(10)
        cache.close()
