"""On-disk record format and slot geometry of a tier.

A tier keeps, per worker process, one *slab* file on each of its N devices and
one *header* file on the first device::

    <path_i>/<name>.slab   slot s occupies [s * per_device, (s + 1) * per_device)
    <path_0>/<name>.hdr    4 KiB superblock, then one 4 KiB header per slot

:class:`TierNames` is the one place these names are spelled, and
:func:`scan_headers` with :func:`newest` the one reading of a header file
(the live tier, the operator tools and the shared cold tier all use them), so
a format change touches this file only.

A chunk's payload is striped over the devices in units of ``stripe`` bytes
(unit u lands on device u % N), so one chunk read keeps every device busy. The
header is written only after the payload, and carries the payload's checksum
and its own CRC32: a record whose write did not finish is never served.

Record versions: 2 checksums the payload with CRC32C (the ``crc32c`` package:
SSE4.2 or ARMv8 CRC instructions, chosen at run time, no wide-vector code; the
GIL released), 1 with zlib's CRC32, several times slower per core. Version 3
is version 2 with a keyed MAC after the key (:data:`MAC_SIZE` bytes, see
:mod:`lmcache_tiered.storage.seal`), written by a tier under a fleet secret.
Version 1 records are still read and checked with CRC32; any other version is
a miss. The superblock's format did not change (version 1).
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import crc32c
import torch
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered.io.base import ALIGN
from lmcache_tiered.keys import (
    DIGEST_SIZE,
    StoreKey,
    key_digest,
    key_from_string,
    key_text,
)
from lmcache_tiered.storage.files import open_regular

HEADER_SIZE = ALIGN
#: Header bytes read per request while scanning a header file.
SCAN_BYTES = 4 << 20
#: Version of the records written now; see the module docstring.
FORMAT_VERSION = 2
#: Version of the records a tier under a fleet secret writes: a MAC as well.
SEALED_VERSION = 3
#: Bytes of a sealed record's MAC.
MAC_SIZE = 32


def _crc32c(view: memoryview, value: int) -> int:
    return int(crc32c.crc32c(view, value, gil_release_mode=1))


#: Record versions this code reads, and the payload checksum of each.
_PAYLOAD_CHECKSUMS: dict[int, Callable[[memoryview, int], int]] = {
    1: zlib.crc32,
    2: _crc32c,
    SEALED_VERSION: _crc32c,
}
#: The superblock's own layout version (unchanged by record version 2).
SUPER_VERSION = 1
RECORD_MAGIC = b"LMTRREC1"
SUPER_MAGIC = b"LMTRSUP1"
MAX_DIMS = 8
#: More devices than this in one tier is a damaged superblock, not a host.
MAX_DEVICES = 1024


def _dtype_name(dtype: torch.dtype) -> str:
    """How a record spells its dtype (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


_DTYPES: dict[str, torch.dtype] = {
    _dtype_name(d): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}

# magic, version, fmt, payload size, payload crc, sequence, time (ns), digest,
# ndim, dtype length, key length
# (a sealed record's MAC follows the key)
_RECORD = struct.Struct(f"<8sHHQIQQ{DIGEST_SIZE}sBBH")
# what a MAC covers besides the payload: digest, format, payload size, ndim,
# dtype length (then the dimensions and the dtype's name)
_IDENTITY = struct.Struct(f"<{DIGEST_SIZE}sHQBB")
# magic, version, devices, stripe, per-device slot bytes, max payload bytes
_SUPER = struct.Struct("<8sHHQQQ")
_CRC = struct.Struct("<I")


def payload_checksum(
    view: memoryview, version: int = FORMAT_VERSION, value: int = 0
) -> int:
    """The checksum a record of ``version`` carries for its payload; pass the
    checksum of the bytes before ``view`` as ``value`` to go on from there."""
    return int(_PAYLOAD_CHECKSUMS[version](view, value))


def align_up(n: int, alignment: int = ALIGN) -> int:
    return -(-n // alignment) * alignment


class CorruptRecord(ValueError):
    """Bytes on disk that are not a valid record: treat as a miss."""


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """What a tier needs to know about a stored chunk without reading it."""

    key: StoreKey
    shape: torch.Size
    dtype: torch.dtype
    fmt: MemoryFormat
    payload_size: int
    payload_crc: int
    sequence: int
    created_ns: int
    #: Record version: decides how ``payload_crc`` was computed.
    version: int = FORMAT_VERSION
    #: keyed MAC of :meth:`identity` and the payload (version 3), else empty
    mac: bytes = b""

    def identity(self) -> bytes:
        """What this record is (key, format, size, shape, dtype), as the bytes
        a MAC covers before the payload; the sequence and time are left out:
        two records of one key hold the same KV."""
        return record_identity(
            self.key, self.shape, self.dtype, self.fmt, self.payload_size
        )

    def payload_matches(self, view: memoryview) -> bool:
        """Whether ``view`` (the payload as read) has the recorded checksum."""
        return payload_checksum(view, self.version) == self.payload_crc

    def encode(self) -> bytes:
        """The header as one zero-padded, CRC-protected 4 KiB block."""
        dtype_name = _dtype_name(self.dtype).encode()
        key_bytes = key_text(self.key).encode()
        fixed = _RECORD.pack(
            RECORD_MAGIC,
            self.version,
            self.fmt.value,
            self.payload_size,
            self.payload_crc,
            self.sequence,
            self.created_ns,
            key_digest(self.key),
            len(self.shape),
            len(dtype_name),
            len(key_bytes),
        )
        if (self.version == SEALED_VERSION) != (len(self.mac) == MAC_SIZE):
            raise ValueError(
                f"record version {self.version} with a {len(self.mac)} B MAC"
            )
        body = (
            fixed
            + struct.pack(f"<{len(self.shape)}Q", *self.shape)
            + dtype_name
            + key_bytes
            + self.mac
        )
        if len(body) + _CRC.size > HEADER_SIZE:
            raise ValueError(f"key too long for a record header: {len(key_bytes)} B")
        return (body + _CRC.pack(zlib.crc32(body))).ljust(HEADER_SIZE, b"\0")

    @staticmethod
    def decode(block: bytes | memoryview, max_payload: int) -> RecordHeader:
        """Parse and validate a header block; raise CorruptRecord if bad.

        Sizes are checked before anything is trusted, so a crafted header
        cannot make the reader allocate more than ``max_payload`` bytes.
        """
        block = bytes(block[:HEADER_SIZE])
        if len(block) < _RECORD.size or block[:8] != RECORD_MAGIC:
            raise CorruptRecord("no record magic")
        (_, version, fmt, size, crc, seq, created, digest, ndim, dlen, klen) = (
            _RECORD.unpack_from(block)
        )
        if version not in _PAYLOAD_CHECKSUMS:
            raise CorruptRecord(f"record format version {version}")
        key_end = _RECORD.size + 8 * ndim + dlen + klen
        end = key_end + (MAC_SIZE if version == SEALED_VERSION else 0)
        if ndim > MAX_DIMS or end + _CRC.size > HEADER_SIZE:
            raise CorruptRecord("header fields out of range")
        (stored_crc,) = _CRC.unpack_from(block, end)
        if zlib.crc32(block[:end]) != stored_crc:
            raise CorruptRecord("header checksum mismatch")
        dims = struct.unpack_from(f"<{ndim}Q", block, _RECORD.size)
        offset = _RECORD.size + 8 * ndim
        dtype = _DTYPES.get(block[offset : offset + dlen].decode(errors="replace"))
        if dtype is None:
            raise CorruptRecord("unknown dtype")
        # in Python ints: torch.Size.numel() wraps around on crafted dimensions,
        # and torch.Size refuses a dimension past int64
        if (
            size > max_payload
            or not all(0 < d <= max_payload for d in dims)
            or math.prod(dims) * dtype.itemsize != size
        ):
            raise CorruptRecord("payload size does not match shape or slot")
        try:
            key = key_from_string(block[offset + dlen : key_end].decode())
            memory_format = MemoryFormat(fmt)
        except (ValueError, KeyError, UnicodeDecodeError) as exc:
            raise CorruptRecord(f"bad key or format: {exc}") from None
        if key_digest(key) != digest:
            raise CorruptRecord("key digest mismatch")
        shape = torch.Size(dims)
        return RecordHeader(
            key,
            shape,
            dtype,
            memory_format,
            size,
            crc,
            seq,
            created,
            version,
            block[key_end:end],
        )


def record_identity(
    key: StoreKey, shape: torch.Size, dtype: torch.dtype, fmt: MemoryFormat, size: int
) -> bytes:
    """The bytes that say what a record is (see :meth:`RecordHeader.identity`);
    fixed-size fields first, so no two records' identities run into each other."""
    dtype_name = _dtype_name(dtype).encode()
    return (
        _IDENTITY.pack(key_digest(key), fmt.value, size, len(shape), len(dtype_name))
        + struct.pack(f"<{len(shape)}Q", *shape)
        + dtype_name
    )


def decode_header_blocks(
    data: bytes | memoryview, first: int, max_payload: int
) -> Iterator[tuple[int, RecordHeader | CorruptRecord]]:
    """The written header blocks of ``data`` (the blocks of slots ``first``
    on): each one's slot and header, or the CorruptRecord it failed with. A
    block starting with 8 zero bytes was never written (preallocated space)."""
    for i in range(len(data) // HEADER_SIZE):
        block = data[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
        if block[:8] == bytes(8):
            continue
        try:
            header: RecordHeader | CorruptRecord = RecordHeader.decode(
                block, max_payload
            )
        except CorruptRecord as exc:
            header = exc
        yield first + i, header


@dataclass(frozen=True, slots=True)
class Extent:
    """One stripe unit of a record: ``length`` bytes of the payload starting at
    ``start``, stored on ``device`` at byte ``offset`` of its slab."""

    device: int
    offset: int
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class Geometry:
    """How slots map onto the devices of a tier. Fixed for a tier's lifetime
    (kept in the superblock); a different one on restart means reformat."""

    devices: int
    stripe: int
    per_device: int
    max_payload: int

    @staticmethod
    def plan(devices: int, max_stripe: int, max_payload: int) -> Geometry:
        """Smallest per-device slot that holds ``max_payload`` bytes.

        The stripe unit is at most ``max_stripe`` and chosen so the payload
        splits into whole rows of ``devices`` units: with 3 devices and 1 MiB
        stripes, a 4 MiB chunk uses 6 units of 700 KiB, not 4 MiB per device
        and 2 MiB of waste.
        """
        rows = -(-max_payload // (devices * max_stripe))
        stripe = align_up(-(-max_payload // (devices * rows)))
        return Geometry(devices, stripe, rows * stripe, max_payload)

    @property
    def slot_disk_bytes(self) -> int:
        """Bytes one slot costs on disk, header included."""
        return self.per_device * self.devices + HEADER_SIZE

    def extents(self, slot: int, payload_size: int) -> list[Extent]:
        """The stripe units of a record of ``payload_size`` bytes in ``slot``."""
        base = slot * self.per_device
        return [
            Extent(
                device=unit % self.devices,
                offset=base + (unit // self.devices) * self.stripe,
                start=start,
                length=min(self.stripe, payload_size - start),
            )
            for unit, start in enumerate(range(0, payload_size, self.stripe))
        ]

    @staticmethod
    def header_offset(slot: int) -> int:
        return HEADER_SIZE * (slot + 1)

    def encode_superblock(self) -> bytes:
        body = _SUPER.pack(
            SUPER_MAGIC,
            SUPER_VERSION,
            self.devices,
            self.stripe,
            self.per_device,
            self.max_payload,
        )
        return (body + _CRC.pack(zlib.crc32(body))).ljust(HEADER_SIZE, b"\0")

    @staticmethod
    def superblock_sealed(block: bytes | memoryview) -> bool:
        """Whether ``block`` is a superblock this package wrote (magic and
        checksum hold), whatever layout or format version it records: a
        change of settings, not damage."""
        block = bytes(block[: _SUPER.size + _CRC.size])
        if len(block) < _SUPER.size + _CRC.size or block[:8] != SUPER_MAGIC:
            return False
        (stored_crc,) = _CRC.unpack_from(block, _SUPER.size)
        return bool(zlib.crc32(block[: _SUPER.size]) == stored_crc)

    @staticmethod
    def decode_superblock(block: bytes | memoryview) -> Geometry | None:
        """The geometry a header file was written with, or None if unreadable."""
        if not Geometry.superblock_sealed(block):
            return None
        magic, version, devices, stripe, per_device, max_payload = _SUPER.unpack_from(
            block
        )
        if version != SUPER_VERSION:
            return None
        geometry = Geometry(devices, stripe, per_device, max_payload)
        return geometry if geometry.is_sane() else None

    @staticmethod
    def describe_superblock(block: bytes | memoryview) -> str:
        """What a sealed superblock records, in words for a log line: its
        geometry, or the format version this release does not read."""
        _, version, devices, stripe, per_device, max_payload = _SUPER.unpack_from(
            bytes(block[: _SUPER.size])
        )
        if version != SUPER_VERSION:
            return f"format version {version}; this release writes {SUPER_VERSION}"
        geometry = Geometry(devices, stripe, per_device, max_payload)
        return f"{geometry}" if geometry.is_sane() else f"an impossible {geometry}"

    def is_sane(self) -> bool:
        """Whether slots and extents computed from this geometry stay inside
        its slabs: tools that take the geometry from disk check it first."""
        return (
            1 <= self.devices <= MAX_DEVICES
            and self.stripe > 0
            and self.stripe % ALIGN == 0
            and self.per_device % self.stripe == 0
            and 0 < self.max_payload <= self.per_device * self.devices
        )


@dataclass(frozen=True, slots=True)
class TierNames:
    """The files of one owner (``kv-w0``, ``kv-mp``, a host's ``kv-w0-<host>``)
    in a tier's directories: a slab per path, the header file, the lock file
    and the change log (a shared tier's, :mod:`lmcache_tiered.storage.changes`)
    on the first."""

    paths: tuple[str, ...]
    owner: str

    HEADER: ClassVar[str] = ".hdr"

    @property
    def slabs(self) -> list[str]:
        return [os.path.join(p, f"{self.owner}.slab") for p in self.paths]

    @property
    def header(self) -> str:
        return os.path.join(self.paths[0], f"{self.owner}{self.HEADER}")

    @property
    def lock(self) -> str:
        return os.path.join(self.paths[0], f"{self.owner}.lock")

    @property
    def changes(self) -> str:
        return os.path.join(self.paths[0], f"{self.owner}.changes")

    @staticmethod
    def host_owner(owner: str, host_id: str) -> str:
        """The owner of a host's files in a tier several hosts share
        (``kv-w0`` of host ``a``: ``kv-w0-a``; owners are ``kv-<role>``)."""
        return f"{owner}-{host_id}"

    @staticmethod
    def host_of(owner: str) -> str:
        """The host id in such an owner's name (:meth:`host_owner`)."""
        return owner.split("-", 2)[-1]

    @classmethod
    def owner_of(cls, file_name: str) -> str | None:
        """The owner whose header file is called ``file_name``, if it is one."""
        return (
            file_name.removesuffix(cls.HEADER)
            if file_name.endswith(cls.HEADER)
            else None
        )


def read_superblock(header_name: str) -> Geometry | None:
    """The geometry recorded in a header file; None if there is none (no
    file, or no valid superblock). The file is opened as a tier opens it
    (never through a link, never blocking on a FIFO): OSError otherwise."""
    try:
        fd = open_regular(header_name, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return Geometry.decode_superblock(os.pread(fd, HEADER_SIZE, 0))
    finally:
        os.close(fd)


def scan_headers(
    read: Callable[[int, int], bytes | memoryview], slots: int, max_payload: int
) -> tuple[list[tuple[int, RecordHeader | CorruptRecord]], int]:
    """Decode the header blocks of slots ``[0, slots)``, SCAN_BYTES at a time.

    ``read(first, count)`` returns the blocks of slots ``first`` to
    ``first + count - 1``, shorter where the file ends; the scan stops there.
    Returns every non-empty block (its header, or why it is not one) and the
    number of whole blocks read.
    """
    found: list[tuple[int, RecordHeader | CorruptRecord]] = []
    per_read = SCAN_BYTES // HEADER_SIZE
    for first in range(0, slots, per_read):
        count = min(per_read, slots - first)
        data = read(first, count)
        whole = len(data) // HEADER_SIZE
        found += decode_header_blocks(data, first, max_payload)
        if whole < count:
            return found, first + whole
    return found, slots


_Item = TypeVar("_Item")


def newest(
    items: Iterable[_Item], header: Callable[[_Item], RecordHeader]
) -> tuple[dict[bytes, _Item], list[_Item]]:
    """The record a tier serves per key (highest sequence wins), in sequence
    order of the winners, and the stale older copies it ignores."""
    live: dict[bytes, _Item] = {}
    stale: list[_Item] = []
    for item in sorted(items, key=lambda i: header(i).sequence):
        digest = key_digest(header(item).key)
        if (old := live.pop(digest, None)) is not None:
            stale.append(old)
        live[digest] = item
    return live, stale
