"""Another host's tier is refreshed from its owner's change log (issue 50):
the owner logs the slots each write batch changed.

Real files and real tiers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.cli import main
from lmcache_tiered.config import TieredConfig
from lmcache_tiered.storage import changes as changes_module
from lmcache_tiered.storage.layout import HEADER_SIZE, TierNames
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.tier import Tier

PAYLOAD = 4096
OWNER = "kv-w0-hostA"


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


def open_cold(
    cold: Path, owner: str = OWNER, *, slots: int = 8, **kwargs: bool
) -> Tier:
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
