"""Record headers and slot geometry: round trips, and any bytes are a clean miss."""

from __future__ import annotations

import dataclasses
import hashlib
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered.keys import DIGEST_SIZE, StoreKey, key_digest, key_text
from lmcache_tiered.storage.layout import (
    HEADER_SIZE,
    MAC_SIZE,
    SEALED_VERSION,
    CorruptRecord,
    Geometry,
    RecordHeader,
    payload_checksum,
)
from lmcache_tiered.storage.seal import MIN_SECRET_BYTES, RecordSeal

KEY = CacheEngineKey("model/x", 4, 1, 0xABCDEF0123, torch.bfloat16, None)


def make_header(**changes: object) -> RecordHeader:
    fields: dict[str, object] = {
        "key": KEY,
        "shape": torch.Size([2, 2, 256, 128]),
        "dtype": torch.bfloat16,
        "fmt": MemoryFormat.KV_2LTD,
        "payload_size": 2 * 2 * 256 * 128 * 2,
        "payload_crc": 0x1234,
        "sequence": 7,
        "created_ns": 99,
    }
    fields.update(changes)
    return RecordHeader(**fields)  # type: ignore[arg-type]


def test_a_sealed_header_round_trips_and_its_mac_binds_what_it_is() -> None:
    """Version 3 carries a MAC of what the record is and of its payload: a
    record of another shape, other bytes, another secret or no MAC fails."""
    seal = RecordSeal(b"k" * MIN_SECRET_BYTES)
    header = make_header()
    payload = memoryview(bytes(range(256)) * (header.payload_size // 256))
    sealed = dataclasses.replace(
        header, version=SEALED_VERSION, mac=seal.mac(header.identity(), payload)
    )
    decoded = RecordHeader.decode(sealed.encode(), max_payload=1 << 20)
    assert decoded == sealed and len(decoded.mac) == MAC_SIZE
    assert seal.verifies(decoded, payload)
    assert not seal.verifies(header, payload)  # version 2: no MAC
    assert not RecordSeal(b"o" * MIN_SECRET_BYTES).verifies(decoded, payload)
    reshaped = dataclasses.replace(decoded, shape=torch.Size([2, 2, 128, 256]))
    assert not seal.verifies(reshaped, payload)
    assert not seal.verifies(decoded, memoryview(bytes(len(payload))))
    with pytest.raises(ValueError, match="MAC"):
        dataclasses.replace(header, version=SEALED_VERSION).encode()
    assert "k" * 8 not in repr(seal)


def test_header_round_trip() -> None:
    header = make_header()
    block = header.encode()
    assert len(block) == HEADER_SIZE
    assert RecordHeader.decode(block, max_payload=1 << 20) == header


def test_payload_checksum_per_record_version() -> None:
    """Version 2 is CRC32C (the iSCSI/ext4 polynomial), version 1 zlib's CRC32."""
    data = memoryview(b"123456789")
    assert payload_checksum(data) == 0xE3069283  # the CRC32C check value
    assert payload_checksum(data, 1) == zlib.crc32(data) == 0xCBF43926
    old = make_header(version=1, payload_crc=0xCBF43926)
    assert RecordHeader.decode(old.encode(), 1 << 20) == old
    assert old.payload_matches(data) and not make_header().payload_matches(data)


def _keys_one_field_apart() -> list[StoreKey]:
    """Fresh objects each call; every key differs from the first in one field."""
    tags = {"lmcache.tag.user": "u1"}
    return [
        CacheEngineKey("m", 1, 0, 5, torch.float16, None),
        CacheEngineKey("m", 1, 0, 5, torch.float16, tags),
        CacheEngineKey("m", 1, 0, 5, torch.bfloat16, None),
        CacheEngineKey("m", 1, 1, 5, torch.float16, None),
        CacheEngineKey("m2", 1, 0, 5, torch.float16, None),
        LayerCacheEngineKey("m", 1, 0, 5, torch.float16, None, layer_id=0),
        LayerCacheEngineKey("m", 1, 0, 5, torch.float16, None, layer_id=1),
        ObjectKey(b"\x05" * 16, "m", 0),
        ObjectKey(b"\x05" * 16, "m", 0, cache_salt="s"),
        ObjectKey(b"\x05" * 16, "m", 0, object_group_id=1),
        ObjectKey(b"\x05" * 16, "m", 1),
        ObjectKey(b"\x05" * 16, "m/x y", 0),
    ]


def test_remembered_digests_are_each_keys_own() -> None:
    """key_digest remembers digests per key: an equal key found in its memory
    must have the same text, so no two keys one field apart share a digest,
    and each is the digest of its own text, asked first or again."""
    for _ in range(2):
        digests = [key_digest(k) for k in _keys_one_field_apart()]
        texts = [key_text(k).encode() for k in _keys_one_field_apart()]
        assert digests == [
            hashlib.blake2b(t, digest_size=DIGEST_SIZE).digest() for t in texts
        ]
        assert len(set(digests)) == len(digests)


def test_tagged_key_round_trip() -> None:
    key = CacheEngineKey("m", 1, 0, 5, torch.float16, {"lmcache.tag.user": "u1"})
    header = make_header(key=key)
    assert RecordHeader.decode(header.encode(), 1 << 20).key == key


@pytest.mark.parametrize("position", [0, 9, 40, 60, 100])
def test_any_flipped_header_byte_is_detected(position: int) -> None:
    block = bytearray(make_header().encode())
    block[position] ^= 0x01
    with pytest.raises(CorruptRecord):
        RecordHeader.decode(bytes(block), 1 << 20)


def test_payload_larger_than_slot_is_refused() -> None:
    """A header cannot make the reader allocate more than a slot holds."""
    with pytest.raises(CorruptRecord, match="payload size"):
        RecordHeader.decode(make_header().encode(), max_payload=4096)


def test_shape_must_match_payload_size() -> None:
    bad = make_header(shape=torch.Size([1 << 20, 1 << 20]))
    with pytest.raises(CorruptRecord, match="payload size"):
        RecordHeader.decode(bad.encode(), max_payload=1 << 30)


@settings(max_examples=300)
@given(st.binary(max_size=HEADER_SIZE))
def test_random_bytes_are_a_clean_miss(data: bytes) -> None:
    with pytest.raises(CorruptRecord):
        RecordHeader.decode(data, 1 << 30)


@given(st.binary(min_size=1, max_size=64), st.integers(0, 200))
def test_spliced_valid_header_is_a_clean_miss(junk: bytes, at: int) -> None:
    block = bytearray(make_header().encode())
    block[at : at + len(junk)] = junk
    block = block[:HEADER_SIZE]
    try:
        header = RecordHeader.decode(bytes(block), 1 << 20)
    except CorruptRecord:
        return
    assert header == make_header()  # only an identical splice may pass


@pytest.mark.parametrize(
    ("devices", "stripe", "payload", "per_device"),
    [
        (1, 1 << 20, 4 << 20, 4 << 20),
        (2, 1 << 20, 4 << 20, 2 << 20),
        (4, 1 << 20, 4 << 20, 1 << 20),
        (2, 1 << 20, 256 << 10, 128 << 10),  # small chunks still use both devices
    ],
)
def test_geometry_splits_evenly(
    devices: int, stripe: int, payload: int, per_device: int
) -> None:
    geometry = Geometry.plan(devices, stripe, payload)
    assert geometry.per_device == per_device
    assert geometry.stripe <= stripe


@given(
    st.integers(1, 6),
    st.sampled_from([4096, 65536, 1 << 20]),
    st.integers(1, 64 << 20),
)
def test_extents_tile_the_payload_without_overlap(
    devices: int, stripe: int, payload: int
) -> None:
    geometry = Geometry.plan(devices, stripe, payload)
    assert geometry.stripe % 4096 == 0
    assert geometry.per_device * devices < payload + devices * geometry.stripe + 1
    slot = 3
    extents = geometry.extents(slot, payload)
    assert sum(e.length for e in extents) == payload
    assert [e.start for e in extents] == sorted(e.start for e in extents)
    used: dict[int, list[tuple[int, int]]] = {}
    for extent in extents:
        assert extent.offset % 4096 == 0
        low = slot * geometry.per_device
        assert low <= extent.offset
        assert extent.offset + extent.length <= low + geometry.per_device
        used.setdefault(extent.device, []).append((extent.offset, extent.length))
    for ranges in used.values():
        ranges.sort()
        for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False):
            assert a + n <= b
    assert len(used) == min(devices, len(extents))


def test_superblock_round_trip_and_damage() -> None:
    geometry = Geometry.plan(3, 1 << 20, 4 << 20)
    block = geometry.encode_superblock()
    assert Geometry.decode_superblock(block) == geometry
    damaged = bytearray(block)
    damaged[12] ^= 0xFF
    assert Geometry.decode_superblock(bytes(damaged)) is None
    assert Geometry.decode_superblock(b"") is None
