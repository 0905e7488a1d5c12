"""serve-bench's names and defaults, shared by its command line
(:mod:`lmcache_tiered.cli.serve_bench`) and its run; importing this module
imports neither torch nor LMCache, so ``--help`` answers at once."""

from __future__ import annotations

from lmcache_tiered.bench.model.baseline import NO_EXTERNAL_CACHE

LMCACHE_STOCK = "lmcache_stock"
VLLM_OFFLOAD = "vllm_offload"
#: a tiered variant is ``tiered_<policy>``
TIERED = "tiered"
DEFAULT_VARIANTS = (NO_EXTERNAL_CACHE, LMCACHE_STOCK, TIERED, VLLM_OFFLOAD)
DEFAULT_VARIANTS_TEXT = ",".join(DEFAULT_VARIANTS)
DEFAULT_WORKLOAD = "agent-cpu"
#: default L1: this many times what the requests in flight hold
L1_IN_FLIGHT = 1.5
#: vLLM 0.32's max_num_batched_tokens for its OpenAI server on a CPU platform
VLLM_CPU_SERVER_TOKEN_BUDGET = 2048
