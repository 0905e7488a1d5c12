"""Refreshing another host's tier reads only what it changed (issue 50).

Real files and real tiers: an owner writing with its change log, a
read-only tier following it, and a fresh read-only tier on the same files
as the full rescan to compare with.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered.cache import shared as shared_module
from lmcache_tiered.cache.shared import SharedCold
from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.cli import main
from lmcache_tiered.config import TieredConfig
from lmcache_tiered.keys import key_digest
from lmcache_tiered.storage import changes as changes_module
from lmcache_tiered.storage.layout import HEADER_SIZE, RecordHeader, TierNames
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.seal import MIN_SECRET_BYTES, RecordSeal
from lmcache_tiered.storage.tier import Tier

PAYLOAD = 4096
OWNER = "kv-w0-hostA"
#: one owner's view: key digest -> (slot, header)
View = dict[bytes, tuple[int, RecordHeader]]


def config(cold: Path, capacity_gb: float = 0.01) -> TieredConfig:
    """A warm tier beside ``cold`` (unused but required) and a cold tier."""
    warm = cold.parent / "warm"
    warm.mkdir(exist_ok=True)
    return TieredConfig.from_extra_config(
        {
            "tiered.warm.paths": [str(warm)],
            "tiered.cold.paths": [str(cold)],
            "tiered.cold.capacity_gb": capacity_gb,
            "tiered.warmup.policy": "none",
        }
    )


def open_cold(cold: Path, owner: str = OWNER, *, slots: int = 8, **kwargs: Any) -> Tier:
    """A tier on ``cold``'s files of ``owner``, of ``slots`` slots."""
    settings = config(cold)
    assert settings.cold is not None
    tier = Tier(
        settings.tier_options(settings.cold),
        owner=owner,
        max_payload=PAYLOAD,
        capacity_bytes=slots * (PAYLOAD + HEADER_SIZE),
        **kwargs,
    )
    assert tier.max_slots == slots
    return tier


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("llama", 1, 0, i, torch.bfloat16)


def payload(i: int) -> Payload:
    data = bytearray(i.to_bytes(8, "little") * (PAYLOAD // 8))
    shape = torch.Size([PAYLOAD // 2])
    return Payload(
        key(i), shape, torch.bfloat16, MemoryFormat.KV_2LTD, memoryview(data), False
    )


def write(tier: Tier, *ids: int) -> None:
    """One batch of chunks ``ids``."""
    assert tier.write_payloads([payload(i) for i in ids]) == [True] * len(ids)


def view(tier: Tier) -> View:
    return {key_digest(e.header.key): (e.slot, e.header) for e in tier.index}


def rescan(
    cold: Path, owner: str = OWNER, slots: int = 8, seal: RecordSeal | None = None
) -> View:
    """What a full rescan of the files finds."""
    fresh = open_cold(cold, owner, slots=slots, read_only=True, seal=seal)
    try:
        return view(fresh)
    finally:
        fresh.close()


class Following:
    """An owner with its change log, a tier following it, and how many
    times the follower rescanned the whole header file."""

    def __init__(
        self, cold: Path, slots: int = 8, seal: RecordSeal | None = None
    ) -> None:
        self.cold, self.slots, self.seal = cold, slots, seal
        self.owner = open_cold(cold, slots=slots, change_log=True, seal=seal)
        self.reader = open_cold(cold, slots=slots, read_only=True, seal=seal)
        self.rescans = 0
        load = self.reader.files.load

        def counted(max_slots: int) -> object:
            self.rescans += 1
            return load(max_slots)

        self.reader.files.load = counted  # type: ignore[method-assign,assignment]

    @property
    def log(self) -> Path:
        return Path(TierNames((str(self.cold),), OWNER).changes)

    def reopen_owner(self, **kwargs: Any) -> None:
        self.owner.close()
        self.owner = open_cold(self.cold, slots=self.slots, **kwargs)

    def refreshed(self) -> View:
        """The follower's view after a refresh, checked against a rescan's."""
        self.reader.refresh()
        seen = view(self.reader)
        assert seen == rescan(self.cold, slots=self.slots, seal=self.seal)
        return seen

    def close(self) -> None:
        self.owner.close()
        self.reader.close()


@pytest.fixture
def following(cold_dir: Path) -> Iterator[Following]:
    pair = Following(cold_dir)
    yield pair
    pair.close()


def test_a_record_written_is_read_from_the_log_alone(following: Following) -> None:
    write(following.owner, 1, 2, 3)
    assert set(following.refreshed()) == {key_digest(key(i)) for i in (1, 2, 3)}
    write(following.owner, 4)
    assert key_digest(key(4)) in following.refreshed()
    assert following.rescans == 0
    (got,) = following.reader.read_payloads([key(4)])
    assert got is not None and bytes(got.view) == bytes(payload(4).view)


def test_a_slot_reused_for_another_key_replaces_its_record(
    following: Following,
) -> None:
    write(following.owner, *range(8))  # full: the next write evicts one
    before = following.refreshed()
    write(following.owner, 8)
    seen = following.refreshed()
    (evicted,) = set(before) - set(seen)
    assert seen[key_digest(key(8))][0] == before[evicted][0]
    assert following.rescans == 0


def test_a_key_rewritten_with_a_newer_sequence_wins(following: Following) -> None:
    write(following.owner, 1, 2)
    following.refreshed()
    before = following.reader.index.get(key(1))
    # reopened, the owner trusts no record it has not read back: it writes
    # key 1 again, in another slot, with a higher sequence
    following.reopen_owner(change_log=True)
    following.refreshed()  # a new log generation: one rescan
    assert following.rescans == 1
    write(following.owner, 1)
    following.refreshed()
    after = following.reader.index.get(key(1))
    assert before is not None and after is not None
    assert after.slot != before.slot
    assert after.header.sequence > before.header.sequence
    assert following.rescans == 1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_writes_and_evictions_are_followed_exactly(
    following: Following, seed: int
) -> None:
    """Batches of 1-3 of 16 keys on 8 slots (keys evicted, slots reused,
    keys written again, a key twice in a batch), refreshed now and then:
    the follower's view is a rescan's, without one rescan."""
    rng = random.Random(seed)
    for _ in range(40):
        ids = rng.choices(range(16), k=rng.randint(1, 3))
        # a key the batch already held may be evicted by the batch: refused
        following.owner.write_payloads([payload(i) for i in ids])
        if rng.random() < 0.5:
            following.refreshed()
    following.refreshed()
    assert following.rescans == 0


def test_a_rotated_log_costs_one_rescan(
    cold_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(changes_module, "ROTATE_PER_SLOT", 1)  # 8 entries
    pair = Following(cold_dir)
    try:
        write(pair.owner, *range(6))
        pair.refreshed()
        generation = pair.log.read_bytes()[:16]
        write(pair.owner, *range(6, 10))  # past 8 entries: a new generation
        assert pair.log.read_bytes()[:16] != generation
        pair.refreshed()
        assert pair.rescans == 1
        write(pair.owner, 10)
        pair.refreshed()
        assert pair.rescans == 1
    finally:
        pair.close()


def test_a_log_deleted_or_truncated_falls_back_to_a_rescan(
    following: Following,
) -> None:
    write(following.owner, 1)
    following.refreshed()
    following.log.unlink()
    write(following.owner, 2)  # logged into the deleted file
    assert key_digest(key(2)) in following.refreshed()
    assert following.rescans == 1
    following.reopen_owner(change_log=True)  # a new log
    following.refreshed()
    write(following.owner, 3)
    following.refreshed()
    assert following.rescans == 2
    write(following.owner, 4)  # not read yet when the log is cut to its head
    os.truncate(following.log, 16)
    write(following.owner, 5)  # logged after a hole of zeros
    seen = following.refreshed()
    assert {key_digest(key(4)), key_digest(key(5))} <= set(seen)
    assert following.rescans == 3
    os.truncate(following.log, 0)
    write(following.owner, 6)  # logged after zeros where the head was
    assert key_digest(key(6)) in following.refreshed()
    assert following.rescans == 4


def test_a_torn_last_entry_falls_back_to_a_rescan(following: Following) -> None:
    write(following.owner, 1)
    following.refreshed()
    write(following.owner, 2)  # its entry torn, as a crash in the append leaves it
    os.truncate(following.log, following.log.stat().st_size - 3)
    assert key_digest(key(2)) in following.refreshed()
    assert following.rescans == 1


def test_a_damaged_entry_falls_back_to_a_rescan(following: Following) -> None:
    write(following.owner, 1)
    following.refreshed()
    write(following.owner, 2)
    with open(following.log, "r+b") as log:
        log.seek(-1, os.SEEK_END)
        log.write(b"\xff")  # the entry's CRC no longer holds
    assert key_digest(key(2)) in following.refreshed()
    assert following.rescans == 1


def test_an_owner_that_logs_nothing_is_rescanned(following: Following) -> None:
    """An older release, or a tier no host reads: no log at all, or a log
    left behind that headers written since are not in."""
    write(following.owner, 1)
    following.refreshed()
    following.reopen_owner()  # no log from now on: the old one stays
    old = time.time() - 60
    os.utime(following.log, (old, old))
    write(following.owner, 2)
    assert key_digest(key(2)) in following.refreshed()
    assert following.rescans == 1
    following.log.unlink()
    write(following.owner, 3)
    assert key_digest(key(3)) in following.refreshed()
    assert following.rescans == 2


def test_under_a_fleet_secret_a_record_without_a_mac_is_refused_as_at_load(
    cold_dir: Path,
) -> None:
    seal = RecordSeal(b"s" * MIN_SECRET_BYTES)
    pair = Following(cold_dir, seal=seal)
    try:
        write(pair.owner, 1)
        assert key_digest(key(1)) in pair.refreshed()
        pair.reopen_owner(change_log=True)  # without the secret
        pair.refreshed()
        write(pair.owner, 2)
        assert key_digest(key(2)) not in pair.refreshed()
        assert pair.rescans == 1 and pair.reader.stats.unsigned == 1
    finally:
        pair.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user")
def test_a_log_owned_by_an_untrusted_user_is_not_followed(
    following: Following,
) -> None:
    write(following.owner, 1)
    following.refreshed()
    os.chown(following.log, os.geteuid() + 4242, -1)  # planted by another user
    write(following.owner, 2)
    assert key_digest(key(2)) in following.refreshed()
    assert following.rescans == 1


def test_a_fifo_or_an_overlong_log_planted_in_its_place_is_not_followed(
    following: Following, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(following.owner, 1)
    following.refreshed()
    following.log.unlink()
    os.mkfifo(following.log)  # opened without blocking, refused
    write(following.owner, 2)
    assert key_digest(key(2)) in following.refreshed()
    assert following.rescans == 1
    following.log.unlink()
    following.reopen_owner(change_log=True)
    following.refreshed()
    write(following.owner, 3)
    # sound entries, but more than an owner of 8 slots logs before rotating
    seed = zlib.crc32(following.log.read_bytes()[:16])
    entry = struct.pack("<II", 0, zlib.crc32((0).to_bytes(4, "little"), seed))
    with open(following.log, "ab") as log:
        log.write(entry * (8 * 8 + 1))
    assert key_digest(key(3)) in following.refreshed()
    assert following.rescans == 3


def test_a_log_that_cannot_be_written_is_given_up_and_writes_go_on(
    cold_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = Path(TierNames((str(cold_dir),), OWNER).changes)
    log.mkdir()  # planted: the log cannot be renamed over it
    owner = open_cold(cold_dir, change_log=True)
    try:
        write(owner, 1, 2)
    finally:
        owner.close()
    assert rescan(cold_dir).keys() == {key_digest(key(i)) for i in (1, 2)}
    assert [r for r in caplog.records if "cannot write this change log" in r.msg]


def test_one_append_per_write_batch(
    cold_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = open_cold(cold_dir, change_log=True)
    appends: list[int] = []
    pwrite = os.pwrite

    def counted(fd: int, data: bytes, offset: int) -> int:
        if owner.changes is not None and fd == owner.changes._fd:
            appends.append(len(data))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(changes_module.os, "pwrite", counted)
    try:
        write(owner, *range(5))
    finally:
        owner.close()
    assert appends == [5 * 8]


def test_only_the_cold_tier_keeps_a_log_and_the_tools_ignore_it(
    tmp_path: Path, cold_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    warm = tmp_path / "warm"
    cache = TieredCache(
        config(cold_dir),
        owner="kv-w0",
        max_payload=PAYLOAD,
        local_workers=1,
        hot=None,
    )
    try:
        assert cache.warm.changes is None
        assert not list(warm.glob("*.changes"))
        cold = cache.tiers["cold"]
        assert isinstance(cold, Tier) and cold.changes is not None
        write(cold, 1, 2)
    finally:
        cache.close()
    log = TierNames((str(cold_dir),), cold.owner).changes
    assert [str(p) for p in cold_dir.glob("*.changes")] == [log]
    assert main(["fsck", str(cold_dir)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(cold_dir), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["owners"]
    assert report["owner"] == cold.owner and report["chunks"] == 2


def test_a_write_the_header_files_mtime_hides_is_seen_in_the_log(
    cold_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coarse or skewed clock can leave a header file's size and mtime as
    they were when we last looked; its owner's log still grew."""
    monkeypatch.setattr(shared_module, "REFRESH_S", 3600.0)  # we refresh here
    owner = open_cold(cold_dir, change_log=True)
    own = open_cold(cold_dir, "kv-w0-us")
    header = Path(owner.header_path)
    try:
        write(owner, 1)
        old = time.time_ns() - 60 * 10**9  # well before our look: no slack
        os.utime(header, ns=(old, old))
        shared = SharedCold(own, config(cold_dir), max_payload=PAYLOAD)
        try:
            assert shared.find(key(1)) is not None
            write(owner, 2)
            os.utime(header, ns=(old, old))  # the same stamp as at our look
            shared.refresh()
            assert shared.find(key(2)) is not None
        finally:
            shared.close()
    finally:
        owner.close()
        own.close()


def sparse_owner(cold: Path, owner: str, slots: int) -> None:
    """An owner's files of ``slots`` slots, as sparse files, holding two
    records (written by a real tier, with its change log)."""
    tier = open_cold(cold, owner, slots=slots, change_log=True)
    write(tier, 0, 1)
    per_device = tier.geometry.per_device
    tier.close()
    names = TierNames((str(cold),), owner)
    os.truncate(names.header, (slots + 1) * HEADER_SIZE)
    os.truncate(names.slabs[0], slots * per_device)


def test_a_refresh_after_one_write_costs_under_10_ms_with_8_owners_of_100k_slots(
    tmp_path: Path, cold_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: a host reading 8 others of 100,000 slots each (400 MB
    header files) used to rescan one whole header file after each write;
    now it reads the log's tail and the one header block."""
    slots = 100_000
    monkeypatch.setattr(shared_module, "REFRESH_S", 3600.0)  # we refresh here
    owners = [f"kv-w0-host{i}" for i in range(8)]
    for owner in owners:
        sparse_owner(cold_dir, owner, slots)
    settings = config(
        cold_dir, capacity_gb=(slots + 1) * (PAYLOAD + HEADER_SIZE) / 2**30
    )
    writer = open_cold(cold_dir, owners[3], slots=slots, change_log=True)
    own = open_cold(cold_dir, "kv-w0-us")
    shared = SharedCold(own, settings, max_payload=PAYLOAD)
    try:
        assert len(shared.tiers()) == 8
        assert shared.find(key(1)) is not None
        for i in range(100, 103):
            write(writer, i)
            cpu = time.process_time()
            shared.refresh()
            took = time.process_time() - cpu
            assert shared.find(key(i)) is not None
            assert took < 0.010, f"{took * 1e3:.1f} ms of CPU"
    finally:
        shared.close()
        own.close()
        writer.close()
