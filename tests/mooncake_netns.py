"""The cold tier on a real Mooncake pool (mooncake_master and a
mooncake_client holding its memory, on loopback) through our connector.

Not collected by itself: every Mooncake process and client also listens on
all addresses, so tests/test_mooncake.py runs this module in a network
namespace of its own with only loopback up, and this module refuses to run
anywhere else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import store_chunks, wait_until
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.storage_manager import StorageManager
from test_bench import SMALL, write_trace
from test_bench import mooncake as mooncake_request
from test_mp import LAYOUT, okey, params, plugin_json, prefetch
from test_mpbench import check_store_contender
from test_store_tier import (
    _HOST,
    CHUNK,
    lookups_during,
    served_from_the_store_again,
    store_engine,
)

from lmcache_tiered import cli, testing
from lmcache_tiered.bench.disk import mpbench
from lmcache_tiered.config import ConfigError, TieredConfig
from lmcache_tiered.integration.mp import TieredL2Adapter
from lmcache_tiered.keys import key_digest
from lmcache_tiered.storage import adapter_tier, mooncake, store_client
from lmcache_tiered.storage.adapter_tier import AdapterTier
from lmcache_tiered.storage.store_client import (
    HEADER_GROUP,
    PAYLOAD_GROUP,
    StoreClient,
    build_adapter,
    object_key,
)
from lmcache_tiered.testing import netns
from lmcache_tiered.testing.mooncake import MooncakePool
from lmcache_tiered.testing.ports import free_port

#: set by tests/test_mooncake.py in the namespace it runs this module in
NETNS_ENV = "LMCACHE_TIERED_MOONCAKE_NETNS"
if os.environ.get(NETNS_ENV) != "1" or not netns.isolated():
    pytest.skip(
        "Mooncake listens on all addresses: tests/test_mooncake.py runs this "
        "module in a network namespace of its own",
        allow_module_level=True,
    )

EngineFactory = Callable[..., Any]
#: Mooncake's RPC and transfer timeouts in these tests (seconds)
MOONCAKE_TIMEOUT_S = 1.0
#: the master's lease on an object after a read (its default: 10 s)
LEASE_MS = 1500
#: seconds the master keeps a memory process that stopped answering (10 s)
CLIENT_TTL_S = 4
#: bytes of one chunk of test_mp's LAYOUT (its groups: 2x4x1000 bf16, 3x7 f32)
LAYOUT_BYTES = 2 * 4 * 1000 * 2 + 3 * 7 * 4
#: the cold tier's own timeout in these tests
TIER_TIMEOUT_S = 3.0


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[MooncakePool]:
    """The pool, stopped after the engines (ask for it before them)."""
    servers = MooncakePool(
        tmp_path / "mooncake", lease_ms=LEASE_MS, client_ttl_s=CLIENT_TTL_S
    )
    yield servers
    servers.stop()
    mooncake.close_pools()


def spec(pool: MooncakePool) -> dict[str, Any]:
    return pool.spec(timeout_s=MOONCAKE_TIMEOUT_S)


def in_pool(pool: MooncakePool, objects: list[Any]) -> list[bool]:
    """Whether each object is in the pool, asked through a client of its own
    (polled: an adapter a storage manager drives has its event fds read by
    the manager's threads)."""
    adapter = build_adapter(spec(pool))
    try:
        task = adapter.submit_lookup_and_lock_task(objects, {})
        held = store_client.answer(
            lambda: adapter.query_lookup_and_lock_result(task), 10
        )
        adapter.submit_unlock(objects)
        return [bool(held.test(i)) for i in range(len(objects))]
    finally:
        adapter.close()


def present(pool: MooncakePool, keys: list[Any]) -> list[bool]:
    """Whether each of our chunks is whole in the pool (payload and header)."""
    groups = (PAYLOAD_GROUP, HEADER_GROUP)
    objects = [object_key(key_digest(k), g) for k in keys for g in groups]
    found = in_pool(pool, objects)
    return [found[2 * i] and found[2 * i + 1] for i in range(len(keys))]


@pytest.fixture
def short_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_client, "TIMEOUT_S", TIER_TIMEOUT_S)
    monkeypatch.setattr(adapter_tier, "PROBE_S", 0.5)


# --------------------------------------------------------------- settings


def test_bad_settings_are_named_with_their_fix(
    tmp_path: Path, pool: MooncakePool
) -> None:
    base = {"tiered.warm.paths": [str(tmp_path)]}

    def tier(**adapter_params: Any) -> AdapterTier:
        cold = spec(pool)
        cold["adapter_params"] = adapter_params
        settings = TieredConfig.from_extra_config(base | {"tiered.cold.adapter": cold})
        return AdapterTier(settings, max_payload=4096)

    address = pool.master_address
    with pytest.raises(ConfigError, match="adapter_params.local_hostname: missing"):
        tier(master_server_address=address)
    with pytest.raises(ConfigError, match="192.0.2.1' is not an address of this host"):
        tier(master_server_address=address, local_hostname="192.0.2.1")
    with pytest.raises(ConfigError, match="unknown replicas .* it takes master_"):
        tier(master_server_address=address, local_hostname="127.0.0.1", replicas=2)
    with pytest.raises(ConfigError, match="protocol: 'rdma' is not supported"):
        tier(master_server_address=address, local_hostname="127.0.0.1", protocol="rdma")
    # no master there: Mooncake's setup would retry for 90 s
    nobody = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(
        ConnectionError, match=f"no Mooncake master answers at {nobody}"
    ):  # noqa: E501
        tier(master_server_address=nobody, local_hostname="127.0.0.1")
    assert time.monotonic() - started < 5
    with pytest.raises(ConnectionError, match="fix adapter_params.master_server_addr"):
        tier(master_server_address=nobody, local_hostname="127.0.0.1")
    with pytest.raises(ConfigError, match="master_server_address: expected host:port"):
        tier(master_server_address="localhost", local_hostname="127.0.0.1")


# ------------------------------------------------- the connector on its own


def storage_manager(l2_adapter: dict[str, Any] | str) -> StorageManager:
    """LMCache's MP storage manager, built like ``lmcache server``'s from
    its ``--l2-adapter`` JSON."""
    text = l2_adapter if isinstance(l2_adapter, str) else json.dumps(l2_adapter)
    l2 = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[text]))
    memory = L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False)
    return StorageManager(
        StorageManagerConfig(
            l1_manager_config=L1ManagerConfig(memory_config=memory),
            eviction_config=EvictionConfig("LRU"),
            l2_adapter_config=l2,
        )
    )


def write_l1(
    manager: StorageManager, keys: list[Any], stored: Callable[[], bool]
) -> dict[Any, bytes]:
    """Write ``keys`` into L1 (random bytes), wait until ``stored()`` says
    the store controller put them in L2, then drop them from L1."""
    objs = manager.reserve_write(keys, LAYOUT)
    gen = torch.Generator().manual_seed(len(keys))
    for obj in objs.values():
        obj.raw_data[: obj.get_size()].copy_(
            torch.randint(0, 256, (obj.get_size(),), dtype=torch.uint8, generator=gen)
        )
    want = {k: bytes(o.byte_array) for k, o in objs.items()}
    manager.finish_write(keys)
    wait_until(stored, timeout=20)
    deleted = 0
    deadline = time.monotonic() + 20
    while deleted < len(keys):  # L1 read locks go once the store is reported
        assert time.monotonic() < deadline, "L1 kept the keys"
        deleted += manager.delete_l1_keys(keys)[0]
        time.sleep(0.02)
    return want


def test_the_connector_alone_is_an_l2_adapter_of_lmcache_server(
    pool: MooncakePool,
) -> None:
    """``lmcache server --l2-adapter`` with the native_plugin JSON alone:
    L1 -> Mooncake, served back exact, by a restarted server too; an
    upsert replaces the bytes; a delete right after a read waits for the
    read's lease (LEASE_MS) and then happens."""
    keys = [okey(i, model="mooncake/alone") for i in range(4)]
    manager = storage_manager(spec(pool))
    try:
        ((_, adapter),) = manager.l2_adapters()
        assert type(adapter).__name__ == "NativeConnectorL2Adapter"
        want = write_l1(manager, keys, lambda: all(in_pool(pool, keys)))
        assert prefetch(manager, keys) == want
    finally:
        manager.close()
    manager = storage_manager(spec(pool))  # restarted: served from the pool
    try:
        assert prefetch(manager, keys) == want
    finally:
        manager.close()
    client = StoreClient(build_adapter(spec(pool)))
    try:
        size = len(want[keys[0]])
        new = torch.randint(0, 256, (size,), dtype=torch.uint8)
        assert client.store(keys[:1], [new])
        back = torch.zeros(size, dtype=torch.uint8)
        assert client.load(keys[:1], [back]) == [True]
        assert torch.equal(back, new)  # upserted, not the old bytes kept
        client.adapter.delete(keys[:2])  # the first read just now: leased
        assert in_pool(pool, keys[:1]) == [True]  # kept while its lease holds
        wait_for_leased_deletes(pool, keys, [False, False, True, True])
    finally:
        client.adapter.close()


def wait_for_leased_deletes(
    pool: MooncakePool, keys: list[Any], wanted: list[bool]
) -> None:
    """Until ``in_pool(keys)`` is ``wanted`` (10 s at most): deletes refused
    for a lease are retried. A lookup leases its objects too: ask less often
    than the lease lasts."""
    deadline = time.monotonic() + 10
    while in_pool(pool, keys) != wanted:
        assert time.monotonic() < deadline, "the leased deletes never happened"
        time.sleep(LEASE_MS / 1000 + 0.5)


# ---------------------------------------------------- the cold tier on it


def test_warm_evictions_go_to_mooncake_and_a_new_engine_is_served(
    pool: MooncakePool, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    adapter = json.dumps(spec(pool))
    engine, connector, cache = store_engine(engine_factory, tmp_path / "a", adapter)
    first, first_kv = store_chunks(engine, connector, 2, seed=1)
    second, second_kv = store_chunks(engine, connector, 2, seed=11)
    first_keys = testing.chunk_keys(engine, first)
    assert [cache.tier_of(k) for k in first_keys] == ["cold", "cold"]
    assert present(pool, first_keys) == [True, True]
    cold = cache.tiers["cold"]
    assert cold.engine_name == "l2:native_plugin"
    testing.clear_cpu_tier(engine)
    out, mask = testing.retrieve_tokens(engine, first, connector=connector)
    assert int(mask.sum()) == 2 * CHUNK and torch.equal(out, first_kv)
    assert cold.stats.hits == 2
    cache.flush()  # the cold hits went up to warm, demoting the second pair
    assert present(pool, testing.chunk_keys(engine, second)) == [True, True]
    testing.destroy_all_engines()

    engine, connector, cache = store_engine(engine_factory, tmp_path / "b", adapter)
    assert testing.lookup(engine, second) == 2 * CHUNK
    out, mask = testing.retrieve_tokens(engine, second, connector=connector)
    assert int(mask.sum()) == 2 * CHUNK and torch.equal(out, second_kv)
    assert cache.tiers["cold"].stats.hits == 2


def test_two_hosts_share_the_pool(tmp_path: Path, pool: MooncakePool) -> None:
    """Two processes (two Mooncake clients) with different host ids: one
    stores, the other is served."""

    def host(role: str, name: str) -> str:
        warm = tmp_path / name
        warm.mkdir()
        script = _HOST.format(
            tests=str(Path(__file__).parent),
            warm=str(warm),
            adapter=json.dumps(spec(pool)),
            host=name,
            role=role,
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    assert host("writer", "host-a") == "stored"
    assert host("reader", "host-b") == f"hits {3 * CHUNK} {3 * CHUNK} True 3"


# ----------------------------------------------------------------- faults


def two_chunks_in_mooncake(
    engine_factory: EngineFactory, tmp_path: Path, pool: MooncakePool
) -> tuple[Any, Any, Any, AdapterTier, torch.Tensor, torch.Tensor]:
    engine, connector, cache = store_engine(
        engine_factory, tmp_path / "a", json.dumps(spec(pool))
    )
    first, first_kv = store_chunks(engine, connector, 2, seed=1)
    store_chunks(engine, connector, 2, seed=11)
    keys = testing.chunk_keys(engine, first)
    assert [cache.tier_of(k) for k in keys] == ["cold", "cold"]
    cold = cache.tiers["cold"]
    assert isinstance(cold, AdapterTier)
    return engine, connector, cache, cold, first, first_kv


def retrieve_misses(engine: Any, connector: Any, tokens: torch.Tensor) -> float:
    """Retrieve ``tokens`` from an emptied CPU tier: nothing served (never
    wrong bytes); how long it took."""
    testing.clear_cpu_tier(engine)
    started = time.monotonic()
    _, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == 0
    return time.monotonic() - started


def down_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for r in caplog.records if ") down since" in (m := r.getMessage())]


def lost_are_counted(engine: Any, cold: AdapterTier, tokens: torch.Tensor) -> None:
    """Chunks the pool lost are misses, counted as such."""
    keys = testing.chunk_keys(engine, tokens)
    misses = cold.stats.misses
    cold.discover(keys)
    assert cold.read_payloads(keys) == [None, None]
    assert cold.stats.misses == misses + 2


def test_master_killed_misses_at_once_and_is_served_again_when_back(
    pool: MooncakePool,
    engine_factory: EngineFactory,
    tmp_path: Path,
    short_timeouts: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, connector, cache, cold, first, _ = two_chunks_in_mooncake(
        engine_factory, tmp_path, pool
    )
    caplog.set_level(logging.WARNING, logger="lmcache_tiered")
    pool.kill("master")
    # lookups of chunks the tier does not know ask the pool: the first finds
    # the master gone (Mooncake answers at once), the rest are misses at once
    latencies, states = lookups_during(engine, cold, 2.0, seed=2000)
    assert max(latencies) < TIER_TIMEOUT_S, latencies
    assert states[0] is not None and all(s is not None for s in states)
    assert sorted(latencies)[int(0.99 * (len(latencies) - 1))] <= 0.05, latencies
    assert retrieve_misses(engine, connector, first) < TIER_TIMEOUT_S
    (line,) = down_lines(caplog)
    assert f"Mooncake pool (master {pool.master_address}) unreachable" in line
    pool.start_master()  # empty: the pool's memory re-registers with it
    wait_until(lambda: cold.degraded is None, timeout=30)
    lost_are_counted(engine, cold, first)
    served_from_the_store_again(engine, connector, cache, seed=21)
    assert cold.stats.degradations == 1


def test_memory_process_stopped_then_killed(
    pool: MooncakePool,
    engine_factory: EngineFactory,
    tmp_path: Path,
    short_timeouts: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The mooncake_client holding the pool's memory: stopped (SIGSTOP, data
    kept), then killed and started again (empty). Each time: misses, the
    first read within Mooncake's timeout and the rest at once, one line;
    served again once it is back."""
    engine, connector, cache, cold, first, first_kv = two_chunks_in_mooncake(
        engine_factory, tmp_path, pool
    )
    caplog.set_level(logging.WARNING, logger="lmcache_tiered")
    assert pool.memory is not None
    pool.memory.send_signal(signal.SIGSTOP)
    try:
        assert retrieve_misses(engine, connector, first) < TIER_TIMEOUT_S
        assert cold.degraded is not None
        assert retrieve_misses(engine, connector, first) < 0.5  # known down
    finally:
        pool.memory.send_signal(signal.SIGCONT)
    wait_until(lambda: cold.degraded is None, timeout=30)
    assert len(down_lines(caplog)) == 1
    testing.clear_cpu_tier(engine)
    assert testing.lookup(engine, first) == 2 * CHUNK  # kept: found again
    out, mask = testing.retrieve_tokens(engine, first, connector=connector)
    assert int(mask.sum()) == 2 * CHUNK and torch.equal(out, first_kv)

    again, _ = store_chunks(engine, connector, 2, seed=31)
    store_chunks(engine, connector, 2, seed=41)  # demotes ``again`` to the pool
    caplog.clear()
    pool.kill("memory")
    assert retrieve_misses(engine, connector, again) < TIER_TIMEOUT_S
    wait_until(lambda: cold.degraded is not None, timeout=5)
    assert retrieve_misses(engine, connector, again) < 0.5
    # a new memory process serves once the master has dropped the lost one
    # (its -client_ttl): before that, writes the master places there fail
    time.sleep(CLIENT_TTL_S + 1)
    pool.start_memory()  # empty
    wait_until(lambda: cold.degraded is None, timeout=40)
    assert len(down_lines(caplog)) == 1
    lost_are_counted(engine, cold, again)
    served_from_the_store_again(engine, connector, cache, seed=51)


# --------------------------------------------------- the multi-process road


def test_lmcache_server_with_our_adapter_cold_on_mooncake_store_restart_serve(
    tmp_path: Path, pool: MooncakePool
) -> None:
    """``lmcache server`` with TieredL2Adapter whose cold tier is the pool
    (``cold.adapter`` in adapter_params, written through): store, restart
    with an empty warm tier, and every chunk is served from Mooncake."""
    keys = [okey(i, model="mooncake/tiered") for i in range(4)]
    slot_mb = LAYOUT_BYTES / 2**20  # else a server with an empty warm tier
    # opens no tiers until its first store

    def server(name: str) -> tuple[StorageManager, TieredL2Adapter]:
        warm = tmp_path / name
        warm.mkdir()
        cold = {"cold.adapter": spec(pool), "cold.write": "through"}
        settings = params([warm], slot_mb=slot_mb, **cold)
        manager = storage_manager(plugin_json(settings))
        ((_, adapter),) = manager.l2_adapters()
        assert isinstance(adapter, TieredL2Adapter)
        return manager, adapter

    manager, adapter = server("a")
    try:
        want = write_l1(
            manager,
            keys,
            lambda: adapter.cache is not None and len(adapter.cache.tiers["cold"]) == 4,
        )
    finally:
        manager.close()
    manager, adapter = server("b")
    try:
        assert prefetch(manager, keys) == want
        assert adapter.cache is not None
        status = adapter.report_status()["tiers"]["cold"]
        assert status["engine"] == "l2:native_plugin" and status["hits"] == 4
    finally:
        manager.close()


def test_a_real_lmcache_server_starts_on_the_pool(
    tmp_path: Path, pool: MooncakePool
) -> None:
    """``lmcache server --l2-adapter`` (the real CLI, its own process) with
    the connector alone, then with TieredL2Adapter whose cold tier is the
    pool: each starts and its ``/status`` shows the adapter healthy."""
    warm = tmp_path / "warm"
    warm.mkdir()
    tiered = {
        "type": "plugin",
        "module_path": "lmcache_tiered.mp",
        "class_name": "TieredL2Adapter",
        "adapter_params": params([warm], slot_mb=1, **{"cold.adapter": spec(pool)}),
    }
    for l2_adapter, wanted in ((spec(pool), "MooncakeConnector"), (tiered, None)):
        http = free_port()
        argv = [
            str(Path(sys.executable).with_name("lmcache")), "server",
            "--host", "127.0.0.1", "--port", str(free_port()),
            "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
            "--http-port", str(http), "--prometheus-port", str(free_port()),
            "--l2-adapter", json.dumps(l2_adapter),
        ]  # fmt: skip
        with open(tmp_path / "server.log", "ab") as log:
            server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            status = server_status(server, http, tmp_path / "server.log")
            (adapter,) = status["storage_manager"]["l2_adapters"]
            assert adapter["is_healthy"] is True
            if wanted is not None:
                assert adapter["type"] == wanted
            else:
                assert adapter["type"] == "TieredL2Adapter"
                assert adapter["tiers"]["cold"]["engine"] == "l2:native_plugin"
                assert adapter["tiers"]["cold"]["degraded"] is None
        finally:
            server.terminate()
            server.wait(30)


def server_status(server: subprocess.Popen[bytes], port: int, log: Path) -> Any:
    """The server's ``/status`` once it answers (within 60 s)."""
    deadline = time.monotonic() + 60
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            with direct.open(f"http://127.0.0.1:{port}/status", timeout=2) as answer:
                return json.loads(answer.read())
        except OSError:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)


# ------------------------------------------------------ the benchmarks on it


def test_bench_runs_with_the_pool_json_as_its_cold_adapter(
    tmp_path: Path, pool: MooncakePool, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench --cold-adapter '<the connector's JSON>'`` (a pool the user
    runs): no CPU tier, a warm tier of 3 chunks; A's chunks go to the pool
    and its follow-up turns are served from it."""
    warm = tmp_path / "warm"
    warm.mkdir()
    chunk = 256 * 128  # tokens x KV bytes per token of SMALL
    a, c = list(range(1, 7)), list(range(20, 26))
    requests = [
        mooncake_request(0, 6 * 512, a),
        mooncake_request(1_000, 6 * 512, c),
        mooncake_request(2_000, 6 * 512 + 300, [*a, 9]),
    ]
    trace_path = write_trace(tmp_path / "t.jsonl", requests)
    out = tmp_path / "r.json"
    argv = ["bench", "--trace", str(trace_path), *SMALL, "--warm", str(warm)]
    argv += ["--cold-adapter", json.dumps(spec(pool)), "--hot-gb", "0"]
    argv += ["--warm-gb", str(3 * (chunk + 4096) / 2**30), "--concurrency", "1"]
    argv += ["--policies", "none", "--no-baseline", "--plot", "none", "--jobs", "1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    assert "cold on a real MooncakeConnector store" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["config"]["cold_adapter"] == spec(pool)
    cold = document["policies"]["none"]["backend_metrics"]["tiers"]["cold"]
    assert cold["bytes_written"] > 0 and cold["hits"] > 0 and cold["misses"] == 0


def test_the_pool_as_a_diskbench_contender_reads_exact_and_is_left_empty(
    pool: MooncakePool,
) -> None:
    """diskbench's store contender on the connector: every chunk found by a
    new client, loaded byte-exact into the arena, deleted afterwards."""
    arena = mpbench.Arena(1 << 20, 12 << 20)  # 12 chunks
    (store,) = mpbench.store_contenders([spec(pool)], arena)
    assert store.name == "store_mooncakeconnector"
    assert store.store and store.dirs == []
    check_store_contender(store)
    wait_for_leased_deletes(pool, arena.keys, [False] * len(arena.keys))
