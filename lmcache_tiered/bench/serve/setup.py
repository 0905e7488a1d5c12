"""What a serve-bench variant's servers are started with (one owner for it:
the run and its report both read it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmcache_tiered.bench.serve.tiny_model import TinyLlama


@dataclass(frozen=True, slots=True)
class ServeSetup:
    """Everything a variant's servers are started with."""

    model_dir: Path
    model: TinyLlama
    warm: tuple[Path, ...]
    concurrency: int
    #: prompt tokens per step (vLLM's max_num_batched_tokens)
    token_budget: int
    #: vLLM-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE): its own prefix cache
    kv_cache_gb: float
    #: LMCache's L1 (CPU) and vLLM's CPU offload tier, the same for all
    l1_gb: float
    warm_gb: float
    max_model_len: int
    logs: Path
    #: cold tier drives (``--cold``; none: warm only) and their capacity
    cold: tuple[Path, ...] = ()
    cold_gb: float = 0.0

    @property
    def kv_cache_tokens(self) -> int:
        return kv_cache_tokens(self.kv_cache_gb, self.model)


def kv_cache_tokens(gb: float, model: TinyLlama) -> int:
    """Tokens of ``model`` that ``gb`` GiB of vLLM's own KV cache hold."""
    return int(gb * 2**30 // model.kv_bytes_per_token)
