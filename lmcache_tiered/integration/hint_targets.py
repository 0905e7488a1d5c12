"""Where an arrival hint goes: our hint endpoint (the in-process plugin), or
a warm prefetch of LMCache's multi-process server.

In LMCache's multi-process road (``lmcache server``, vLLM's
``LMCacheMPConnector``) vLLM looks a request up only once its scheduler
reaches it with a running slot free (``vllm/v1/core/sched/scheduler.py``:
the waiting loop stops at ``max_num_running_reqs``); under load a request
waits in the queue before that, and its lookup then waits for the server to
load its chunks from L2. The server's ``POST /cache/prefetches`` (lmcache
0.5.6, ``multiprocess/http_apis/cache_api.py``) loads a token sequence's
chunks from L2 (our :class:`~lmcache_tiered.integration.mp.TieredL2Adapter`:
warm, cold, other hosts' files) into L1 and leaves them there, evictable:
:class:`ServerPrefetch` sends each hint there, so the lookup finds them in
L1. The server keys chunks by model name and KV world size, which the
sender takes from vLLM's config (:func:`key_space`).

What vLLM's GPU prefix cache holds is not known where hints are sent (the
API server process), so a prefetch names the whole prompt; the server skips
the chunks already in its L1.

This module imports only the standard library: vLLM loads the plugin in
every one of its processes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from lmcache_tiered.warmup.hints import post_json, send_hint

#: What became of one hint at one target: taken (``submitted``), taken with
#: nothing to do (``noop``: shorter than a chunk), refused by the target with
#: a reason (``refused``), or not delivered (``failed``: down, timed out)
Outcome = Literal["submitted", "noop", "refused", "failed"]
#: LMCache's route for warm prefetches (0.5.6 and 0.5.7)
PREFETCH_PATH = "/cache/prefetches"


class HintTarget(Protocol):
    """Takes one request's prompt; never raises, never waits long."""

    #: for logs and metrics: ``hint`` or ``prefetch``
    kind: str
    url: str

    def send(
        self, token_ids: list[int], cache_salt: str, engine_config: Any
    ) -> tuple[Outcome, str]:
        """Deliver one hint: what became of it, and why where it was not
        taken. ``engine_config``: vLLM's ``VllmConfig`` where the sender has
        one (None otherwise)."""
        ...


@dataclass
class EndpointHint:
    """Our hint endpoint (``tiered.warmup.hint_port``, in-process plugin)."""

    url: str
    timeout: float = 0.5
    kind: str = "hint"

    def send(
        self, token_ids: list[int], cache_salt: str, engine_config: Any
    ) -> tuple[Outcome, str]:
        if send_hint(self.url, token_ids, timeout=self.timeout):
            return "submitted", ""
        return "failed", "not delivered (down, timed out or refused)"


@dataclass(frozen=True)
class KeySpace:
    """What LMCache's server keys a model's chunks by."""

    model_name: str
    world_size: int


def key_space(engine_config: Any, servers: int) -> KeySpace:
    """The model name and KV world size ``LMCacheMPConnector`` registers with
    each of ``servers`` servers (lmcache 0.5.6
    ``integration/vllm/vllm_multi_process_adapter.py``, ``kv_world_size``):
    the vLLM world split across the servers, or for MLA (KV replicated across
    tensor parallelism) one piece per pipeline stage. A model whose name
    LMCache decorates (decode context parallelism) is not covered: its
    prefetches are refused with the server's reason, logged."""
    model = engine_config.model_config
    parallel = engine_config.parallel_config
    if getattr(model, "use_mla", False):
        world = parallel.pipeline_parallel_size
    else:
        world = max(1, parallel.world_size // servers)
    return KeySpace(str(model.model), world)


def _status_of(reply: str) -> str | None:
    """The ``status`` of a JSON reply (None if it is not one)."""
    try:
        body = json.loads(reply)
    except ValueError:
        return None
    return body.get("status") if isinstance(body, dict) else None


@dataclass
class ServerPrefetch:
    """A warm prefetch (L2 -> L1) on one LMCache server, from its HTTP API
    (``lmcache server --http-port``): ``url`` is its base, e.g.
    ``http://127.0.0.1:8080``."""

    url: str
    servers: int = 1
    timeout: float = 0.5
    kind: str = "prefetch"
    space: KeySpace | None = None

    def send(
        self, token_ids: list[int], cache_salt: str, engine_config: Any
    ) -> tuple[Outcome, str]:
        if self.space is None:
            if engine_config is None:
                return "refused", "no vLLM config to name the model by"
            self.space = key_space(engine_config, self.servers)
        status, reply = post_json(
            self.url.rstrip("/") + PREFETCH_PATH,
            {
                "model_name": self.space.model_name,
                "world_size": self.space.world_size,
                "token_ids": token_ids,
                "cache_salt": cache_salt,
            },
            self.timeout,
        )
        if status is None:
            return "failed", reply
        if 200 <= status < 300:
            # {"chunks": 0, "status": "noop"}: shorter than a chunk
            return ("noop" if _status_of(reply) == "noop" else "submitted"), ""
        return "refused", f"HTTP {status}: {reply}"
