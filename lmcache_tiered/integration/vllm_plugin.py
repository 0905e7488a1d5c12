"""vLLM wiring: send each new request's prompt token ids ahead of its lookup.

vLLM's scheduler asks LMCache what is cached only when a request is about to
be scheduled; under load a request waits in the queue before that. Its
prompt is known earlier, in the API server, and this plugin forwards it
(:mod:`lmcache_tiered.integration.hint_targets`):

* in-process plugin: to :class:`~lmcache_tiered.warmup.hints.HintServer`
  (``tiered.warmup.hint_port``), so the ``hinted`` policy promotes the cached
  prefix while it waits::

    LMCACHE_TIERED_HINT_URL=http://127.0.0.1:PORT/hint vllm serve ...

  With tensor parallelism each worker's backend holds its own shard of every
  chunk and serves its own endpoint: list them all, comma-separated.
* ``lmcache server`` (multi-process road): to the server's warm prefetch,
  which loads the prompt's chunks from L2 (our tiers) into its L1::

    LMCACHE_TIERED_PREFETCH_URL=http://127.0.0.1:HTTP_PORT vllm serve ...

  (the server's ``--http-port``; several servers, one per node: list them).

(With ``VLLM_PLUGINS`` set, include ``lmcache_tiered_hints`` in it.) Without
either variable the plugin does nothing.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from lmcache_tiered.integration.hint_targets import (
    EndpointHint,
    HintTarget,
    ServerPrefetch,
)

logger = logging.getLogger("lmcache_tiered")

ENV_URL = "LMCACHE_TIERED_HINT_URL"
ENV_PREFETCH_URL = "LMCACHE_TIERED_PREFETCH_URL"
#: the vLLM class and coroutine method wrapped (see :func:`register`)
HOOK = ("vllm.v1.engine.async_llm", "AsyncLLM", "_add_request")
_HOOKED = "__lmcache_tiered_hint__"


def _split(urls: str) -> list[str]:
    return [url.strip() for url in urls.split(",") if url.strip()]


def targets_from(hint_urls: str = "", prefetch_urls: str = "") -> list[HintTarget]:
    """The targets two comma-separated URL lists name (the two variables)."""
    servers = _split(prefetch_urls)
    hints: list[HintTarget] = [EndpointHint(url) for url in _split(hint_urls)]
    return hints + [ServerPrefetch(url, servers=len(servers)) for url in servers]


class HintForwarder:
    """Sends each hint to every target from its own daemon thread, so the
    caller (vLLM's event loop) never waits on the network. At most
    ``max_pending`` hints wait; more are dropped (a late hint is worth
    little). The thread starts on the first hint: vLLM loads plugins in
    every process, most never send one. What became of the hints is counted
    (:attr:`outcomes`, by target kind and outcome, ``dropped`` too); the
    first hint a target does not take is logged with its reason."""

    def __init__(self, targets: Sequence[HintTarget], *, max_pending: int = 256):
        self.targets = list(targets)
        #: vLLM's ``VllmConfig`` (set by the hook): names the model a server
        #: prefetch is for
        self.engine_config: Any = None
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self._queue: queue.Queue[tuple[list[int], str] | None] = queue.Queue(
            max_pending
        )
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._last: Sequence[int] | None = None
        self._warned: set[str] = set()

    def submit(
        self, token_ids: Sequence[int] | None, cache_salt: str | None = None
    ) -> None:
        """Queue one request's prompt; never blocks. The same list twice in a
        row (vLLM's n > 1 children share their parent's) is sent once."""
        if not token_ids or token_ids is self._last:
            return
        self._last = token_ids
        self._ensure_thread()
        try:
            self._queue.put_nowait((list(token_ids), cache_salt or ""))
        except queue.Full:
            self.outcomes["queue", "dropped"] += 1
            _count("queue", "dropped")
            logger.debug("lmcache_tiered: hint queue full, hint dropped")

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="lmcache-tiered-hint-sender", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            token_ids, cache_salt = item
            for target in self.targets:
                outcome, why = target.send(token_ids, cache_salt, self.engine_config)
                self.outcomes[target.kind, outcome] += 1
                _count(target.kind, outcome)
                if why and target.url not in self._warned:
                    self._warned.add(target.url)
                    logger.warning(
                        "lmcache_tiered: a %s to %s was %s: %s (later ones: "
                        "counted, logged at DEBUG)",
                        target.kind,
                        target.url,
                        outcome,
                        why,
                    )
                elif why:
                    logger.debug(
                        "lmcache_tiered: %s to %s %s: %s",
                        target.kind,
                        target.url,
                        outcome,
                        why,
                    )


_exported: Any = None
_exported_lock = threading.Lock()


def _count(kind: str, outcome: str) -> None:
    """One outcome on ``lmcache_tiered_hints_total{target, outcome}`` of the
    process's Prometheus registry, which vLLM's ``/metrics`` serves.
    prometheus_client (a vLLM dependency) is imported at the first count:
    the plugin module itself stays standard-library."""
    global _exported
    with _exported_lock:
        if _exported is None:
            from prometheus_client import Counter as Exported

            _exported = Exported(
                "lmcache_tiered_hints",
                "arrival hints sent ahead of vLLM's lookups, by target and outcome",
                ["target", "outcome"],
            )
    _exported.labels(kind, outcome).inc()


def install_hook(engine_cls: type, forwarder: HintForwarder) -> bool:
    """Wrap ``engine_cls._add_request(self, request, ...)`` (a coroutine) so
    that each request's ``prompt_token_ids`` go to ``forwarder`` first.
    False if the method is missing or already wrapped."""
    original = getattr(engine_cls, HOOK[2], None)
    if not inspect.iscoroutinefunction(original) or getattr(original, _HOOKED, False):
        return False
    add_request: Callable[..., Coroutine[Any, Any, Any]] = original

    @functools.wraps(add_request)
    async def hinted_add_request(
        self: Any, request: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if forwarder.engine_config is None:
            forwarder.engine_config = getattr(self, "vllm_config", None)
        forwarder.submit(
            getattr(request, "prompt_token_ids", None),
            getattr(request, "cache_salt", None),
        )
        return await add_request(self, request, *args, **kwargs)

    setattr(hinted_add_request, _HOOKED, True)
    setattr(engine_cls, HOOK[2], hinted_add_request)
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point (``lmcache_tiered_hints``).

    vLLM calls it in each of its processes (``load_general_plugins``, run by
    ``EngineArgs.__post_init__`` in the API server before the engine client
    exists). With ``LMCACHE_TIERED_HINT_URL`` or
    ``LMCACHE_TIERED_PREFETCH_URL`` set it wraps
    ``vllm.v1.engine.async_llm.AsyncLLM._add_request(self, request, ...)``:
    the coroutine through which every request of the V1 async engine (the
    OpenAI server) passes, as an ``EngineCoreRequest`` whose
    ``prompt_token_ids`` (``list[int] | None``) and ``cache_salt`` are final,
    on its way to the engine core process; ``self.vllm_config`` names the
    model. It has taken the request first since vLLM 0.8 (the
    later arguments changed; they are passed through untouched). The offline
    ``LLM`` class (``LLMEngine``) is not hooked. Requests given as prompt
    embeddings carry no token ids and send no hint.

    The unit tests run the hook on a stand-in class with that method's
    signature; ``tests/e2e`` runs it in a live vLLM 0.32 (AsyncLLM). If vLLM
    lacks the method, this logs a warning and leaves vLLM untouched. This
    module imports only the standard library (and vLLM, when configured):
    anything heavier, loaded into every vLLM process, breaks vLLM-CPU's
    worker start.
    """
    targets = targets_from(
        os.environ.get(ENV_URL, ""), os.environ.get(ENV_PREFETCH_URL, "")
    )
    if not targets:
        return
    named = ", ".join(f"{t.kind} {t.url}" for t in targets)
    module, cls_name, method = HOOK
    try:
        engine_cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as exc:
        logger.warning(
            "lmcache_tiered: arrival hints are configured (%s) but %s.%s "
            "cannot be imported (%s): no arrival hints",
            named,
            module,
            cls_name,
            exc,
        )
        return
    if install_hook(engine_cls, HintForwarder(targets)):
        logger.info("lmcache_tiered: forwarding vLLM request arrivals to %s", named)
    elif not getattr(getattr(engine_cls, method, None), _HOOKED, False):
        logger.warning(
            "lmcache_tiered: %s.%s.%s is not a coroutine in this vLLM: no arrival "
            "hints",
            module,
            cls_name,
            method,
        )
