"""The test-support CPU connector's layout check has teeth: it passes on
vLLM-CPU's own write op and refuses a naive reading of the cache (K as
``[block_size, head_size]``, not transposed)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.e2e


def naive_read(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    num_blocks, heads, block_size, fused = cache.shape
    halves = cache.view(num_blocks, heads, 2, block_size, fused // 2)
    blocks, offsets = slots // block_size, slots % block_size
    return halves[blocks, :, 0, offsets], halves[blocks, :, 1, offsets]


def test_layout_check_passes_on_vllm_and_refuses_a_naive_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from e2e import cpu_kv

    # the live shape: 2 KV heads of 32, blocks of 128 tokens, bf16
    like = torch.zeros(4, 2, 128, 64, dtype=torch.bfloat16)
    cpu_kv.check_layout(like)
    monkeypatch.setattr(cpu_kv, "_read", naive_read)
    with pytest.raises(cpu_kv.LayoutError, match="refusing to run"):
        cpu_kv.check_layout(like)
