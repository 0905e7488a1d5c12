"""The cold tier on a three-node Redis Cluster (Debian's redis-server on
loopback ports, no replicas) through LMCache's ``valkey`` L2 adapter in
cluster mode (the valkey-glide-sync client), behind a real LMCache engine."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_store_tier
import torch
from conftest import store_chunks, wait_until
from test_store_tier import CHUNK, EngineFactory, Redis, store_engine

from lmcache_tiered import testing
from lmcache_tiered.keys import key_digest
from lmcache_tiered.storage import adapter_tier, store_client
from lmcache_tiered.storage.adapter_tier import AdapterTier
from lmcache_tiered.testing.ports import free_port

pytestmark = test_store_tier.pytestmark


class Cluster:
    """Three cluster-enabled redis-servers, the slots split over them by
    ``redis-cli --cluster create``. A node gone leaves the others serving
    their slots (``cluster-require-full-coverage no``, as a cache wants)."""

    def __init__(self, tmp: Path) -> None:
        self.nodes: list[Redis] = []
        try:
            for i in range(3):
                self.nodes.append(
                    Redis(
                        *("--cluster-enabled", "yes"),
                        # the bus port is port + 10000 unless set: maybe > 65535
                        *("--cluster-port", str(free_port())),
                        *("--cluster-config-file", str(tmp / f"nodes-{i}.conf")),
                        *("--cluster-node-timeout", "1000"),
                        *("--cluster-require-full-coverage", "no"),
                    )
                )
            subprocess.run(
                ["redis-cli", "--cluster", "create", *self.addresses]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                check=True,
                timeout=60,
            )
            wait_until(self.ok, timeout=30)
        except BaseException:
            self.stop()
            raise

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{node.port}" for node in self.nodes]

    def ok(self) -> bool:
        return all(
            "cluster_state:ok" in node.cli("cluster", "info") for node in self.nodes
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def owner(self, name: str) -> Redis:
        """The node serving the slot of object ``name``."""
        asked = next(n for n in self.nodes if n.proc is not None)  # one that runs
        slot = int(asked.cli("cluster", "keyslot", name))
        for line in asked.cli("cluster", "nodes").splitlines():
            fields = line.split()  # id ip:port@bus flags ... slot spans from 8 on
            for span in fields[8:]:
                low, _, high = span.partition("-")
                if int(low) <= slot <= int(high or low):
                    port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                    return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no node serves slot {slot}")

    @property
    def adapter(self) -> str:
        return json.dumps(
            {
                "type": "valkey",
                "startup_nodes": ",".join(self.addresses),
                "cluster_mode": True,
                "num_workers": 2,
            }
        )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    server = Cluster(tmp_path)
    yield server
    server.stop()


def names(digest: bytes) -> list[str]:
    """The store's names of a chunk's payload and header objects."""
    return [f"{store_client.NAMESPACE}@00000000@{g}@{digest.hex()}" for g in (0, 1)]


def test_chunks_spread_over_the_cluster_and_a_lost_node_is_a_miss_of_its_own(
    cluster: Cluster,  # first: stopped after the engines are
    engine_factory: EngineFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Demotion spreads chunks over the nodes; a new engine is served from
    them; a node killed is a miss of the chunks with an object on it (never a
    hang, never wrong bytes), the tier's check passing on the other nodes."""
    monkeypatch.setattr(adapter_tier, "PROBE_S", 0.5)
    engine, connector, cache = store_engine(
        engine_factory, tmp_path / "a", cluster.adapter
    )
    assert cache.tiers["cold"].engine_name == "l2:valkey"
    store = cache.tiers["cold"]
    assert isinstance(store, AdapterTier)
    probes = [names(k.chunk_hash)[0] for k in store.probe_keys]
    probe = probes[0]  # the one the prober tries first
    # eight one-chunk requests; warm holds two, so six are demoted
    requests = [store_chunks(engine, connector, 1, seed=10 * i) for i in range(8)]
    keys = [testing.chunk_keys(engine, tokens)[0] for tokens, _ in requests]
    assert [cache.tier_of(k) for k in keys] == ["cold"] * 6 + ["warm"] * 2
    held = {n.port: set(n.objects()) - set(probes) for n in cluster.nodes}
    cold = {name for key in keys[:6] for name in names(key_digest(key))}
    assert set().union(*held.values()) == cold  # every object, once
    assert sum(len(v) for v in held.values()) == len(cold)
    assert sum(1 for v in held.values() if v) > 1  # on more than one node
    testing.destroy_all_engines()

    # a new engine with an empty warm tier is served from the cluster
    engine, connector, cache = store_engine(
        engine_factory, tmp_path / "b", cluster.adapter
    )
    for tokens, kv in requests[:6]:
        assert testing.lookup(engine, tokens) == CHUNK
        out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
        assert int(mask.sum()) == CHUNK and torch.equal(out, kv)
    assert cache.tiers["cold"].stats.hits == 6
    testing.destroy_all_engines()

    # a node gone: the chunks with an object on it miss, the others are served
    # (the node serving this process's probe object stays: see below)
    alive = cluster.owner(probe)
    victim = next(n for n in cluster.nodes if n is not alive and held[n.port])
    victim.stop()
    lost = [bool(set(names(key_digest(k))) & held[victim.port]) for k in keys[:6]]
    assert any(lost) and not all(lost)
    engine, connector, cache = store_engine(
        engine_factory, tmp_path / "c", cluster.adapter
    )
    cold_tier = cache.tiers["cold"]
    for (tokens, kv), gone in zip(requests[:6], lost, strict=True):
        started = time.monotonic()
        found = testing.lookup(engine, tokens)
        out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
        # never a hang: a lookup and a read, each within the tier's timeout
        assert time.monotonic() - started < 2 * store_client.TIMEOUT_S
        if gone:  # its header or payload was on the lost node
            assert int(mask.sum()) == 0
        else:
            assert found == CHUNK
            assert int(mask.sum()) == CHUNK and torch.equal(out, kv)
    # glide fails each key of the lost slots alone: misses, not the tier's fault
    assert cold_tier.degraded is None
    assert cold_tier.stats.hits == lost.count(False)

    # the node of the probe object tried first gone instead: the prober turns
    # to its other probe objects, so the tier stays up if one of them lives
    # on another node (which nodes they land on is fixed by their names)
    victim.start()  # back, empty (no persistence), in the same cluster
    wait_until(cluster.ok, timeout=30)
    # objects gone: the victim's (it came back empty) and now alive's
    gone = held[victim.port] | set(alive.objects())
    alive.stop()
    up = [n for n in cluster.nodes if n is not alive]
    elsewhere = any(cluster.owner(name) is not alive for name in probes)
    if elsewhere:
        time.sleep(4 * adapter_tier.PROBE_S + 2 * store_client.TIMEOUT_S)
        assert cold_tier.degraded is None  # several checks have run meanwhile
    else:  # all four on the lost node (1 in 27): the check fails, as it must
        wait_until(lambda: cold_tier.degraded is not None, timeout=20)
        assert cold_tier.degraded.startswith("down since ")
    assert all("cluster_state:ok" in n.cli("cluster", "info") for n in up)
    testing.clear_cpu_tier(engine)
    for (tokens, kv), key in zip(requests[:6], keys[:6], strict=True):
        if cache.tier_of(key) == "warm":
            continue
        on_lost = bool(set(names(key_digest(key))) & gone)
        started = time.monotonic()
        found = testing.lookup(engine, tokens)
        out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
        assert time.monotonic() - started < 2 * store_client.TIMEOUT_S
        if not elsewhere:  # degraded: a miss, whatever the index says
            assert int(mask.sum()) == 0
        elif on_lost:  # a miss, unless written again since (then exact)
            assert int(mask.sum()) == 0 or torch.equal(out, kv)
        else:
            assert found == CHUNK and int(mask.sum()) == CHUNK
            assert torch.equal(out, kv)
    alive.start()
    wait_until(cluster.ok, timeout=30)
    wait_until(lambda: cold_tier.degraded is None, timeout=30)
    # demotion resumes: a chunk is demoted by the two stored after it. A
    # write to the node just back can fail at first (the victim then stays in
    # warm and the newer chunk is refused), so a few fresh trios may be needed
    more: list[tuple[torch.Tensor, torch.Tensor]] = []
    seeds = iter(range(100, 10_000, 30))

    def demoted() -> bool:
        first = next(seeds)
        more[:] = [
            store_chunks(engine, connector, 1, seed=first + 10 * i) for i in range(3)
        ]
        tokens = more[0][0]
        return cache.tier_of(testing.chunk_keys(engine, tokens)[0]) == "cold"

    wait_until(demoted, timeout=30)
    testing.clear_cpu_tier(engine)
    tokens, kv = more[0]
    out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
    assert int(mask.sum()) == CHUNK and torch.equal(out, kv)
