"""The value types the storage path hands around: a chunk's bytes in memory.

A :class:`Payload` is what tiers write and what tier-to-tier copies read; an
:data:`Allocator` gives the MemoryObj a demand read lands in. Plain values,
no I/O: the promoter, the MP adapter and the operator tools use them without
importing a tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from lmcache_tiered.io.base import ALIGN
from lmcache_tiered.keys import StoreKey
from lmcache_tiered.storage.layout import (
    FORMAT_VERSION,
    SEALED_VERSION,
    RecordHeader,
    record_identity,
)

#: Allocates the MemoryObj a record is read into; None when memory is short.
Allocator = Callable[[RecordHeader], MemoryObj | None]


@dataclass(frozen=True, slots=True)
class Payload:
    """Bytes of one chunk in memory, with what its header must say.

    ``direct`` means ``view`` is 4 KiB aligned, so O_DIRECT can use it as is.
    """

    key: StoreKey
    shape: torch.Size
    dtype: torch.dtype
    fmt: MemoryFormat
    view: memoryview
    direct: bool

    @staticmethod
    def of(key: StoreKey, obj: MemoryObj) -> Payload:
        return Payload(
            key,
            obj.get_shape(),
            obj.get_dtype(),
            obj.get_memory_format(),
            payload_view(obj)[: obj.get_size()],
            obj.data_ptr % ALIGN == 0,
        )

    def identity(self) -> bytes:
        """What its record will be, as a MAC covers it (RecordHeader.identity)."""
        return record_identity(
            self.key, self.shape, self.dtype, self.fmt, len(self.view)
        )

    def header(self, crc: int, sequence: int, mac: bytes = b"") -> RecordHeader:
        """The header that makes this payload, checksummed ``crc`` (and
        sealed with ``mac``, if given), visible."""
        return RecordHeader(
            key=self.key,
            shape=self.shape,
            dtype=self.dtype,
            fmt=self.fmt,
            payload_size=len(self.view),
            payload_crc=crc,
            sequence=sequence,
            created_ns=time.time_ns(),
            version=SEALED_VERSION if mac else FORMAT_VERSION,
            mac=mac,
        )

    @staticmethod
    def read_back(header: RecordHeader, view: memoryview) -> Payload:
        """The payload of a record read into the aligned buffer ``view``."""
        return Payload(
            header.key,
            header.shape,
            header.dtype,
            header.fmt,
            view[: header.payload_size],
            True,
        )


def payload_view(obj: MemoryObj) -> memoryview:
    """Writable view of a MemoryObj's whole physical buffer (no copy)."""
    raw: torch.Tensor = obj.raw_data
    return raw.view(torch.uint8).numpy().data.cast("B")
