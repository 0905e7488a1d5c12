"""The stand-ins for what cannot run on this machine: the GPU and vLLM's
lookup server. Everything else the testing harness drives is real LMCache.

May touch: LMCache's connector interface and ``MemoryObj`` tensors; nothing
on disk, no engine.

Connector. ``EngineType.MOCK`` builds ``MockGPUConnector``
(``v1/gpu_connector/__init__.py:258``, ``mock_gpu_connector.py:31-46``) whose
to/from_gpu are no-ops: stores write uninitialised bytes and retrieves copy
nothing, so data cannot be checked. :class:`CPUConnector` copies for real,
with CPU tensors in place of the GPU's KV cache.
``store``/``retrieve`` hand their own kwargs to ``batched_from_gpu(objs, starts,
ends, **kw)`` / ``batched_to_gpu(...)`` (``v1/cache_engine.py:569, 935``); here
``kvcaches`` (+ optional ``slot_mapping``). Chunk MemoryObjs are ``KV_2LTD``,
shape ``[2, num_layers, tokens, kv_heads * head_size]`` (``v1/metadata.py:87``),
bytes = 2*L*T*H*D*itemsize (256 KiB for the defaults), 4096-aligned
(``AddressManager.ALIGN_BYTES``, ``v1/memory_management.py:1338``), partial chunks
too (physical size rounded up to 4096).

Lookup server. vLLM's ``LMCacheAsyncLookupServer`` needs ZMQ peers (the
scheduler); :class:`RecordingLookupServer` records what StorageManager sends it
(the async read path: :mod:`lmcache_tiered.testing.drive`).

Paths are under ``site-packages/lmcache/`` in 0.5.6; 0.5.7 moved the engine's
modules under ``inprocess/v1/`` unchanged (see :mod:`lmcache_tiered._lmcache`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from lmcache_tiered.testing.lmcache import GPUConnectorInterface

# The connector's KV layout: one request's KV, token-contiguous.
# [num_layers, 2 (K/V), num_tokens, num_kv_heads, head_size]
KV_LAYOUT = "[num_layers, 2, num_tokens, num_kv_heads, head_size]"


class CPUConnector(GPUConnectorInterface):
    """GPU connector whose "GPU" is a CPU tensor.

    ``kvcaches`` (a kwarg of ``store``/``retrieve``) is one tensor laid out as
    ``[num_layers, 2, num_slots, num_kv_heads, head_size]``. Token ``t`` of the
    request lives in slot ``slot_mapping[t]`` when ``slot_mapping`` is given, else
    in slot ``t``. MemoryObjs are ``KV_2LTD``: ``[2, num_layers, tokens, heads *
    head_size]``, the layout LMCache allocates when no layer-group manager is
    registered (``LMCacheMetadata.get_shapes``).
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.kvcaches: torch.Tensor | None = None
        #: called after each batched copy with (seconds it took, tokens it
        #: moved): the bench charges the modelled PCIe link instead
        self.after_copy: Callable[[float, int], None] | None = None

    def _kv(self, kwargs: dict[str, Any]) -> torch.Tensor:
        kv = kwargs.get("kvcaches")
        if not isinstance(kv, torch.Tensor):
            raise TypeError("CPUConnector needs kvcaches=<torch.Tensor> " + KV_LAYOUT)
        if kv.dim() != 5 or kv.shape[0] != self.num_layers or kv.shape[1] != 2:
            raise ValueError(f"kvcaches shape {tuple(kv.shape)} is not {KV_LAYOUT}")
        return kv

    @staticmethod
    def _slots(kwargs: dict[str, Any], start: int, end: int) -> slice | torch.Tensor:
        slot_mapping = kwargs.get("slot_mapping")
        if slot_mapping is None:
            return slice(start, end)
        return torch.as_tensor(slot_mapping, dtype=torch.long)[start:end]

    def _obj_view(self, memory_obj: MemoryObj, num_tokens: int) -> torch.Tensor:
        """The MemoryObj as [num_layers, 2, tokens, heads, head_size] (a view)."""
        tensor = memory_obj.tensor
        if tensor is None:
            raise RuntimeError("MemoryObj has no tensor (invalidated?)")
        fmt = memory_obj.get_memory_format()
        if fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"CPUConnector supports KV_2LTD only, got {fmt}")
        return tensor.view(
            2, self.num_layers, num_tokens, self.num_kv_heads, self.head_size
        ).transpose(0, 1)

    def from_gpu(
        self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any
    ) -> None:
        """Copy tokens [start, end) of ``kvcaches`` into ``memory_obj``."""
        kv = self._kv(kwargs)
        self._obj_view(memory_obj, end - start).copy_(
            kv[:, :, self._slots(kwargs, start, end)]
        )

    def to_gpu(
        self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any
    ) -> None:
        """Copy ``memory_obj`` into tokens [start, end) of ``kvcaches``."""
        kv = self._kv(kwargs)
        kv[:, :, self._slots(kwargs, start, end)] = self._obj_view(
            memory_obj, end - start
        )

    def batched_from_gpu(
        self,
        memory_objs: list[list[MemoryObj]] | list[MemoryObj],
        starts: list[int],
        ends: list[int],
        **kwargs: Any,
    ) -> None:
        """Per-chunk ``from_gpu``."""
        began = time.perf_counter()
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            assert isinstance(obj, MemoryObj), "layerwise lists are not supported"
            self.from_gpu(obj, start, end, **kwargs)
        self._copied(began, starts, ends)

    def batched_to_gpu(
        self,
        memory_objs: list[list[MemoryObj]] | list[MemoryObj] | list[int] | None = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        """Per-chunk ``to_gpu``."""
        assert memory_objs is not None and starts is not None and ends is not None
        began = time.perf_counter()
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            assert isinstance(obj, MemoryObj), "layerwise lists are not supported"
            self.to_gpu(obj, start, end, **kwargs)
        self._copied(began, starts, ends)

    def _copied(self, began: float, starts: list[int], ends: list[int]) -> None:
        if self.after_copy is not None:
            self.after_copy(time.perf_counter() - began, sum(ends) - sum(starts))

    def get_shape(self, num_tokens: int) -> torch.Size:
        """Shape of a KV_2LTD MemoryObj holding ``num_tokens`` tokens."""
        return torch.Size(
            [2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size]
        )

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        """Remember the last ``kvcaches`` (no pointer tables on CPU)."""
        if "kvcaches" in kwargs:
            self.kvcaches = kwargs["kvcaches"]


class RecordingLookupServer:
    """Stands in for ``LMCacheAsyncLookupServer`` (which needs vLLM's ZMQ peers).

    StorageManager calls ``send_response_to_scheduler(lookup_id, num_hit_tokens)``
    on its event loop when an async lookup+prefetch finished; this records it.
    """

    def __init__(self) -> None:
        self._results: dict[str, int] = {}
        self._cond = threading.Condition()

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        """Record the number of prefix tokens the prefetch made ready."""
        with self._cond:
            self._results[lookup_id] = int(num_hit_tokens)
            self._cond.notify_all()

    def poll(self, lookup_id: str, timeout: float = 0.0) -> int | None:
        """Pop the response for ``lookup_id``, waiting up to ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: lookup_id in self._results, timeout)
            return self._results.pop(lookup_id, None)

    def close(self) -> None:
        """Nothing to release."""
