"""A shared cold tier a fleet can trust: records under a fleet secret carry a
keyed MAC, and nothing another writer of the directory (or the store) planted
is served; hosts and users outside the allowlists are not read at all."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import cache_of, payload_offset, plugin_extra_config

from lmcache_tiered import testing
from lmcache_tiered.bench.disk import sealcost
from lmcache_tiered.config import ConfigError, TieredConfig
from lmcache_tiered.storage import ownership
from lmcache_tiered.storage.seal import MIN_SECRET_BYTES, RecordSeal, load_seal
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.testing import crash_check

EngineFactory = Callable[..., Any]
CHUNK = 256


def secret_file(path: Path, secret: bytes = b"s" * MIN_SECRET_BYTES) -> Path:
    path.write_bytes(secret)
    path.chmod(0o400)
    return path


def host(
    engine_factory: EngineFactory,
    tmp_path: Path,
    cold: Path,
    name: str,
    **settings: Any,
) -> tuple[Any, Any]:
    """An engine for host ``name`` (own warm directory) writing every chunk
    through to the shared cold directory ``cold``; its connector."""
    warm = tmp_path / f"warm-{name}"
    warm.mkdir()
    extra = plugin_extra_config(
        [warm],
        **{"cold.paths": str(cold), "cold.write": "through", "host_id": name},
        **settings,
    )
    return engine_factory(extra, chunk_size=CHUNK)


def store(engine: Any, connector: Any, tokens: torch.Tensor, seed: int) -> Any:
    kv = testing.make_kv(connector, len(tokens), seed=seed)
    testing.store_tokens(engine, tokens, kv)
    cache_of(engine).flush()
    return kv


def served(engine: Any, connector: Any, tokens: torch.Tensor) -> torch.Tensor | None:
    """What ``engine`` serves for ``tokens`` from the other hosts' files only
    (its own tiers and CPU tier emptied first), or None if not all of it."""
    cache = cache_of(engine)
    cache.shared.refresh()
    testing.clear_cpu_tier(engine)
    for key in testing.chunk_keys(engine, tokens):
        for tier in cache.tiers.values():
            tier.remove(key)
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    return out if int(mask.sum()) == len(tokens) else None


def test_a_forged_record_is_served_without_the_secret_and_refused_with_it(
    engine_factory: EngineFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whoever can write the shared directory plants a record for a key
    anyone can compute (a known prompt's tokens): without a fleet secret a
    host serves the planted bytes as KV; with one it serves only what a host
    holding the secret wrote, and says so once."""
    tokens = testing.make_tokens(2 * CHUNK, seed=7)
    for secret in (False, True):
        cold = tmp_path / f"cold-{secret}"
        cold.mkdir()
        run = tmp_path / f"run-{secret}"
        run.mkdir()
        key = {"cold.auth_key_file": str(secret_file(run / "key"))} if secret else {}
        attacker, attacker_connector = host(engine_factory, run, cold, "evil")
        forged = store(attacker, attacker_connector, tokens, seed=666)
        victim, victim_connector = host(engine_factory, run, cold, "hostb", **key)
        with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
            out = served(victim, victim_connector, tokens)
        foreign = cache_of(victim).shared.tiers()
        if not secret:
            assert out is not None and torch.equal(out, forged)
            continue
        assert out is None
        # refused at each look at its files, logged once
        assert len(foreign) == 1 and foreign[0].stats.unsigned >= 2
        assert sum("records without a MAC" in r.message for r in caplog.records) == 1
        # a host with the secret writes the same key: that record is served
        writer, writer_connector = host(engine_factory, run, cold, "hosta", **key)
        honest = store(writer, writer_connector, tokens, seed=8)
        out = served(victim, victim_connector, tokens)
        assert out is not None and torch.equal(out, honest)


def test_bytes_changed_under_a_sealed_record_are_refused(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    """A sealed record whose payload someone rewrote (its CRC32C fixed up or
    not) fails its MAC: a miss, counted, never the planted bytes."""
    cold = tmp_path / "cold"
    cold.mkdir()
    key = {"cold.auth_key_file": str(secret_file(tmp_path / "key"))}
    writer, writer_connector = host(engine_factory, tmp_path, cold, "hosta", **key)
    tokens = testing.make_tokens(CHUNK, seed=3)
    store(writer, writer_connector, tokens, seed=4)
    reader, reader_connector = host(engine_factory, tmp_path, cold, "hostb", **key)
    cache_of(reader).shared.refresh()
    (foreign,) = cache_of(reader).shared.tiers()
    path, offset = payload_offset(foreign, testing.chunk_keys(reader, tokens)[0])
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x01" * 64)
    assert served(reader, reader_connector, tokens) is None
    assert foreign.stats.unsigned == 1 and foreign.stats.corrupt == 0


def test_hosts_and_users_outside_the_allowlists_are_not_read(
    engine_factory: EngineFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``cold.owners`` names the hosts whose files are read; files owned by a
    user outside ``cold.owner_uids`` (default: our own) are not opened."""
    cold = tmp_path / "cold"
    cold.mkdir()
    tokens = testing.make_tokens(CHUNK, seed=11)
    engine, connector = host(engine_factory, tmp_path, cold, "evil")
    store(engine, connector, tokens, seed=12)
    picky, picky_connector = host(
        engine_factory, tmp_path, cold, "hostb", **{"cold.owners": ["hosta"]}
    )
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        assert served(picky, picky_connector, tokens) is None
        cache_of(picky).shared.refresh()
    assert cache_of(picky).shared.tiers() == []
    assert sum("is not in tiered.cold.owners" in r.message for r in caplog.records) == 1
    if os.geteuid() != 0:
        return  # chown needs root
    for name in os.listdir(cold):
        if "evil" in name:
            os.chown(cold / name, 4242, -1)
    wary, wary_connector = host(engine_factory, tmp_path, cold, "hostc")
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        assert served(wary, wary_connector, tokens) is None
    assert "owned by uid 4242, not by a trusted user" in caplog.text
    trusting, trusting_connector = host(
        engine_factory,
        tmp_path,
        cold,
        "hostd",
        **{"cold.owner_uids": [os.geteuid(), 4242]},
    )
    assert served(trusting, trusting_connector, tokens) is not None


def test_a_secret_file_must_exist_be_long_enough_and_stay_private(
    tmp_path: Path,
) -> None:
    setting = "tiered.cold.auth_key_file"
    with pytest.raises(ConfigError, match=f"{setting}: cannot read .*head -c 32"):
        load_seal(str(tmp_path / "missing"), setting)
    short = secret_file(tmp_path / "short", b"x" * 16)
    with pytest.raises(ConfigError, match="holds 16 bytes, fewer than 32"):
        load_seal(str(short), setting)
    shared = tmp_path / "shared"
    shared.write_bytes(b"x" * 32)
    shared.chmod(0o644)
    with pytest.raises(ConfigError, match="open to other users .*chmod 0400"):
        load_seal(str(shared), setting)
    assert isinstance(load_seal(str(secret_file(tmp_path / "ok")), setting), RecordSeal)


def test_the_allowlists_parse_and_refuse_bad_values(tmp_path: Path) -> None:
    base = {"tiered.warm.paths": [str(tmp_path)]}
    config = TieredConfig.from_extra_config(
        {**base, "tiered.cold.owners": "hosta, hostb", "tiered.cold.owner_uids": [7]}
    )
    assert config.cold_owners == ("hosta", "hostb")
    assert config.cold_owner_uids == frozenset({7})
    default = TieredConfig.from_extra_config(base)
    assert default.cold_owners is None
    assert default.cold_owner_uids == frozenset({os.geteuid()})
    with pytest.raises(ConfigError, match="tiered.cold.owner_uids: must be"):
        TieredConfig.from_extra_config({**base, "tiered.cold.owner_uids": [-1]})
    with pytest.raises(
        ConfigError, match="tiered.cold.owners: an item is listed twice"
    ):
        TieredConfig.from_extra_config({**base, "tiered.cold.owners": "a,a"})


@pytest.fixture
def flock_not_enforced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flock succeeds, as on NFS mounted nolock or Lustre localflock;
    and no heartbeats, so a test says when a record goes stale."""
    monkeypatch.setattr(ownership, "try_lock", lambda fd: True)
    monkeypatch.setattr(Tier, "_renew_lease", lambda self: None)


def open_cold_tier(root: Path) -> Tier:
    for directory in crash_check.DIRS:
        (root / directory).mkdir(exist_ok=True)
    return crash_check.open_tier(root, "cold", verify=True, fsync=False)


def test_a_second_writer_under_one_host_id_refuses_and_names_both(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flock_not_enforced: None,
) -> None:
    """Where flock is not enforced, the owner record in the lock file keeps
    two writers of one owner's files apart: the second does not write while
    the first's record stands; once it is stale, the second takes the files
    and the first stops writing at its next batch. Each names both."""
    first = open_cold_tier(tmp_path)
    assert first.write_payloads([crash_check.payload(1, 0)]) == [True]
    me = f"process {os.getpid()} on {socket.gethostname()}"
    monkeypatch.setattr(ownership.socket, "gethostname", lambda: "other-host")
    second = open_cold_tier(tmp_path)
    assert second.degraded is not None
    assert f"names {me} as the writer" in second.degraded
    assert f"this is process {os.getpid()} on other-host" in second.degraded
    assert second.write_payloads([crash_check.payload(2, 0)]) == [False]
    assert second._recover() is None  # the first's record still stands
    assert first.write_payloads([crash_check.payload(3, 0)]) == [True]
    # the first stops renewing (a hung host): its record goes stale
    lease = first.files.lease
    assert lease is not None
    old = dataclasses.replace(lease.me, heartbeat_ns=time.time_ns() - 60 * 10**9)
    lock = os.open(lease.name, os.O_WRONLY)
    os.pwrite(lock, old.encode(), 0)
    os.close(lock)
    assert second._recover() is not None  # took the files, read them afresh
    assert len(second) == 2
    assert first.write_payloads([crash_check.payload(4, 0)]) == [False]
    assert first.degraded is not None
    assert "names process" in first.degraded and "on other-host" in first.degraded
    first.close()
    second.close()


def test_a_record_left_by_a_dead_process_of_this_host_is_taken_at_once(
    tmp_path: Path, flock_not_enforced: None
) -> None:
    """A restart after a crash finds its predecessor's fresh record: a
    process of this host that is gone, so the files are taken at once."""
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True)
    tier = open_cold_tier(tmp_path)
    lease = tier.files.lease
    assert lease is not None
    crashed = dataclasses.replace(
        lease.me, pid=int(dead.stdout), heartbeat_ns=time.time_ns()
    )
    tier.close()
    lock = os.open(lease.name, os.O_WRONLY)
    os.pwrite(lock, crashed.encode(), 0)
    os.close(lock)
    again = open_cold_tier(tmp_path)
    assert again.degraded is None
    assert again.files.lease is not None and again.files.lease.read() is not None
    again.close()


def test_the_seal_cost_benchmark_reads_every_variant(tmp_path: Path) -> None:
    """The benchmark behind docs/design.md's MAC figures runs end to end."""
    table = sealcost.run([str(tmp_path)], total_gb=0.01, chunk_mb=1, rounds=1)
    assert list(table.columns[0].cells) == list(sealcost.VARIANTS)
    assert all(float(gbps) > 0 for gbps in table.columns[1].cells)
