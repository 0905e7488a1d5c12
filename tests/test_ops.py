"""Operator tools on real tier files: inspect, fsck (--repair), warmup."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import plugin_extra_config, random_kv
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from lmcache_tiered import testing
from lmcache_tiered.cli import main
from lmcache_tiered.config import TieredConfig
from lmcache_tiered.integration.backend import TieredBackend
from lmcache_tiered.keys import key_text
from lmcache_tiered.storage.layout import (
    FORMAT_VERSION,
    HEADER_SIZE,
    Geometry,
    RecordHeader,
    decode_header_blocks,
)
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.testing.lmcache import MixedMemoryAllocator

SHAPE = torch.Size([2, 2, 64, 128])  # 64 KiB of bf16
TierFactory = Callable[..., Tier]


def key(i: int, user: str | None = None) -> CacheEngineKey:
    tags = None if user is None else {"lmcache.tag.user": user}
    model = "llama" if user is None else "qwen"
    return CacheEngineKey(model, 1, 0, 100 + i, torch.bfloat16, tags)


def fill(
    tier: Tier, allocator: MixedMemoryAllocator, keys: list[CacheEngineKey]
) -> None:
    for k in keys:
        obj = allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
        assert obj is not None and obj.tensor is not None
        obj.tensor.copy_(random_kv(SHAPE, k.chunk_hash))
        assert tier.write([(k, obj)]) == [True]
        obj.ref_count_down()


def read_back(
    tier: Tier, allocator: MixedMemoryAllocator, keys: list[Any]
) -> list[bool]:
    """Per key: served and byte-exact."""

    def allocate(h: RecordHeader) -> MemoryObj | None:
        return allocator.allocate(h.shape, h.dtype, h.fmt)

    exact = []
    for k, obj in zip(keys, tier.read(keys, allocate), strict=True):
        exact.append(
            obj is not None and torch.equal(obj.tensor, random_kv(SHAPE, k.chunk_hash))
        )
        if obj is not None:
            obj.ref_count_down()
    return exact


def digest_files(*dirs: Path) -> dict[str, str]:
    """The data files' digests (a lock file holds the owner record, which
    every tier that opens the files rewrites: storage.ownership)."""
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for d in dirs
        for p in sorted(d.iterdir())
        if p.suffix != ".lock"
    }


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def stored(
    tier_factory: TierFactory, allocator: MixedMemoryAllocator
) -> Iterator[list[CacheEngineKey]]:
    """Six llama chunks and three qwen chunks of user u1, in a closed tier."""
    keys = [key(i) for i in range(6)] + [key(i, "u1") for i in range(6, 9)]
    tier = tier_factory()
    fill(tier, allocator, keys)
    tier.close()
    yield keys


def test_demo_makes_a_real_tier_the_tools_can_work_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``demo`` (issue 29, item 5) stores prompts through a real engine and
    leaves the files: inspect finds them, fsck finds them clean, and its
    printed commands name the drives it made."""
    code, out, _ = cli(
        capsys, "demo", str(tmp_path), "--prompts", "3", "--tokens", "512"
    )
    drives = [str(tmp_path / "drive0"), str(tmp_path / "drive1")]
    assert code == 0 and "1536 of 1536 tokens read back from disk exact" in out
    assert f"lmcache-tiered fsck {' '.join(drives)}" in out
    code, out, _ = cli(capsys, "inspect", *drives, "--json")
    (report,) = json.loads(out)["owners"]
    assert code == 0 and report["chunks"] == 6
    assert report["top_groups"][0]["group"] == "demo-model"
    code, out, _ = cli(capsys, "fsck", *drives)
    assert code == 0 and "0 problem(s)" in out


def test_inspect_of_an_empty_tier_says_so(
    device_dirs: list[Path],
    tier_factory: TierFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A tier that holds nothing yet reads "no records yet", not "oldest:
    None" (issue 29)."""
    tier_factory().close()
    code, out, _ = cli(capsys, "inspect", *[str(d) for d in device_dirs])
    assert code == 0 and "chunks: 0 " in out
    assert "no records yet" in out and "None" not in out


def test_inspect_summarises_without_touching_the_files(
    stored: list[CacheEngineKey],
    device_dirs: list[Path],
    tier_factory: TierFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    paths = [str(d) for d in device_dirs]
    before = digest_files(*device_dirs)
    code, out, _ = cli(capsys, "inspect", *paths, "--json")
    assert code == 0
    (report,) = json.loads(out)["owners"]
    assert report["owner"] == "kv-w0" and report["in_use_by_pid"] is None
    assert report["chunks"] == 9 and report["payload_bytes"] == 9 * (64 << 10)
    assert report["bad_headers"] == report["stale_copies"] == 0
    assert report["slots"] >= 9 and report["free_slots"] == report["slots"] - 9
    assert report["oldest"] <= report["newest"]
    assert report["top_groups"] == [
        {"group": "llama", "chunks": 6, "bytes": 6 * (64 << 10)},
        {"group": "qwen user=u1", "chunks": 3, "bytes": 3 * (64 << 10)},
    ]
    assert digest_files(*device_dirs) == before
    live = tier_factory()  # beside a live tier: read-only, and says who holds it
    code, out, _ = cli(capsys, "inspect", *paths)
    assert code == 0 and f"in use by pid {os.getpid()}" in out
    assert "chunks: 9 (0.6 MiB)" in out and "qwen user=u1" in out
    live.close()


def test_inspect_keys_lists_newest_first(
    stored: list[CacheEngineKey],
    device_dirs: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = cli(capsys, "inspect", *map(str, device_dirs), "--keys")
    assert code == 0
    assert out.splitlines() == [key_text(k) for k in reversed(stored)]


def test_inspect_usage_errors(
    stored: list[CacheEngineKey],
    device_dirs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = cli(capsys, "inspect", str(device_dirs[0]))
    assert code == 2 and "give its 2 paths" in err
    code, _, err = cli(capsys, "inspect", str(tmp_path / "nope"))
    assert code == 2 and "No such file" in err


def test_inspect_config_reads_every_tier_it_names_and_refuses_bad_ones(
    stored: list[CacheEngineKey],
    device_dirs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "lmcache.yaml"
    cold = tmp_path / "cold"
    cold.mkdir()
    warm = "\n".join(f"    - {d}" for d in device_dirs)
    config.write_text(
        f"chunk_size: 256\nextra_config:\n  tiered.warm.paths:\n{warm}\n"
        f"  tiered.cold.paths: [{cold}]\n"
    )
    code, out, err = cli(capsys, "inspect", "--config", str(config), "--json")
    report = json.loads(out)
    # warm's files are read; the cold tier holds no files yet: said, exit 2
    assert [r["chunks"] for r in report["owners"]] == [9]
    assert report["unreadable"] == [
        {"paths": [str(cold)], "error": f"{cold}: no tier files (*.hdr) here"}
    ]
    assert code == 2 and report["store"] is None
    code, _, err = cli(capsys, "inspect", "--config", str(config), str(cold))
    assert code == 2 and "PATHS or --config FILE, not both" in err
    code, _, err = cli(capsys, "inspect")
    assert code == 2 and "give a tier's PATHS or --config FILE" in err
    config.write_text("local_cpu: true\n")
    code, _, err = cli(capsys, "inspect", "--config", str(config))
    assert code == 2 and "neither LMCache's YAML (with extra_config)" in err
    config.write_text("extra_config: {tiered.warm.pahts: [/x]}\n")
    code, _, err = cli(capsys, "inspect", "--config", str(config))
    assert code == 2 and "Did you mean tiered.warm.paths?" in err


def _damage(
    device_dirs: list[Path], tier: Tier, allocator: MixedMemoryAllocator
) -> None:
    """A flipped payload byte (key 1), a torn header (key 2), a cut tail."""
    slots = {e.header.key: e.slot for e in tier.index}
    tier.close()
    extent = tier.geometry.extents(slots[key(1)], 64 << 10)[0]
    with open(device_dirs[extent.device] / "kv-w0.slab", "r+b") as f:
        f.seek(extent.offset + 9)
        f.write(b"\x99\x98")
    header_file = device_dirs[0] / "kv-w0.hdr"
    with open(header_file, "r+b") as f:
        f.seek(Geometry.header_offset(slots[key(2)]) + 50)
        f.write(b"\xee")
    with open(header_file, "ab") as f:
        f.write(b"\x01" * 100)


def test_fsck_finds_repairs_and_then_is_clean(
    stored: list[CacheEngineKey],
    device_dirs: list[Path],
    tier_factory: TierFactory,
    allocator: MixedMemoryAllocator,
    capsys: pytest.CaptureFixture[str],
) -> None:
    paths = [str(d) for d in device_dirs]
    code, out, _ = cli(capsys, "fsck", *paths)
    assert code == 0 and "kv-w0: 0 problem(s)" in out
    _damage(device_dirs, tier_factory(), allocator)
    before = digest_files(*device_dirs)
    code, out, err = cli(capsys, "fsck", *paths, "--progress")
    assert code == 1 and "kv-w0: 3 problem(s)" in out
    assert "payload checksum mismatch (llama@1@0@" in out
    assert "header checksum mismatch" in out and "truncated" in out
    assert "fsck kv-w0 [" in err and err.endswith("\n")
    assert digest_files(*device_dirs) == before  # checking never writes
    live = tier_factory()
    code, _, err = cli(capsys, "fsck", *paths)
    assert code == 1 and f"in use by pid {os.getpid()}" in err
    code, _, err = cli(capsys, "fsck", *paths, "--repair")
    assert code == 2 and f"held by a live process (pid {os.getpid()})" in err
    live.close()
    assert digest_files(*device_dirs) == before
    code, out, _ = cli(capsys, "fsck", *paths, "--repair")
    assert code == 1 and "3 problem(s), 3 repaired" in out
    code, out, _ = cli(capsys, "fsck", *paths)
    assert code == 0
    tier = tier_factory(verify_reads=False)
    assert len(tier) == 7 and tier.stats.corrupt == 0
    good = [k for k in stored if k not in (key(1), key(2))]
    assert read_back(tier, allocator, good) == [True] * 7


def _rewrite_headers(
    device_dirs: list[Path], change: Callable[[RecordHeader], RecordHeader | None]
) -> int:
    """Apply ``change`` to every record header on disk (None leaves it)."""
    header_file = device_dirs[0] / "kv-w0.hdr"
    data = header_file.read_bytes()
    changed = 0
    with open(header_file, "r+b") as f:
        for slot, header in decode_header_blocks(data[HEADER_SIZE:], 0, 1 << 30):
            assert isinstance(header, RecordHeader)
            new = change(header)
            if new is not None:
                f.seek(Geometry.header_offset(slot))
                f.write(new.encode())
                changed += 1
    return changed


def _as_version_1(header: RecordHeader, *, crc: int | None = None) -> RecordHeader:
    """The header a 0.1.0 release wrote for the same payload (zlib's CRC32)."""
    payload = random_kv(header.shape, header.key.chunk_hash).view(torch.uint8)
    if crc is None:
        crc = zlib.crc32(payload.numpy().tobytes())
    return dataclasses.replace(header, version=1, payload_crc=crc)


def test_format_1_records_are_read_and_checked_with_their_own_crc(
    stored: list[CacheEngineKey],
    device_dirs: list[Path],
    tier_factory: TierFactory,
    allocator: MixedMemoryAllocator,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A tier written by the release before CRC32C: its records are served
    byte-exact and pass fsck; a version-1 header whose checksum is not the
    payload's CRC32 (here: the CRC32C of a version-2 record) is a miss, and so
    is a version this code does not know."""
    first, mislabelled, unknown = stored[0], stored[1], stored[2]

    def downgrade(header: RecordHeader) -> RecordHeader:
        if header.key == mislabelled:
            return _as_version_1(header, crc=header.payload_crc)
        if header.key == unknown:
            return dataclasses.replace(header, version=4)
        return _as_version_1(header)

    assert _rewrite_headers(device_dirs, downgrade) == 9
    paths = [str(d) for d in device_dirs]
    code, out, _ = cli(capsys, "fsck", *paths)
    assert code == 1 and "kv-w0: 2 problem(s)" in out
    assert "payload checksum mismatch" in out and "record format version 4" in out
    code, out, _ = cli(capsys, "inspect", *paths, "--json")
    assert code == 0 and json.loads(out)
    tier = tier_factory()
    try:
        assert len(tier) == 8 and tier.stats.corrupt == 1  # version 4
        good = [k for k in stored if k not in (mislabelled, unknown)]
        assert read_back(tier, allocator, good) == [True] * 7
        assert read_back(tier, allocator, [mislabelled]) == [False]
        assert tier.stats.corrupt == 2
        # new writes are version 2 again
        fill(tier, allocator, [key(20)])
    finally:
        tier.close()
    versions = {
        h.key: h.version
        for _, h in decode_header_blocks(
            (device_dirs[0] / "kv-w0.hdr").read_bytes()[HEADER_SIZE:], 0, 1 << 30
        )
        if isinstance(h, RecordHeader)
    }
    assert versions[key(20)] == FORMAT_VERSION == 2 and versions[first] == 1


def test_fsck_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "fsck", str(tmp_path))
    assert code == 2 and "no tier files" in err


# ------------------------------------------------------------------ warmup


@pytest.fixture
def warm_dirs(tmp_path: Path) -> list[Path]:
    dirs = [tmp_path / "warm0", tmp_path / "warm1", tmp_path / "warm2"]
    for d in dirs:
        d.mkdir()
    return dirs


def open_warm(dirs: list[Path], **settings: Any) -> Tier:
    extra = {"tiered.warm.paths": [str(d) for d in dirs]}
    extra.update({f"tiered.{k}": v for k, v in settings.items()})
    config = TieredConfig.from_extra_config(extra)
    return Tier(
        config.tier_options(config.warm),
        owner="kv-w0",
        max_payload=64 << 10,
        capacity_bytes=8 << 20,
    )


def test_warmup_copies_listed_keys_between_tiers(
    stored: list[CacheEngineKey],
    device_dirs: list[Path],
    warm_dirs: list[Path],
    allocator: MixedMemoryAllocator,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A three-device target from a two-device source: the listed keys are
    copied, CRC-checked; a key the source lacks makes the exit status 1."""
    hot = [key(4), key(7, "u1"), key(0)]
    absent = CacheEngineKey("llama", 1, 0, 999, torch.bfloat16, None)
    keys_file = tmp_path / "hot.txt"
    keys_file.write_text(
        "# system prompts\n" + "\n".join(key_text(k) for k in [*hot, absent]) + "\n\n"
    )
    argv = ["warmup", "--keys", str(keys_file), "--from", *map(str, device_dirs)]
    argv += ["--to", *map(str, warm_dirs), "--stripe-kb", "16", "--capacity-gb", "0.01"]
    code, out, _ = cli(capsys, *argv)
    assert code == 1
    assert "kv-w0: 3 copied, 0 already there" in out
    assert "3 of 4 key(s) in the target, 1 not" in out
    warm = open_warm(warm_dirs, stripe_kb=16)
    # least recent first: the keys listed first are evicted last
    assert [k.chunk_hash for k in warm.stored_keys()] == [100, 107, 104]
    assert read_back(warm, allocator, hot) == [True] * 3
    code, _, err = cli(capsys, *argv)  # beside the live target: refused
    assert code == 2 and f"held by live process {os.getpid()}" in err
    warm.close()
    keys_file.write_text("\n".join(key_text(k) for k in hot))
    code, out, _ = cli(capsys, *argv)
    assert code == 0 and "0 copied, 3 already there" in out
    before = digest_files(*warm_dirs)
    code, _, err = cli(capsys, *argv[:-4], "--stripe-kb", "8", "--capacity-gb", "0.01")
    assert code == 2 and "pass the server's --stripe-kb" in err
    assert digest_files(*warm_dirs) == before  # never reformatted


def test_warmup_rejects_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("not-a-key\n")
    code, _, err = cli(
        capsys, "warmup", "--keys", str(keys_file), "--from", str(tmp_path), "--to", "x"
    )
    assert code == 2 and "keys.txt:1: not a key" in err
    code, _, err = cli(capsys, "warmup", "--keys", str(keys_file))
    assert code == 2 and "needs --from and --to" in err
    code, _, err = cli(capsys, "warmup", "--trace", str(keys_file), "--hint-url", "u")
    assert code == 2 and 'keys.txt:1: expected {"token_ids"' in err


def test_warmup_trace_hints_a_live_server_into_hot(
    engine_factory: Callable[..., Any],
    device_dirs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra = plugin_extra_config(
        device_dirs, **{"warmup.policy": "hinted", "warmup.hint_port": 0}
    )
    engine, connector = engine_factory(extra)
    backend = testing.get_backends(engine)["tiered"]
    assert isinstance(backend, TieredBackend) and backend.cache is not None
    assert backend.hint_server is not None
    tokens = testing.make_tokens(768, seed=9)
    testing.store_tokens(engine, tokens, testing.make_kv(connector, 768, seed=10))
    backend.flush()
    testing.clear_cpu_tier(engine)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        json.dumps({"token_ids": tokens.tolist(), "deadline_s": 30}) + "\n"
    )
    code, out, _ = cli(
        capsys, "warmup", "--trace", str(trace), "--hint-url", backend.hint_server.url
    )
    assert code == 0 and "1 hint(s) accepted" in out
    cache = backend.cache
    keys = testing.chunk_keys(engine, tokens)
    deadline = time.monotonic() + 10
    while not all(cache.where(k) == "hot" for k in keys):
        assert time.monotonic() < deadline, "hinted chunks never reached hot"
        time.sleep(0.01)
