"""The serving benchmark's model: a random-weight Llama made at run time.

Nothing is downloaded. Its shape puts a CPU server in the seed's regime:
many KV bytes per token (32 KiB: 16 layers x 8 KV heads x 64 x bf16, K and
V) for little compute (a 256-wide residual stream), so that on vLLM-CPU
loading a reused prefix from one drive of a few hundred MB/s costs a large
share of recomputing it, and striping over drives is what makes loading
win. The weights are random: the tokens it generates mean nothing, the
time it takes to make them is real.

May touch: the directory it saves the model to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmcache_tiered.bench.trace import VOCAB


@dataclass(frozen=True, slots=True)
class TinyLlama:
    """The model's shape (transformers' ``LlamaConfig`` names)."""

    num_hidden_layers: int = 16
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    #: the bench's token ids are drawn below :data:`VOCAB`
    vocab_size: int = VOCAB
    max_position_embeddings: int = 32768

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, bf16."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2

    def describe(self) -> dict[str, Any]:
        """The shape and its KV bytes per token (for the JSON and the log)."""
        return {**asdict(self), "kv_bytes_per_token": self.kv_bytes_per_token}

    def save(self, path: Path) -> Path:
        """Write the model (bf16 safetensors, seeded weights) to ``path``."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**asdict(self)))
        model.to(dtype=torch.bfloat16)  # type: ignore[call-arg]  # transformers' stub
        model.save_pretrained(path)
        return path
