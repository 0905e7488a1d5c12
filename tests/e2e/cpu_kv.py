"""Test support: LMCache's in-process connector on vLLM's CPU backend.

LMCache 0.5.6 has no GPU connector for vLLM-CPU (``CreateGPUConnector``
knows cuda, xpu, musa and hpu; on CPU it logs "No supported cpu connector
found" and vLLM recomputes everything). This module supplies one, for the
end-to-end tests only; it is not part of the serving path.

vLLM-CPU's paged cache, per layer: ``[num_blocks, num_kv_heads, block_size,
2 * head_size]``. With the "vec" ISA layout each (block, head) holds K
*transposed*, ``[head_size, block_size]``, then V, ``[block_size,
head_size]``; a naive reading gets K wrong. Writes go through vLLM's own
``cpu_attn_reshape_and_cache`` (exact for any ISA); reads gather with the
layout above, which :func:`check_layout` verifies against that op when vLLM
registers its caches, refusing to run on a mismatch (the "amx" ISA of bf16
on AMX hosts packs differently, for one).

Use it as the KV connector ``CPUTestLMCacheConnector`` from module
``e2e.cpu_kv`` (``tests`` on PYTHONPATH): it is vLLM's LMCacheConnectorV1
with this connector patched into LMCache first, in whichever process vLLM
builds it. ``CORRUPT`` (set in that process) makes loads write wrong KV: the
negative control of the ids check.
"""

from __future__ import annotations

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


def _read(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K and V of ``slots`` as ``[T, heads, head_size]``, per the vec layout."""
    num_blocks, heads, block_size, fused = cache.shape
    head_size = fused // 2
    flat = cache.view(num_blocks, heads, block_size * fused)
    k = flat[..., : head_size * block_size].view(num_blocks, heads, head_size, -1)
    v = flat[..., head_size * block_size :].view(num_blocks, heads, -1, head_size)
    blocks, offsets = slots // block_size, slots % block_size
    # advanced indices apart from each other: the token axis comes first
    return k[blocks, :, :, offsets], v[blocks, :, offsets, :]


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
            "the vec layout cpu_kv reads: refusing to run (K/V would be wrong)"
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
