"""Hostile and mistaken input (issue 20): one directory under two names,
FIFOs and crafted files planted where tier files belong, files deleted under
a running tier, a damaged superblock at start-up, settings that look right.

Real files, real FIFOs, real symbolic links and hard links, real engines;
the two stand-ins (a failing read at start-up, a refresher stuck in a hung
file system) are said where they are used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import yaml
from conftest import payload_offset, plugin_extra_config, wait_until
from lmcache.utils import CacheEngineKey
from test_faults import (
    CHUNK_BYTES,
    Chunks,
    FailingDevice,
    Verdict,
    key,
    open_cache,
    open_tier,
    read_all,
    seal,
    tiered_config,
)

from lmcache_tiered import testing
from lmcache_tiered.cache import shared as shared_module
from lmcache_tiered.cli import main
from lmcache_tiered.config import ConfigError
from lmcache_tiered.keys import key_text
from lmcache_tiered.storage import health, layout, tierfiles
from lmcache_tiered.storage.tier import Tier

T = TypeVar("T")


def within(seconds: float, work: Callable[[], T], *fifos: Path) -> T:
    """``work()``'s result, failing the test if it blocks for ``seconds``;
    a FIFO it is stuck on is then opened for writing to let it go."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked for more than {seconds} s")
    if errors:
        raise errors[0]
    return result[0]


def warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and text in r.getMessage()
    ]


def digests(*dirs: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for d in dirs
        for p in sorted(d.iterdir())
        if p.is_file() and not p.name.endswith(".lock")
    }


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------- devices by identity


def test_one_directory_under_two_names_is_refused(
    device_dirs: list[Path], tmp_path: Path
) -> None:
    """A symbolic link to a listed directory, in the same tier or in the
    other one: refused, naming the setting and both paths."""
    link = tmp_path / "link"
    link.symlink_to(device_dirs[0])
    with pytest.raises(ConfigError) as error:
        tiered_config([device_dirs[0], link])
    assert f"tiered.warm.paths: {device_dirs[0]} and {link} are the same" in str(
        error.value
    )
    with pytest.raises(ConfigError, match=f"tiered.cold.paths: {link} is also a warm"):
        tiered_config(device_dirs, **{"cold.paths": [str(link)]})


@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
def test_a_bind_mount_of_a_listed_directory_is_refused(
    device_dirs: list[Path], tmp_path: Path
) -> None:
    """The same directory mounted a second time: the same (st_dev, st_ino)."""
    mount_point = tmp_path / "bound"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "--bind", str(device_dirs[0]), str(mount_point)], check=True
    )
    try:
        with pytest.raises(ConfigError, match="are the same directory"):
            tiered_config([device_dirs[0], mount_point])
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_paths_on_one_file_system_are_warned_about(
    device_dirs: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Two directories of one file system are not two devices: one WARNING
    names both (the tier still works)."""
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        open_tier(device_dirs, 8).close()
    (line,) = warnings(caplog, "are on one file system")
    assert f"{device_dirs[0]} and {device_dirs[1]}" in line
    assert "tiered.warm.paths" in line


def test_exposure_is_checked_on_the_directory_a_link_leads_to(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link (mode 777 itself) to a private directory is not world-writable;
    a link to a world-writable one is, and the warning names where it leads."""
    private, public = tmp_path / "private", tmp_path / "public"
    private.mkdir(mode=0o700)
    public.mkdir()
    public.chmod(0o777)
    to_private, to_public = tmp_path / "to-private", tmp_path / "to-public"
    to_private.symlink_to(private)
    to_public.symlink_to(public)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        open_tier([to_private], 8).close()
        assert not warnings(caplog, "writable by every user")
        open_tier([to_public], 8).close()
    (line,) = warnings(caplog, "writable by every user")
    assert f"{to_public} (-> {public}) is writable by every user" in line


def test_a_slab_shared_with_another_live_tier_is_refused(tmp_path: Path) -> None:
    """Two live tiers whose first paths differ but which both list one
    directory: the second is refused on that slab's own lock."""
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    first = open_tier([dirs[0], dirs[1]], 8)
    try:
        with pytest.raises(ConfigError) as error:
            open_tier([dirs[2], dirs[1]], 8)
        slab = dirs[1] / "kv-w0.slab"
        assert f"{slab} is in use by live process {os.getpid()}" in str(error.value)
    finally:
        first.close()
    open_tier([dirs[2], dirs[1]], 8).close()  # free once the first is closed


def test_a_hard_linked_slab_is_refused(device_dirs: list[Path]) -> None:
    """One file under two slab names would mix two devices' stripe units."""
    open_tier(device_dirs, 8).close()
    (device_dirs[1] / "kv-w0.slab").unlink()
    os.link(device_dirs[0] / "kv-w0.slab", device_dirs[1] / "kv-w0.slab")
    with pytest.raises(ConfigError, match="are the same file"):
        open_tier(device_dirs, 8)


def test_a_directory_where_a_tier_file_belongs_is_named_with_the_fix(
    device_dirs: list[Path],
) -> None:
    """Not a bare ``[Errno 21]``: the setting, the file and what to do."""
    (device_dirs[1] / "kv-w0.slab").mkdir()
    with pytest.raises(ConfigError) as error:
        open_tier(device_dirs, 8)
    slab = device_dirs[1] / "kv-w0.slab"
    assert str(error.value) == (
        f"tiered.warm.paths: {slab} is a directory; tier files are only "
        "regular files: remove it"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")
def test_a_tier_file_that_cannot_be_opened_is_named_with_the_fix(
    device_dirs: list[Path],
) -> None:
    """An immutable slab refuses even root's write open (EPERM, as a mode-000
    file does to a user): the setting, the file and what to do."""
    open_tier(device_dirs, 8).close()
    slab = device_dirs[0] / "kv-w0.slab"
    subprocess.run(["chattr", "+i", str(slab)], check=True)
    try:
        with pytest.raises(ConfigError) as error:
            open_tier(device_dirs, 8)
    finally:
        subprocess.run(["chattr", "-i", str(slab)], check=True)
    assert str(error.value).startswith(
        f"tiered.warm.paths: cannot open {slab}: Operation not permitted; give "
        "the user LMCache runs as read and write access"
    )


# ---------------------------------------------------- planted files


@pytest.fixture
def cold(tmp_path: Path) -> Path:
    path = tmp_path / "cold"
    path.mkdir()
    return path


def test_fifos_in_a_shared_cold_tier_never_block(
    device_dirs: list[Path], cold: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another host's header file that is a FIFO, and a real header whose
    slab is a FIFO: start-up, a refresh and close all return; each name
    gets one WARNING and our own tiers serve."""
    settings = {"cold.paths": [str(cold)], "host_id": "hostA"}
    config = tiered_config(device_dirs, **settings)
    assert config.cold is not None
    Tier(
        config.tier_options(config.cold),
        owner="kv-w0-hostC",
        max_payload=CHUNK_BYTES,
        capacity_bytes=8 << 20,
    ).close()
    (cold / "kv-w0-hostC.slab").unlink()
    fifos = [cold / "kv-w0-hostB.hdr", cold / "kv-w0-hostC.slab"]
    for fifo in fifos:
        os.mkfifo(fifo)
    chunks = Chunks()
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        cache = within(30, lambda: open_cache(config, chunks), *fifos)
        try:
            assert cache.shared.tiers() == []
            later = cold / "kv-w0-hostD.hdr"
            os.mkfifo(later)
            within(10, cache.shared.refresh, later)
            within(10, cache.shared.refresh, later)
            obj = chunks.make(1)
            assert obj is not None
            assert cache.tiers["cold"].write([(key(1), obj)]) == [True]
            obj.ref_count_down()
        finally:
            within(30, cache.close)
    for name in ("kv-w0-hostB.hdr", "kv-w0-hostD.hdr"):
        assert len(warnings(caplog, f"ignoring {name}: a FIFO")) == 1
    (line,) = warnings(caplog, "ignoring kv-w0-hostC.hdr")
    assert "kv-w0-hostC.slab is a FIFO, not a regular file" in line


def test_shared_cold_close_does_not_wait_forever_for_its_refresher(
    device_dirs: list[Path], cold: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stand-in for a hung file system (none can be made here): the
    refresher blocks inside a refresh; close() gives up on it after JOIN_S
    and still closes the tiers."""
    monkeypatch.setattr(shared_module, "REFRESH_S", 0.05)
    # (raising=False: the same test runs, and hangs, against code without it)
    monkeypatch.setattr(shared_module, "JOIN_S", 0.5, raising=False)
    config = tiered_config(device_dirs, **{"cold.paths": [str(cold)]})
    cache = open_cache(config, Chunks())
    entered, hung = threading.Event(), threading.Event()

    def stuck() -> None:
        entered.set()
        hung.wait()

    cache.shared.refresh = stuck  # type: ignore[method-assign]
    try:
        assert entered.wait(10)
        started = time.monotonic()
        within(10, cache.shared.close)
        assert time.monotonic() - started < 5
    finally:
        hung.set()
        cache.close()


def _tier_files(device_dirs: list[Path], chunks: Chunks, ids: range) -> None:
    tier = open_tier(device_dirs, 16)
    try:
        assert chunks.store(tier, ids) == [True] * len(ids)
    finally:
        tier.close()


@pytest.mark.parametrize("planted", ["kv-w0.slab", "kv-w0.hdr"])
def test_tools_never_block_on_a_fifo(
    device_dirs: list[Path], planted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect, inspect --keys and fsck on a tier whose slab or header file
    is a FIFO: each returns 2 at once, naming the file."""
    _tier_files(device_dirs, Chunks(), range(2))
    fifo = device_dirs[1 if planted.endswith(".slab") else 0] / planted
    fifo.unlink()
    os.mkfifo(fifo)
    paths = [str(d) for d in device_dirs]
    for argv in (["inspect"], ["inspect", "--keys"], ["fsck"]):
        code = within(20, lambda a=argv: main([*a, *paths]), fifo)  # type: ignore[misc]
        _, err = capsys.readouterr()
        assert code == 2 and f"{fifo} is a FIFO, not a regular file" in err, err


def _superblock(devices: int, stripe: int, per_device: int, max_payload: int) -> bytes:
    return layout.Geometry(devices, stripe, per_device, max_payload).encode_superblock()


def test_tools_bound_what_they_allocate_by_their_own_limits(
    device_dirs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A sealed superblock declaring 1 TiB slots, with a sealed header
    claiming a 1 TiB payload: inspect and fsck refuse that owner (exit 2)
    before allocating anything for it."""
    _tier_files(device_dirs, Chunks(), range(2))
    header = device_dirs[0] / "kv-w0.hdr"
    huge = 1 << 40
    with open(header, "r+b") as f:
        f.write(_superblock(2, 1 << 20, huge // 2, huge))
        f.seek(layout.Geometry.header_offset(0))
        f.write(seal([huge], huge))
    paths = [str(d) for d in device_dirs]
    for command in ("inspect", "fsck"):
        code, _, err = within(20, lambda c=command: cli(capsys, c, *paths))  # type: ignore[misc]
        assert code == 2, (command, err)
        assert f"declares slots of {huge} bytes, more than the" in err


def test_one_bad_owner_is_reported_and_the_others_are_still_read(
    device_dirs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """kv-w1 has a header file but no slabs: inspect and fsck report it,
    still report kv-w0, and exit 2."""
    _tier_files(device_dirs, Chunks(), range(3))
    shutil.copy(device_dirs[0] / "kv-w0.hdr", device_dirs[0] / "kv-w1.hdr")
    paths = [str(d) for d in device_dirs]
    code, out, err = cli(capsys, "inspect", *paths)
    assert code == 2 and "kv-w0 under" in out and "chunks: 3 " in out
    assert "kv-w1: " in err and "kv-w1.slab" in err
    code, out, err = cli(capsys, "fsck", *paths)
    assert code == 2 and "kv-w0: 0 problem(s)" in out
    assert "kv-w1: " in err and "kv-w1.slab" in err


def test_control_characters_from_the_files_are_escaped(
    device_dirs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A model name with terminal escape sequences is printed escaped by
    inspect (text and --keys), and warmup --keys reads the escaped form back
    as the same key."""
    evil = CacheEngineKey("m\x1b[2J\x1b]0;pwned\x07\\x", 1, 0, 5, torch.bfloat16, None)
    chunks = Chunks()
    tier = open_tier(device_dirs, 8)
    obj = chunks.make(5)
    assert obj is not None
    try:
        assert tier.write([(evil, obj)]) == [True]
    finally:
        obj.ref_count_down()
        tier.close()
    paths = [str(d) for d in device_dirs]
    code, out, _ = cli(capsys, "inspect", *paths)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert "m\\x1b[2J\\x1b]0;pwned\\x07\\\\x" in out
    code, keys_out, _ = cli(capsys, "inspect", "--keys", *paths)
    assert code == 0 and "\x1b" not in keys_out and keys_out.count("\n") == 1
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(keys_out)
    target = tmp_path / "target"
    target.mkdir()
    argv = ["warmup", "--keys", str(keys_file), "--from", *paths]
    code, out, _ = cli(capsys, *argv, "--to", str(target), "--capacity-gb", "0.01")
    assert code == 0 and "1 of 1 key(s) in the target" in out
    assert key_text(evil) not in out


# ------------------------------------------------------- durability


def test_a_batch_written_after_its_file_was_deleted_is_not_acknowledged(
    device_dirs: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A slab unlinked under a running tier: the next batch lands in the
    unlinked file, so it is refused (not acknowledged) and the tier degrades
    at once; after a restart nothing acknowledged is missing."""
    chunks = Chunks()
    verdict = Verdict()
    tier = open_tier(device_dirs, 32)
    acked: set[int] = set()
    try:
        stored = chunks.store(tier, range(4))
        acked |= {i for i, ok in zip(range(4), stored, strict=True) if ok}
        (device_dirs[1] / "kv-w0.slab").unlink()
        with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
            stored = chunks.store(tier, range(4, 8))
        assert stored == [False] * 4
        assert tier.degraded is not None and "kv-w0.slab was removed" in tier.degraded
    finally:
        tier.close()
    tier = open_tier(device_dirs, 32)
    try:
        served = read_all(tier, list(range(8)), chunks, verdict)
        assert not served & set(range(4, 8))
        assert not any(tier.contains(key(i)) for i in range(4, 8))
    finally:
        tier.close()
    assert acked == set(range(4)) and verdict.wrong_bytes == 0


def test_checking_the_files_costs_little_per_batch(device_dirs: list[Path]) -> None:
    """The per-batch check is a stat and an fstat per file: well under a
    millisecond (a batch writes megabytes)."""
    tier = open_tier(device_dirs, 8)
    try:
        runs = 2000
        started = time.perf_counter()
        for _ in range(runs):
            assert tier.files.missing() is None
        per_check = (time.perf_counter() - started) / runs
    finally:
        tier.close()
    print(f"\nFIGURES file-check: files=3, us_per_batch={per_check * 1e6:.1f}")
    assert per_check < 1e-3


# ------------------------------------------------------- start-up


def test_a_damaged_superblock_degrades_and_leaves_the_files(
    device_dirs: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One flipped bit in the superblock: the tier starts degraded, says why
    and what to run, and leaves every byte; with the bit restored the probe
    loads the index and every chunk is served exact."""
    monkeypatch.setattr(health, "PROBE_S", 0.05)
    chunks = Chunks()
    _tier_files(device_dirs, chunks, range(6))
    header = device_dirs[0] / "kv-w0.hdr"
    with open(header, "r+b") as f:
        good = f.read(layout.HEADER_SIZE)
        f.seek(12)
        f.write(bytes([good[12] ^ 0x01]))
    before = digests(*device_dirs)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        tier = open_tier(device_dirs, 16)
    try:
        assert tier.degraded is not None and "superblock is damaged" in tier.degraded
        (line,) = warnings(caplog, " degraded: ")
        assert "lmcache-tiered fsck" in line and "left as they are" in line
        assert len(tier) == 0 and not tier.contains(key(0))
        assert chunks.store(tier, [9]) == [False]
        time.sleep(0.3)  # probes find it still damaged
        assert digests(*device_dirs) == before
        with open(header, "r+b") as f:
            f.write(good)
        recovers_with_every_chunk(tier, chunks, 6)
    finally:
        tier.close()


def recovers_with_every_chunk(tier: Tier, chunks: Chunks, count: int) -> None:
    """Once the probe lets ``tier`` out of degraded mode, chunks 0..count-1
    are all served, byte-exact."""
    wait_until(lambda: tier.degraded is None)
    verdict = Verdict()
    assert read_all(tier, list(range(count)), chunks, verdict) == set(range(count))
    assert verdict.wrong_bytes == 0


def test_a_read_error_at_start_up_degrades_and_loses_nothing(
    device_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stand-in for a device that fails its first reads (no dm-error here):
    the engine fails every request at start-up. The tier starts degraded
    instead of formatting; once reads work, the probe loads every chunk."""
    monkeypatch.setattr(health, "PROBE_S", 0.05)
    chunks = Chunks()
    _tier_files(device_dirs, chunks, range(6))
    before = digests(*device_dirs)
    real = tierfiles.make_engine
    devices: list[FailingDevice] = []

    def failing(*args: Any) -> FailingDevice:
        devices.append(FailingDevice(real(*args)))
        return devices[-1]

    monkeypatch.setattr(tierfiles, "make_engine", failing)
    tier = open_tier(device_dirs, 16)
    try:
        assert tier.degraded is not None and "Input/output error" in tier.degraded
        assert digests(*device_dirs) == before
        devices[-1].failing = False
        recovers_with_every_chunk(tier, chunks, 6)
    finally:
        tier.close()


# --------------------------------------------------- smaller points


def test_damaged_chunk_warnings_are_rate_limited_with_counts(
    device_dirs: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    """40 chunks with a flipped payload byte: 40 counted misses, at most two
    WARNING lines (one per DAMAGE_LOG_S), each with the count so far."""
    chunks = Chunks()
    tier = open_tier(device_dirs, 48)
    try:
        assert chunks.store(tier, range(40)) == [True] * 40
        places = [payload_offset(tier, key(i)) for i in range(40)]
    finally:
        tier.close()
    for slab, offset in places:
        with open(slab, "r+b") as f:
            f.seek(offset + 3)
            byte = f.read(1)[0]
            f.seek(offset + 3)
            f.write(bytes([byte ^ 0x10]))
    tier = open_tier(device_dirs, 48)
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
            for i in range(40):
                assert tier.read([key(i)], chunks.allocate) == [None]
        assert tier.stats.corrupt == 40
    finally:
        tier.close()
    lines = warnings(caplog, "failed its checksum")
    assert 1 <= len(lines) <= 2, lines
    assert "(1 damaged records so far" in lines[0]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1e9, "tiered.queue_depth: must be between 1 and 32768"),
        (32769, "tiered.queue_depth: must be between 1 and 32768"),
    ],
)
def test_queue_depth_beyond_the_kernels_limit_is_refused(
    device_dirs: list[Path], value: float, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        tiered_config(device_dirs, queue_depth=value)
    assert tiered_config(device_dirs, queue_depth=32768).queue_depth == 32768


def test_file_mode_must_be_sane_and_a_yaml_int_gets_a_quoting_hint(
    device_dirs: list[Path],
) -> None:
    """0 or no owner read/write is refused; ``file_mode: 660`` in YAML is the
    decimal 660, refused with the hint to write "0660"; 0660 and "0660" work."""
    for mode in (0, "0", "0400", "0066"):
        with pytest.raises(ConfigError, match="owner read and write"):
            tiered_config(device_dirs, file_mode=mode)
    decimal = yaml.safe_load("file_mode: 660")["file_mode"]
    with pytest.raises(ConfigError) as error:
        tiered_config(device_dirs, file_mode=decimal)
    assert 'YAML reads 660 as a decimal number: write "0660"' in str(error.value)
    octal = yaml.safe_load("file_mode: 0660")["file_mode"]
    assert tiered_config(device_dirs, file_mode=octal).file_mode == 0o660
    assert tiered_config(device_dirs, file_mode="0660").file_mode == 0o660


def test_slot_mb_below_one_chunk_is_refused_at_start(
    engine_factory: Callable[..., Any],
    device_dirs: list[Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real LMCache engine: a slot smaller than the model's full chunk would
    drop every full chunk; the plugin refuses to load and says why."""
    extra = plugin_extra_config(device_dirs, slot_mb=0.01)
    with caplog.at_level(logging.ERROR, logger="lmcache_tiered"):
        engine, _ = engine_factory(extra)
    assert "tiered" not in testing.get_backends(engine)
    assert "tiered.slot_mb: 0.01 MiB is less than one full chunk" in caplog.text


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _foreign_cold(cold: list[Path], owner: str) -> None:
    """Another host's cold files, as its own tier leaves them."""
    config = tiered_config(cold)
    Tier(
        config.tier_options(config.warm),
        owner=owner,
        max_payload=CHUNK_BYTES,
        capacity_bytes=8 << 20,
    ).close()


def test_a_host_whose_files_will_not_open_leaks_nothing_and_is_backed_off(
    device_dirs: list[Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead host's files half deleted (its second cold slab gone): each
    try opened the first slab and leaked it, every 2 s. Every failed open
    closes what it opened, the host is reported once, and it is tried again
    only after a back-off."""
    cold = [tmp_path / "cold0", tmp_path / "cold1"]
    for path in cold:
        path.mkdir()
    _foreign_cold(cold, "kv-w0-hostC")
    (cold[1] / "kv-w0-hostC.slab").unlink()
    config = tiered_config(device_dirs, **{"cold.paths": [str(p) for p in cold]})
    monkeypatch.setattr(shared_module, "REFRESH_S", 3600.0)  # we refresh here
    # no back-off first: every refresh tries the host again
    monkeypatch.setattr(shared_module, "RETRY_MAX_S", 0.0, raising=False)
    opened: list[str] = []
    real_open = tierfiles.open_tier_file

    def counted(name: str, *args: Any) -> int:
        opened.append(name)
        return real_open(name, *args)

    monkeypatch.setattr(tierfiles, "open_tier_file", counted)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        cache = open_cache(config, Chunks())
        try:
            shared = cache.shared
            before, tries = _open_fds(), len(opened)
            for _ in range(20):
                shared.refresh()
            assert len(opened) >= tries + 20 * 2  # each try opened 2 files
            assert _open_fds() == before
            assert shared.tiers() == []
            monkeypatch.setattr(shared_module, "RETRY_MAX_S", 60.0, raising=False)
            shared.refresh()  # its wait was 0: tried, then backed off
            tries = len(opened)
            shared.refresh()
            shared.refresh()
            assert len(opened) == tries  # backed off: not tried again at once
        finally:
            cache.close()
    assert len(warnings(caplog, "kv-w0-hostC.hdr")) == 1


def test_an_engine_that_cannot_be_built_for_a_host_is_a_miss(
    device_dirs: list[Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``io_engine: uring`` with ring memory exhausted (a stand-in: the
    kernel's limit cannot be reached here) for another host's files: neither
    start-up nor a refresh raises, their descriptors are closed, and the
    host is read once the engine can be built."""
    cold = tmp_path / "cold"
    cold.mkdir()
    _foreign_cold([cold], "kv-w0-hostC")
    real_make = tierfiles.make_engine
    no_ring = [True]

    def make_engine(kind: str, fds: list[int], depth: int) -> Any:
        flags = fcntl.fcntl(fds[0], fcntl.F_GETFL)
        read_only = flags & os.O_ACCMODE == os.O_RDONLY
        if read_only and no_ring[0]:
            raise RuntimeError("io_uring is unusable here: ENOMEM")
        return real_make(kind, fds, depth)

    monkeypatch.setattr(tierfiles, "make_engine", make_engine)
    monkeypatch.setattr(shared_module, "RETRY_MAX_S", 0.0, raising=False)
    monkeypatch.setattr(shared_module, "REFRESH_S", 3600.0)  # we refresh here
    config = tiered_config(device_dirs, **{"cold.paths": [str(cold)]})
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        cache = open_cache(config, Chunks())  # start-up refreshes once
        try:
            before = _open_fds()
            cache.shared.refresh()
            assert cache.shared.tiers() == [] and _open_fds() == before
            no_ring[0] = False
            cache.shared.refresh()
            (foreign,) = cache.shared.tiers()
            assert _open_fds() > before
            for name in os.listdir(cold):
                if name.startswith("kv-w0-hostC."):
                    (cold / name).unlink()
            cache.shared.refresh()  # the host is gone: forgotten, files closed
            assert cache.shared.tiers() == [] and _open_fds() == before
            assert not foreign.files.fds
        finally:
            cache.close()
    assert len(warnings(caplog, "ENOMEM")) == 1
