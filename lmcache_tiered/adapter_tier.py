"""A cold tier on a store LMCache already speaks to: any of its L2 adapters.

``tiered.cold.adapter`` (multi-process mode: ``cold.adapter``) takes the JSON
LMCache's ``lmcache server --l2-adapter`` takes, e.g. ``{"type": "resp",
"host": "redis.internal", "port": 6379}``; the adapter is built by LMCache's
own parser and factory, so every adapter type it ships (``resp``/``valkey``,
``s3``, ``mooncake_store``, ``fs``, ...) works and is configured as LMCache
documents it.

Records: each chunk is two objects in the store, named by the same digest of
the key the file tiers use (:func:`lmcache_tiered.keys.key_digest`), so every
host and process finds the same chunk under the same name: the payload
(object group 0) and then our 4 KiB record header (group 1: shape, dtype,
size, CRC), written in that order, so a chunk is visible only once whole.
The header tells a reader the payload's exact size (LMCache's Redis client
fails a read into a buffer of another size) and its CRC, checked on every
read: bytes that are not the ones written are a miss, never served. Reads
follow LMCache's own protocol, lookup-and-lock, load what was found, unlock:
its Redis client drops the connection on a read of a missing key.

What this process knows is stored (headers it wrote or read) is kept in a
bounded index, so the cache's many per-key questions cost no round trip;
:meth:`AdapterTier.discover` asks the store, in one batch, for the keys of a
lookup the index lacks (chunks other hosts stored). Eviction is the store's
own (Redis ``maxmemory-policy``, LMCache's ``eviction`` JSON): a chunk it
dropped is a miss at the next read.

Failure: every operation waits at most :data:`TIMEOUT_S`; the buffers of one
that did not finish stay referenced (the adapter may still write into them).
LMCache's native Redis client never reconnects after the server goes away and
can leave operations pending forever, so a prober checks the store every
:data:`PROBE_S` seconds with a small write and read of its own, of one of
:data:`PROBE_OBJECTS` objects in turn until one passes (on a cluster they are
likely on different nodes: one node lost is then the misses of its slots,
not a failed check); a failed check (every probe object failed), a
timed-out operation or :data:`DEGRADE_AFTER` failed operations in a
row make the tier *degraded* (lookups and reads miss, writes are dropped, one
WARNING line), the adapter is abandoned, and the prober builds a new one until
a check passes; the index then starts empty, since the store may have
restarted empty.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.memory_management import MemoryObj, TensorMemoryObj

from lmcache_tiered._lmcache import build_l2_adapter, flat_memory_obj
from lmcache_tiered.config import PREFIX, ConfigError, TieredConfig
from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.keys import DIGEST_SIZE, StoreKey, key_digest
from lmcache_tiered.layout import (
    HEADER_SIZE,
    CorruptRecord,
    RecordHeader,
    align_up,
    payload_checksum,
)
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.payload import Allocator, Payload, payload_view

logger = logging.getLogger("lmcache_tiered")

#: Seconds one store operation may take before the store counts as hung.
TIMEOUT_S = 5.0
#: Seconds between the prober's checks of the store.
PROBE_S = 2.0
#: Probe objects per tier, tried in turn until one answers (cluster nodes).
PROBE_OBJECTS = 4
#: Failed operations in a row (no success between) that degrade the tier.
DEGRADE_AFTER = 3
#: Headers kept in memory; older ones are asked for again at their next lookup.
MAX_INDEX = 1 << 18
#: The model name of our objects in the store (their namespace).
NAMESPACE = "lmcache-tiered"
#: Object groups of a chunk's two objects in the store.
PAYLOAD_GROUP, HEADER_GROUP = 0, 1
#: Seconds between polls of an operation's result.
_POLL_S = 0.0005


@dataclass(frozen=True, slots=True)
class StoreEngine:
    """What the tier reports as its I/O engine (status, ``inspect``)."""

    name: str
    supports_fixed_buffers: bool = False

    def register_buffers(self, regions: Sequence[memoryview]) -> bool:
        """A store takes no fixed buffers (reads land in buffers of ours)."""
        return False


def _object_key(digest: bytes, group: int) -> ObjectKey:
    """The store's name of one object of the chunk with key digest ``digest``."""
    return ObjectKey(
        chunk_hash=digest, model_name=NAMESPACE, kv_rank=0, object_group_id=group
    )


def probe_key(owner: str) -> ObjectKey:
    """The object the prober named ``owner`` writes and reads back (a tier:
    its host and process; ``inspect``: its host, looked up only)."""
    digest = hashlib.blake2b(f"probe@{owner}".encode(), digest_size=DIGEST_SIZE)
    return _object_key(digest.digest(), PAYLOAD_GROUP)


def build_adapter(spec: Mapping[str, Any]) -> L2AdapterInterface:
    """The adapter ``spec`` (``tiered.cold.adapter``) describes, built by
    LMCache; ConfigError naming the setting for a spec LMCache refuses."""
    try:
        return build_l2_adapter(json.dumps(spec))
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{PREFIX}cold.adapter: {exc}") from None


def answer(query: Callable[[], Any], timeout: float) -> Any:
    """Poll ``query`` until it answers (not None), for at most ``timeout``
    seconds; None if it never did."""
    deadline = time.monotonic() + timeout
    while (result := query()) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)
    return result


class _Broken(Exception):
    """The store did not answer in time: the tier degrades."""


class AdapterTier:
    """The cold tier over an LMCache L2 adapter: a
    :class:`lmcache_tiered.tier_protocol.StorageTier` (see the module
    docstring for what differs from a file tier)."""

    name = "cold"
    paths: tuple[str, ...] = ()
    direct_io = False

    def __init__(self, settings: TieredConfig, *, max_payload: int) -> None:
        spec = settings.cold_adapter
        assert spec is not None
        self.spec = spec
        self.engine = StoreEngine(f"l2:{spec['type']}")
        self.max_payload = max_payload
        self.stats = TierStats()
        self.degraded: str | None = None
        self._index: OrderedDict[bytes, RecordHeader] = OrderedDict()
        self._lock = threading.Lock()
        self._failures = 0
        self._used = 0
        #: buffers of operations that never finished, kept for the adapter
        self._abandoned: list[Any] = []
        self._stores_done: dict[int, Any] = {}
        # one per process (deleted at close): two processes probing one
        # object could see each other's writes as a failed check
        self._probe_keys = [
            probe_key(f"{settings.host_id}@{os.getpid()}#{i}")
            for i in range(PROBE_OBJECTS)
        ]
        self._adapter: L2AdapterInterface | None = build_adapter(spec)
        self._stop = threading.Event()
        self._prober = threading.Thread(
            target=self._probe_loop, name="lmcache-tiered-store-probe", daemon=True
        )
        self._prober.start()

    # ----------------------------------------------------------------- index

    def __len__(self) -> int:
        return len(self._index)

    def header(self, key: StoreKey) -> RecordHeader | None:
        if self.degraded is not None:
            return None
        return self._index.get(key_digest(key))

    def touch(self, keys: Sequence[StoreKey], pin: bool = False) -> int:
        """Recency in our index only: the store keeps its own."""
        with self._lock:
            if self.degraded is not None:
                return 0
            found = 0
            for key in reversed(keys):
                digest = key_digest(key)
                if digest in self._index:
                    self._index.move_to_end(digest)
                    found += 1
            return found

    def stored_keys(self) -> list[StoreKey]:
        with self._lock:
            return [] if self.degraded else [h.key for h in self._index.values()]

    def pin(self, key: StoreKey) -> bool:
        """Pins are for our own eviction; the store has none to hold off."""
        return self.touch([key]) == 1

    def unpin(self, key: StoreKey) -> bool:
        return False

    def remove(self, key: StoreKey) -> bool:
        return self.remove_many([key]) == 1

    def remove_many(self, keys: Sequence[StoreKey], wait_s: float = 0.0) -> int:
        """Delete ``keys`` from the store in one batch; how many we held.

        Headers go first, so a chunk is invisible before its payload goes; on
        a thread of its own (LMCache's native adapters block up to 30 s),
        waited for up to ``wait_s``."""
        with self._lock:
            digests = [d for k in keys if self._index.pop(d := key_digest(k), None)]
        adapter = self._adapter
        if digests and adapter is not None:
            objects = [_object_key(d, HEADER_GROUP) for d in digests]
            objects += [_object_key(d, PAYLOAD_GROUP) for d in digests]
            deleting = threading.Thread(
                target=_delete, args=(adapter, objects), daemon=True
            )
            deleting.start()
            deleting.join(wait_s)
        return len(digests)

    @property
    def used_bytes(self) -> int:
        """Bytes this process wrote to the store."""
        return self._used

    def _remember(self, headers: Sequence[RecordHeader]) -> None:
        with self._lock:
            for header in headers:
                digest = key_digest(header.key)
                self._index[digest] = header
                self._index.move_to_end(digest)
            while len(self._index) > MAX_INDEX:
                self._index.popitem(last=False)

    def _forget(self, keys: Sequence[StoreKey]) -> None:
        with self._lock:
            for key in keys:
                self._index.pop(key_digest(key), None)

    def discover(self, keys: Sequence[StoreKey]) -> None:
        """Ask the store, in one batch, for the headers of ``keys`` the index
        lacks (chunks other hosts or earlier processes stored)."""
        if self.degraded is not None:
            return
        wanted = {key_digest(k): k for k in keys if self.header(k) is None}
        if not wanted:
            return
        digests = list(wanted)
        buffers = [torch.empty(HEADER_SIZE, dtype=torch.uint8) for _ in digests]
        ok = self._load([_object_key(d, HEADER_GROUP) for d in digests], buffers)
        found = []
        for digest, buffer, good in zip(digests, buffers, ok, strict=True):
            if not good:
                continue
            try:
                header = RecordHeader.decode(buffer.numpy().data, self.max_payload)
            except CorruptRecord:
                self.stats.corrupt += 1
                continue
            if key_digest(header.key) == digest:  # else a foreign object
                found.append(header)
        self._remember(found)

    # ------------------------------------------------------------------ reads

    def read(
        self, keys: Sequence[StoreKey], allocate: Allocator
    ) -> list[MemoryObj | None]:
        """Read ``keys`` through buffers of our own (an abandoned read may land
        late), check each CRC, then copy into ``allocate``'s objects."""
        headers = [self.header(k) for k in keys]
        objs = [None if h is None else allocate(h) for h in headers]
        wanted = [
            h if o is not None else None for h, o in zip(headers, objs, strict=True)
        ]
        payloads = self._read_checked(keys, wanted)
        for i, (obj, payload) in enumerate(zip(objs, payloads, strict=True)):
            if obj is None:
                continue
            if payload is None:
                obj.ref_count_down()
                objs[i] = None
            else:
                payload_view(obj)[: len(payload)] = payload
        return objs

    def read_payloads(self, keys: Sequence[StoreKey]) -> list[Payload | None]:
        headers = [self.header(k) for k in keys]
        views = self._read_checked(keys, headers)
        out: list[Payload | None] = []
        for h, view in zip(headers, views, strict=True):
            if h is None or view is None:
                out.append(None)
                continue
            buffer = aligned_buffer(align_up(h.payload_size))
            buffer[: h.payload_size] = view
            out.append(Payload.read_back(h, buffer))
        return out

    def _read_checked(
        self, keys: Sequence[StoreKey], headers: Sequence[RecordHeader | None]
    ) -> list[memoryview | None]:
        """Payload bytes of each key with a header, CRC-checked; a key that
        misses or fails its check leaves the index."""
        index = [i for i, h in enumerate(headers) if h is not None]
        self.stats.misses += len(keys) - len(index)
        out: list[memoryview | None] = [None] * len(keys)
        if not index:
            return out
        buffers = []
        for i in index:
            header = headers[i]
            assert header is not None
            buffers.append(torch.empty(header.payload_size, dtype=torch.uint8))
        started = time.perf_counter()
        ok = self._load(
            [_object_key(key_digest(keys[i]), PAYLOAD_GROUP) for i in index], buffers
        )
        self.stats.read_latency.observe(time.perf_counter() - started)
        lost = []
        for i, buffer, good in zip(index, buffers, ok, strict=True):
            header = headers[i]
            assert header is not None
            view = buffer.numpy().data.cast("B")
            if good and header.payload_matches(view):
                out[i] = view
                self.stats.hits += 1
                self.stats.bytes_read += header.payload_size
                continue
            if good:
                self.stats.corrupt += 1
            self.stats.misses += 1
            lost.append(keys[i])
        self._forget(lost)
        return out

    # ----------------------------------------------------------------- writes

    def write_payloads(
        self,
        payloads: Sequence[Payload],
        evict_only: Collection[StoreKey] | None = None,
    ) -> list[bool]:
        """Store each chunk (payload, then header); True for each stored when
        this returns. Payloads are copied first: the caller's memory may be
        reused before an abandoned write is done with it."""
        stored = [self.header(p.key) is not None for p in payloads]
        todo = [i for i, done in enumerate(stored) if not done]
        if self.degraded is not None:
            self.stats.puts_dropped += len(todo)
            return stored
        big = [i for i in todo if len(payloads[i].view) > self.max_payload]
        self.stats.puts_dropped += len(big)
        todo = [i for i in todo if i not in big]
        if not todo:
            return stored
        headers = [
            RecordHeader(
                key=payloads[i].key,
                shape=payloads[i].shape,
                dtype=payloads[i].dtype,
                fmt=payloads[i].fmt,
                payload_size=len(payloads[i].view),
                payload_crc=payload_checksum(payloads[i].view),
                sequence=0,
                created_ns=time.time_ns(),
            )
            for i in todo
        ]
        digests = [key_digest(payloads[i].key) for i in todo]
        bodies = [
            torch.frombuffer(bytearray(payloads[i].view), dtype=torch.uint8)
            for i in todo
        ]
        blocks = [
            torch.frombuffer(bytearray(h.encode()), dtype=torch.uint8) for h in headers
        ]
        if not (
            self._store([_object_key(d, PAYLOAD_GROUP) for d in digests], bodies)
            and self._store([_object_key(d, HEADER_GROUP) for d in digests], blocks)
        ):
            self.stats.puts_dropped += len(todo)
            self.stats.io_errors += 1
            return stored
        self._remember(headers)
        for i, header in zip(todo, headers, strict=True):
            stored[i] = True
            self.stats.puts += 1
            self.stats.bytes_written += header.payload_size
            self._used += header.payload_size + HEADER_SIZE
        return stored

    # ---------------------------------------------------------- the adapter

    def _load(
        self, keys: list[ObjectKey], buffers: list[torch.Tensor], probing: bool = False
    ) -> list[bool]:
        """Load ``keys`` into ``buffers`` (exact sizes); per key whether it
        landed. As LMCache's controllers do: look up and lock, load what was
        found, unlock (LMCache's Redis client drops its connection on a read
        of a missing key). Misses when degraded or when the store fails."""
        adapter = self._adapter
        landed = [False] * len(keys)
        if adapter is None or self.degraded is not None:
            return landed
        objs = [flat_memory_obj(b) for b in buffers]
        found: list[int] = []
        try:
            task = adapter.submit_lookup_and_lock_task(keys, {})
            held = self._wait(lambda: adapter.query_lookup_and_lock_result(task), [])
            found = [i for i in range(len(keys)) if held.test(i)]
            if found:
                task = adapter.submit_load_task(
                    [keys[i] for i in found], [objs[i] for i in found]
                )
                bitmap = self._wait(lambda: adapter.query_load_result(task), objs)
                for n, i in enumerate(found):
                    landed[i] = bool(bitmap.test(n))
        except _Broken as exc:
            self._degrade(str(exc))
            return [False] * len(keys)
        except Exception:
            logger.exception("lmcache_tiered: store load failed")
            self._failed(probing)
            return [False] * len(keys)
        finally:
            if found:
                adapter.submit_unlock([keys[i] for i in found])
        self._failures = 0
        return landed

    def _store(
        self, keys: list[ObjectKey], buffers: list[torch.Tensor], probing: bool = False
    ) -> bool:
        adapter = self._adapter
        if adapter is None or self.degraded is not None:
            return False
        objs = [flat_memory_obj(b) for b in buffers]
        try:
            task = adapter.submit_store_task(keys, objs)
            result = self._wait(lambda: self._store_result(adapter, task), objs)
        except _Broken as exc:
            self._degrade(str(exc))
            return False
        except Exception:
            logger.exception("lmcache_tiered: store write failed")
            self._failed(probing)
            return False
        if not result.is_successful():
            self._failed(probing)
            return False
        self._failures = 0
        return True

    def _store_result(self, adapter: L2AdapterInterface, task: int) -> Any:
        """The result of store ``task``: LMCache pops every finished store at
        once, so each caller files the others' for them."""
        with self._lock:
            self._stores_done.update(adapter.pop_completed_store_tasks())
            return self._stores_done.pop(task, None)

    def _wait(self, query: Callable[[], Any], objs: list[TensorMemoryObj]) -> Any:
        """Poll ``query`` until it answers; after :data:`TIMEOUT_S` keep the
        operation's buffers for good and raise _Broken."""
        result = answer(query, TIMEOUT_S)
        if result is None:
            self._abandoned.append(objs)
            raise _Broken(f"an operation took over {TIMEOUT_S:.0f} s")
        return result

    def _failed(self, probing: bool = False) -> None:
        """Count a failed operation; a probe's are the prober's to judge."""
        if probing:
            return
        self._failures += 1
        if self._failures >= DEGRADE_AFTER:
            self._degrade(f"{self._failures} operations in a row failed")

    def _degrade(self, why: str) -> None:
        with self._lock:
            if self.degraded is not None:
                return
            self.degraded = why
            self.stats.degradations += 1
            adapter, self._adapter = self._adapter, None
            self._index.clear()
        logger.warning(
            "lmcache_tiered: cold store (%s) degraded: %s; its chunks are misses "
            "until it answers again (checked every %.0f s)",
            self.engine.name,
            why,
            PROBE_S,
        )
        if adapter is not None:
            close_later(adapter)

    @property
    def probe_keys(self) -> tuple[ObjectKey, ...]:
        """The store objects the prober writes, in the order it tries them."""
        return tuple(self._probe_keys)

    def _probe(self) -> bool:
        """A small write and read back of our probe objects, in turn, until one
        passes (the one that passed is tried first next time)."""
        for _ in range(len(self._probe_keys)):
            if self._probe_one(self._probe_keys[0]):
                return True
            self._probe_keys.append(self._probe_keys.pop(0))
        return False

    def _probe_one(self, key: ObjectKey) -> bool:
        data = torch.full((HEADER_SIZE,), 0x5A, dtype=torch.uint8)
        if not self._store([key], [data], probing=True):
            return False
        back = torch.zeros(HEADER_SIZE, dtype=torch.uint8)
        landed = self._load([key], [back], probing=True)[0]
        return landed and bool(torch.equal(back, data))

    def _probe_loop(self) -> None:
        while not self._stop.wait(PROBE_S):
            if self.degraded is None:
                if not self._probe():
                    self._degrade("the store failed a check")
                continue
            try:
                adapter = build_adapter(self.spec)
            except Exception as exc:
                logger.debug("lmcache_tiered: cold store not back: %s", exc)
                continue
            self._adapter, self.degraded, self._failures = adapter, None, 0
            if self._probe():
                logger.warning(
                    "lmcache_tiered: cold store (%s) answers again", self.engine.name
                )
            else:
                self._degrade("the store failed a check")

    def close(self) -> None:
        self._stop.set()
        self._prober.join(TIMEOUT_S * 3)
        adapter, self._adapter = self._adapter, None
        if adapter is not None:
            # our probe object goes with us, unless the store is unreachable
            probe = list(self.probe_keys) if self.degraded is None else []
            close_later(adapter, delete_first=probe).join(TIMEOUT_S)


def _delete(adapter: L2AdapterInterface, objects: list[ObjectKey]) -> None:
    try:
        adapter.delete(objects)
    except Exception:
        logger.exception("lmcache_tiered: store delete failed")


def close_later(
    adapter: L2AdapterInterface, delete_first: list[ObjectKey] | None = None
) -> threading.Thread:
    """Close ``adapter`` (after deleting ``delete_first``) on a daemon thread:
    a client stuck on a hung store may never return from either."""

    def close() -> None:
        if delete_first:
            _delete(adapter, delete_first)
        adapter.close()

    thread = threading.Thread(
        target=close, name="lmcache-tiered-store-close", daemon=True
    )
    thread.start()
    return thread
