"""Test support: LMCache's in-process connector on vLLM's CPU backend.

LMCache 0.5.6 has no GPU connector for vLLM-CPU (``CreateGPUConnector``
knows cuda, xpu, musa and hpu; on CPU it logs "No supported cpu connector
found" and vLLM recomputes everything). This module supplies one, for the
end-to-end tests only; it is not part of the serving path.

vLLM-CPU's paged cache, per layer: ``[num_blocks, num_kv_heads, block_size,
2 * head_size]``, packed per block in an order that depends on the attention
ISA vLLM picks for the host: with "vec" each (block, head) holds K
*transposed*, then V; with "amx" (bf16 on AMX hosts) K and V are packed
again for the tile units. Rather than hard-code either, writes go through
vLLM's own ``cpu_attn_reshape_and_cache`` and reads gather through a map of
where that op puts each element of a block, learned once per shape by writing
elements that carry their own index (:func:`_block_map`). :func:`check_layout`
verifies a random round trip when vLLM registers its caches and refuses to
run on a mismatch.

Use it as the KV connector ``CPUTestLMCacheConnector`` from module
``e2e.cpu_kv`` (``tests`` on PYTHONPATH): it is vLLM's LMCacheConnectorV1
with this connector patched into LMCache first, in whichever process vLLM
builds it. ``CORRUPT`` (set in that process) makes loads write wrong KV: the
negative control of the ids check.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from lmcache.utils import EngineType
from lmcache.v1.memory_management import MemoryObj
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
    LMCacheConnectorV1,
)

from lmcache_tiered.testing import CPUConnector

logger = logging.getLogger("lmcache_tiered.e2e")

#: loads write the negated K and V (the negative control)
CORRUPT = False


class LayoutError(RuntimeError):
    """vLLM's CPU cache layout is not the one this connector reads."""


def _isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size)


def _write(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """vLLM's own write of tokens ``[T, heads, head_size]`` into ``slots``."""
    from vllm._custom_ops import cpu_attn_reshape_and_cache

    num_blocks, heads, block_size, fused = cache.shape
    halves = cache.view(num_blocks, heads, block_size * 2, fused // 2).chunk(2, dim=2)
    isa = _isa(cache.dtype, block_size, fused // 2)
    cpu_attn_reshape_and_cache(key, value, halves[0], halves[1], slots, isa)


#: digits of an element's index written per pass: values 1..BASE are exact
#: integers in bf16, fp16 and fp32 (0 marks a place the op never wrote)
_BASE = 128


@functools.cache
def _block_map(
    dtype: torch.dtype, heads: int, block_size: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's write op puts K[t, h, d] and V[t, h, d] of one block: two
    ``[block_size, heads, head_size]`` tensors of offsets into the block's
    flat storage. Learned by writing every element's index into a scratch
    block, one base-128 digit per pass; LayoutError unless every element lands
    in exactly one place (a layout that is a permutation of the block)."""
    per_half = block_size * heads * head_size
    index = torch.arange(2 * per_half)
    slots = torch.arange(block_size)
    source = torch.zeros(2 * per_half, dtype=torch.long)  # per place in the block
    written: torch.Tensor | None = None
    scale, passes = 1, 0
    while scale < 2 * per_half or passes == 0:
        digit = (index // scale % _BASE + 1).to(dtype)
        scratch = torch.zeros(1, heads, block_size, 2 * head_size, dtype=dtype)
        key, value = (
            half.view(block_size, heads, head_size) for half in digit.chunk(2)
        )
        _write(scratch, key, value, slots)
        got = scratch.flatten().to(torch.long)
        written = got > 0 if written is None else written & (got > 0)
        source += (got - 1).clamp(min=0) * scale
        scale, passes = scale * _BASE, passes + 1
    assert written is not None
    places = torch.nonzero(written).flatten()
    if len(places) != 2 * per_half or not torch.equal(
        torch.sort(source[places]).values, index
    ):
        raise LayoutError(
            f"vLLM-CPU's write op ({dtype}, {heads} heads, block size {block_size}, "
            f"head size {head_size}) is not a permutation of the block: "
            "refusing to run (K/V would be wrong)"
        )
    offset_of = torch.empty_like(index)
    offset_of[source[places]] = places
    k_at, v_at = (h.view(block_size, heads, head_size) for h in offset_of.chunk(2))
    return k_at, v_at


def _read(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K and V of ``slots`` as ``[T, heads, head_size]``, through the map of
    where vLLM's write op put them."""
    num_blocks, heads, block_size, fused = cache.shape
    k_at, v_at = _block_map(cache.dtype, heads, block_size, fused // 2)
    flat = cache.view(num_blocks, -1)
    blocks = (slots // block_size)[:, None, None]
    offsets = slots % block_size
    return flat[blocks, k_at[offsets]], flat[blocks, v_at[offsets]]


def check_layout(like: torch.Tensor) -> None:
    """Write random K/V with vLLM's op into a small cache shaped like
    ``like`` and read them back with :func:`_read`; LayoutError if they
    differ."""
    _, heads, block_size, fused = like.shape
    scratch = torch.zeros(3, heads, block_size, fused, dtype=like.dtype)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(3 * block_size, generator=gen)[: block_size + 5]
    key, value = (
        torch.randn(len(slots), heads, fused // 2, generator=gen).to(like.dtype)
        for _ in range(2)
    )
    _write(scratch, key, value, slots)
    got_k, got_v = _read(scratch, slots)
    if not (torch.equal(got_k, key) and torch.equal(got_v, value)):
        isa = _isa(like.dtype, block_size, fused // 2)
        raise LayoutError(
            f"vLLM-CPU's KV cache layout (ISA {isa!r}, dtype {like.dtype}) is not "
            "the one cpu_kv learned from its write op: refusing to run (K/V would "
            "be wrong)"
        )
    logger.info(
        "cpu_kv: vLLM-CPU's KV layout checked against cpu_attn_reshape_and_cache "
        "(ISA %s, %s, block size %d)",
        _isa(like.dtype, block_size, fused // 2),
        like.dtype,
        block_size,
    )


class VLLMCPUConnector(CPUConnector):
    """LMCache's GPU-connector interface over vLLM-CPU's per-layer caches
    (``kvcaches``: a list, one tensor per layer). MemoryObjs are KV_2LTD,
    as :class:`~lmcache_tiered.testing.CPUConnector` makes them."""

    def _caches(self, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        caches = kwargs.get("kvcaches")
        if not isinstance(caches, list) or len(caches) != self.num_layers:
            raise TypeError(f"expected kvcaches: a list of {self.num_layers} layers")
        return caches

    def from_gpu(
        self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any
    ) -> None:
        obj = self._obj_view(memory_obj, end - start)  # [layers, 2, T, H, D]
        slots = torch.as_tensor(kwargs["slot_mapping"], dtype=torch.long)[start:end]
        for layer, cache in enumerate(self._caches(kwargs)):
            key, value = _read(cache, slots)
            obj[layer, 0].copy_(key)
            obj[layer, 1].copy_(value)

    def to_gpu(
        self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any
    ) -> None:
        obj = self._obj_view(memory_obj, end - start)
        slots = torch.as_tensor(kwargs["slot_mapping"], dtype=torch.long)[start:end]
        sign = -1 if CORRUPT else 1
        for layer, cache in enumerate(self._caches(kwargs)):
            key, value = ((sign * obj[layer, i]).contiguous() for i in (0, 1))
            _write(cache, key, value, slots)


def _install() -> None:
    """Have LMCache build :class:`VLLMCPUConnector` for vLLM on CPU."""
    import lmcache.v1.gpu_connector as factory
    from lmcache import torch_device_type

    original = factory.CreateGPUConnector
    if getattr(original, "cpu_kv", False):
        return

    def create(config: Any, metadata: Any, engine: Any, **kwargs: Any) -> Any:
        if engine != EngineType.VLLM or torch_device_type != "cpu":
            return original(config, metadata, engine, **kwargs)
        num_layers, _, _, heads, head_size = metadata.kv_shape
        return VLLMCPUConnector(num_layers, heads, head_size, metadata.kv_dtype)

    create.cpu_kv = True  # type: ignore[attr-defined]
    factory.CreateGPUConnector = create


class CPUTestLMCacheConnector(LMCacheConnectorV1):
    """vLLM's LMCacheConnectorV1 with :class:`VLLMCPUConnector` in LMCache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _install()
        super().__init__(*args, **kwargs)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        check_layout(next(iter(kv_caches.values())))
        super().register_kv_caches(kv_caches)
