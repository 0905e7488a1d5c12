"""A warm tier too small for the working set over a cold tier in Redis.

Starts its own redis-server on a free loopback port (``apt-get install
redis-server``), stores 4 requests of 8 chunks each through a real LMCache
engine whose warm tier holds 8 chunks, then reads every request 3 times in
turn (the CPU tier emptied before each) and prints the tiers' counters::

    python examples/redis_cold_tier.py [POLICY]     # none (default), lookahead, ...
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time

import torch

from lmcache_tiered import testing
from lmcache_tiered.integration.backend import TieredBackend

CHUNK, CHUNK_BYTES = 256, 256 * 1024  # the harness's tiny model
REQUESTS, CHUNKS, ROUNDS, WARM_CHUNKS = 4, 8, 3, 8


def main(policy: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
        + ["--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        run(policy, port)
    finally:
        redis.kill()
        redis.wait()


def run(policy: str, port: int) -> None:
    extra = {
        "storage_plugin.tiered.module_path": "lmcache_tiered.backend",
        "storage_plugin.tiered.class_name": "TieredBackend",
        "tiered.warm.paths": [tempfile.mkdtemp()],
        "tiered.warm.capacity_gb": WARM_CHUNKS * (CHUNK_BYTES + 4096) / 2**30,
        "tiered.cold.adapter": json.dumps(
            {"type": "resp", "host": "127.0.0.1", "port": port}
        ),
        "tiered.warmup.policy": policy,
    }
    if policy == "lookahead":
        extra["tiered.warmup.lookahead.promote_found"] = True
    config = testing.build_config(
        extra_config=extra, storage_plugins=["tiered"], max_local_cpu_size=1
    )
    engine, connector = testing.build_engine(config)
    backend = testing.get_backends(engine)["tiered"]
    assert isinstance(backend, TieredBackend) and backend.cache is not None
    cache = backend.cache
    requests = []
    for r in range(REQUESTS):
        tokens = testing.make_tokens(CHUNKS * CHUNK, seed=100 + r)
        kv = testing.make_kv(connector, CHUNKS * CHUNK, seed=200 + r)
        testing.store_tokens(engine, tokens, kv)
        cache.flush()
        requests.append((tokens, kv))
    served = identical = 0
    for _ in range(ROUNDS):
        for tokens, kv in requests:
            testing.clear_cpu_tier(engine)
            testing.lookup(engine, tokens)
            time.sleep(0.05)  # the warm-up window
            out, mask = testing.retrieve_tokens(engine, tokens, connector=connector)
            served += int(mask.sum()) // CHUNK
            identical += int(torch.equal(out, kv))
            cache.flush()
    snapshot = cache.snapshot()
    print(
        json.dumps(
            {
                "policy": policy,
                "chunks_served": f"{served} of {REQUESTS * CHUNKS * ROUNDS}",
                "identical_requests": identical,
                "warm": snapshot["tiers"]["warm"] | {"read_latency": None},
                "cold": snapshot["tiers"]["cold"] | {"read_latency": None},
                "promoted_hot_bytes": snapshot["warmup"]["bytes_promoted_hot"],
                "promoted_warm_bytes": snapshot["warmup"]["bytes_promoted_warm"],
            },
            indent=1,
        )
    )
    testing.destroy_all_engines()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "none")
