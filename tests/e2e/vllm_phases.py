"""Helpers of the end-to-end tests (the test side): the prompts, the
environment of a vLLM phase, running one (:mod:`phase` in a subprocess),
LMCache's YAML for TieredBackend. Fixtures are in conftest.py."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: LMCache's chunk size in these tests (its default)
CHUNK = 256
#: the prompts: lengths not multiples of CHUNK, so each ends in a partial chunk
PROMPT_LENGTHS = (1100, 800)
#: the tokens vLLM must not compute after a restart: every full chunk
CACHED = [n // CHUNK * CHUNK for n in PROMPT_LENGTHS]
MAX_TOKENS = 16
#: how long stores may take to land after vLLM's requests finished
CHUNK_COUNT_TIMEOUT_S = 30
#: wall time of each phase (printed at the end of the run)
PHASE_TIMES: list[tuple[str, float]] = []


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 1024) for _ in range(n)] for n in PROMPT_LENGTHS]


def full_chunks() -> int:
    """Chunks LMCache stores and serves for the prompts (full ones only)."""
    return sum(n // CHUNK for n in PROMPT_LENGTHS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def phase_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "VLLM_PLUGINS",
            "LMCACHE_TIERED_HINT_URL",
            "LMCACHE_TIERED_PREFETCH_URL",
            "LMCACHE_CONFIG_FILE",
        )
    }
    env.update(
        PYTHONHASHSEED="0",
        # LLM runs the engine in this process (the in-process LMCache path
        # under test); AsyncLLM always has an engine-core process
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        # collective_rpc sends the report functions of phase.py to the worker
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        # the package e2e: phase.py and the connector (e2e.cpu_kv)
        PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]),
        LMCACHE_TRACK_USAGE="false",
        VLLM_NO_USAGE_STATS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def run_phase(
    name: str,
    workdir: Path,
    spec: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> tuple[dict[str, Any], str]:
    """Run one vLLM phase (phase.py) to its end; its result and its log."""
    spec_path = workdir / f"{name}.json"
    out = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec = {"max_tokens": MAX_TOKENS, "prompts": prompts(), **spec, "out": str(out)}
    spec_path.write_text(json.dumps(spec))
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "phase.py"), str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or phase_env(),
            timeout=timeout,
        )
    PHASE_TIMES.append((name, time.monotonic() - started))
    text = log_path.read_text()
    assert proc.returncode == 0, f"phase {name} failed:\n{text[-6000:]}"
    assert "lmcache_tiered e2e: exit hooks done" in text, text[-3000:]
    result = json.loads(out.read_text())
    # vLLM's plugins are on in every phase, ours among them
    assert "lmcache_tiered_hints" in result["plugins"]
    return result, text


def lmcache_yaml(path: Path, **tiered: Any) -> Path:
    """An LMCache config with TieredBackend (``tiered.*`` settings)."""
    extra = {
        "storage_plugin.tiered.module_path": "lmcache_tiered.backend",
        "storage_plugin.tiered.class_name": "TieredBackend",
        "tiered.warmup.policy": "none",
        **{f"tiered.{k}": v for k, v in tiered.items()},
    }
    config = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.25,
        "storage_plugins": ["tiered"],
        "extra_config": extra,
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path
