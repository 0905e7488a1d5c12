"""One suite every storage tier passes, whatever stores its bytes (as
zarr-python's ``StoreTests`` runs against every store): the file tier on
real files with O_DIRECT, and the store-backed tier on a real Redis. A new
kind of tier gets a subclass of :class:`StorageTierTests` with its own
``open_tier`` and passes the same tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import new_allocator, random_kv
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from test_store_tier import Redis

from lmcache_tiered.config import TieredConfig
from lmcache_tiered.storage.adapter_tier import AdapterTier
from lmcache_tiered.storage.base import StorageTier
from lmcache_tiered.storage.layout import RecordHeader
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.tier import Tier

SHAPE = torch.Size([2, 2, 64, 128])  # 64 KiB of bf16: one slot
MAX_PAYLOAD = 64 << 10
#: opens the tier under test anew over the same storage (a restart)
Opener = Callable[[], StorageTier]


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("suite-model", 1, 0, 7000 + i, torch.bfloat16, None)


class StorageTierTests:
    """What every :class:`StorageTier` keeps; subclasses give ``open_tier``."""

    held: list[MemoryObj]

    @pytest.fixture(autouse=True)
    def hold(self) -> None:
        self.held = []

    @pytest.fixture
    def open_tier(self) -> Iterator[Opener]:
        raise NotImplementedError

    @pytest.fixture
    def tier(self, open_tier: Opener) -> StorageTier:
        return open_tier()

    @pytest.fixture
    def allocate(self) -> Callable[[RecordHeader], MemoryObj]:
        allocator = new_allocator(32 << 20)

        def allocate(header: RecordHeader) -> MemoryObj:
            obj = allocator.allocate(header.shape, header.dtype, header.fmt)
            assert obj is not None
            return obj

        return allocate

    def payloads(self, seeds: range) -> list[Payload]:
        """Chunks of known bytes; their MemoryObjs are kept alive with the
        test (an object dropped gives its memory to the next one)."""
        allocator = new_allocator(16 << 20)
        out = []
        for seed in seeds:
            obj = allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
            assert obj is not None and obj.tensor is not None
            obj.tensor.copy_(random_kv(SHAPE, seed))
            self.held.append(obj)
            out.append(Payload.of(key(seed), obj))
        return out

    def test_what_is_written_is_read_back_exact(
        self, tier: StorageTier, allocate: Callable[[RecordHeader], MemoryObj]
    ) -> None:
        assert tier.write_payloads(self.payloads(range(3))) == [True] * 3
        got = tier.read([key(i) for i in range(3)], allocate)
        for i, obj in enumerate(got):
            assert obj is not None and obj.tensor is not None
            assert torch.equal(obj.tensor, random_kv(SHAPE, i))
        payloads = tier.read_payloads([key(1)])
        assert payloads[0] is not None and payloads[0].key == key(1)
        assert tier.stats.hits >= 4 and tier.stats.bytes_read >= 4 * (64 << 10)

    def test_a_miss_is_none_and_counted(
        self, tier: StorageTier, allocate: Callable[[RecordHeader], MemoryObj]
    ) -> None:
        tier.write_payloads(self.payloads(range(1)))
        misses = tier.stats.misses
        assert tier.read([key(0), key(9)], allocate)[1] is None
        assert tier.read_payloads([key(9)]) == [None]
        assert tier.stats.misses == misses + 2

    def test_the_index_answers_without_io(self, tier: StorageTier) -> None:
        assert len(tier) == 0 and tier.header(key(0)) is None
        assert not tier.contains(key(0))
        tier.write_payloads(self.payloads(range(2)))
        header = tier.header(key(0))
        assert header is not None and header.key == key(0)
        assert header.payload_size == SHAPE.numel() * 2
        assert tier.contains(key(1)) and tier.touch([key(0), key(1), key(5)]) == 2
        assert set(tier.stored_keys()) == {key(0), key(1)} and len(tier) == 2
        assert tier.used_bytes > 0

    def test_a_key_written_twice_is_stored_once(self, tier: StorageTier) -> None:
        (first,) = self.payloads(range(1))
        assert tier.write_payloads([first]) == [True]
        assert tier.write_payloads([first]) == [True]
        assert tier.stored_keys() == [key(0)] and tier.stats.puts == 1

    def test_removed_keys_are_gone(
        self, tier: StorageTier, allocate: Callable[[RecordHeader], MemoryObj]
    ) -> None:
        tier.write_payloads(self.payloads(range(3)))
        assert tier.remove(key(0)) and not tier.remove(key(0))
        assert tier.remove_many([key(1), key(2), key(8)]) == 2
        assert tier.read([key(0), key(1), key(2)], allocate) == [None] * 3
        assert len(tier) == 0

    def test_pins_hold_only_stored_keys(self, tier: StorageTier) -> None:
        tier.write_payloads(self.payloads(range(1)))
        assert tier.pin(key(0)) and not tier.pin(key(3))
        tier.unpin(key(0))
        assert tier.contains(key(0), pin=True)

    def test_a_restarted_tier_serves_what_was_written(
        self,
        open_tier: Opener,
        tier: StorageTier,
        allocate: Callable[[RecordHeader], MemoryObj],
    ) -> None:
        """A new instance over the same storage finds the chunks: from its
        files, or by asking the store (:attr:`supports_discovery`)."""
        tier.write_payloads(self.payloads(range(2)))
        tier.close()
        again = open_tier()
        if again.supports_discovery:
            assert again.header(key(0)) is None  # unknown until asked
            again.discover([key(0), key(1), key(4)])
        else:
            again.discover([key(0)])  # nothing to ask: a no-op
        assert again.header(key(0)) is not None and again.header(key(4)) is None
        (got,) = again.read([key(1)], allocate)
        assert got is not None and got.tensor is not None
        assert torch.equal(got.tensor, random_kv(SHAPE, 1))

    def test_it_reports_what_it_is(self, tier: StorageTier) -> None:
        assert tier.name in ("warm", "cold")
        assert tier.engine_name and isinstance(tier.direct_io, bool)
        assert tier.degraded is None and tier.writes_refused is None
        # every tier accepts the declaration; only some are made cheaper by it
        assert isinstance(tier.register_buffers([memoryview(bytearray(4096))]), bool)


class TestFileTier(StorageTierTests):
    @pytest.fixture
    def open_tier(self, device_dirs: list[Path]) -> Iterator[Opener]:
        opened: list[StorageTier] = []

        def open_tier() -> StorageTier:
            config = TieredConfig.from_extra_config(
                {"tiered.warm.paths": [str(d) for d in device_dirs]}
            )
            tier = Tier(
                config.tier_options(config.warm),
                owner="kv-w0",
                max_payload=MAX_PAYLOAD,
                capacity_bytes=8 << 20,
            )
            opened.append(tier)
            return tier

        yield open_tier
        for tier in opened:
            tier.close()

    def test_its_capabilities(self, tier: StorageTier) -> None:
        assert not tier.supports_discovery and not tier.evicts_itself
        assert len(tier.paths) == 2


@pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (apt-get install redis-server; "
    ".ci/run installs it)",
)
class TestStoreTier(StorageTierTests):
    @pytest.fixture
    def open_tier(self, tmp_path: Path) -> Iterator[Opener]:
        server = Redis()
        opened: list[StorageTier] = []

        def open_tier() -> StorageTier:
            config = TieredConfig.from_extra_config(
                {
                    "tiered.warm.paths": [str(tmp_path)],
                    "tiered.cold.adapter": server.adapter,
                }
            )
            tier = AdapterTier(config, max_payload=MAX_PAYLOAD)
            opened.append(tier)
            return tier

        yield open_tier
        for tier in opened:
            tier.close()
        server.stop()

    def test_its_capabilities(self, tier: StorageTier) -> None:
        assert tier.supports_discovery and tier.evicts_itself
        assert tuple(tier.paths) == () and not tier.direct_io
