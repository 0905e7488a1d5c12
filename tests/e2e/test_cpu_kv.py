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


def test_learned_map_of_the_vec_op_is_the_vec_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With vLLM's "vec" write op (built on every x86 host, whichever ISA the
    host's attention picks), the map learned from it is the layout vLLM's
    source describes (K transposed, then V, per block and head): the
    learning finds a layout, it does not just echo the round-trip check."""
    from e2e import cpu_kv

    monkeypatch.setattr(cpu_kv, "_isa", lambda *_: "vec")
    cpu_kv._block_map.cache_clear()
    try:
        k_at, v_at = cpu_kv._block_map(torch.bfloat16, 2, 128, 32)
    finally:
        cpu_kv._block_map.cache_clear()
    t, h, d = torch.meshgrid(
        torch.arange(128), torch.arange(2), torch.arange(32), indexing="ij"
    )
    per_head = 2 * 128 * 32
    assert torch.equal(k_at, h * per_head + d * 128 + t)
    assert torch.equal(v_at, h * per_head + 128 * 32 + t * 32 + d)
