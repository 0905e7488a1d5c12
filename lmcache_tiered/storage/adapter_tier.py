"""A cold tier on a store LMCache already speaks to: any of its L2 adapters.

``tiered.cold.adapter`` (multi-process mode: ``cold.adapter``) takes the JSON
LMCache's ``lmcache server --l2-adapter`` takes, e.g. ``{"type": "resp",
"host": "redis.internal", "port": 6379}``; the adapter is built by LMCache's
own parser and factory, so every adapter type it ships (``resp``/``valkey``,
``s3``, ``fs``, ...) works and is configured as LMCache documents it, and so
does a ``native_plugin`` connector such as ours for Mooncake Store
(:mod:`lmcache_tiered.storage.mooncake`).

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

Failure: every operation waits at most
:data:`lmcache_tiered.storage.store_client.TIMEOUT_S`; a failed one whose
adapter says its store is lost (our Mooncake connector) is an outage at once.
LMCache's native Redis client never reconnects after the server goes away
and can leave operations pending forever, so the tier's health machine
(:class:`lmcache_tiered.storage.health.TierHealth`, the file tiers' too)
checks the store every :data:`PROBE_S` seconds with a small write and read
back of its own, of one of :data:`PROBE_OBJECTS` objects in turn until one
passes (on a cluster they are likely on different nodes: one node lost is
then the misses of its slots, not a failed check). The store is *down*
(degraded) after a failed check, a timed-out operation or
:data:`~lmcache_tiered.storage.health.DEGRADE_AFTER` failed operations in a
row: lookups and reads answer misses at once and writes are dropped, the
adapter is abandoned, and the prober checks a new one until a check passes;
only then does the tier serve again (its index empty: the store may have
restarted empty). A store that answers reads but refuses writes (full,
read-only) is not down: it *refuses writes* (dropped at once), serving its
chunks until a check's write passes; a write not taken is judged by a check
at once. Each change of state is one WARNING line.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryObj

from lmcache_tiered.config import TieredConfig
from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage import store_client
from lmcache_tiered.storage.base import StorageTier
from lmcache_tiered.storage.health import HealthLines, TierHealth
from lmcache_tiered.storage.layout import (
    HEADER_SIZE,
    CorruptRecord,
    RecordHeader,
    align_up,
    payload_checksum,
)
from lmcache_tiered.storage.payload import Allocator, Payload, payload_view
from lmcache_tiered.storage.seal import RecordSeal, SealedRecords
from lmcache_tiered.storage.store_client import (
    HEADER_GROUP,
    PAYLOAD_GROUP,
    StoreCheck,
    StoreClient,
    StoreUnavailable,
    build_adapter,
    close_later,
    object_key,
    probe_key,
)

logger = logging.getLogger("lmcache_tiered")

#: Seconds between the prober's checks of the store.
PROBE_S = 2.0
#: Probe objects per tier, tried in turn until one answers (cluster nodes).
PROBE_OBJECTS = 4
#: Headers kept in memory; older ones are asked for again at their next lookup.
MAX_INDEX = 1 << 18


class AdapterTier(StorageTier):
    """The cold tier over an LMCache L2 adapter (see the module docstring for
    what differs from a file tier)."""

    name = "cold"
    supports_discovery = True
    evicts_itself = True

    def __init__(
        self,
        settings: TieredConfig,
        *,
        max_payload: int,
        seal: RecordSeal | None = None,
    ) -> None:
        """``seal``: see :class:`lmcache_tiered.storage.tier.Tier`; anyone
        with access to the store can write objects named by a key's digest."""
        spec = settings.cold_adapter
        assert spec is not None
        self.spec = spec
        self.max_payload = max_payload
        self.stats = TierStats()
        #: why it refuses writes while it serves reads, "since T: why"
        self._refused: str | None = None
        self._down_since = self._refused_since = 0.0
        self._index: OrderedDict[bytes, RecordHeader] = OrderedDict()
        self._lock = threading.Lock()
        self._used = 0
        # one per process (deleted at close): two processes probing one
        # object could see each other's writes as a failed check
        self._probe_keys = [
            probe_key(f"{settings.host_id}@{os.getpid()}#{i}")
            for i in range(PROBE_OBJECTS)
        ]
        self._client: StoreClient | None = StoreClient(build_adapter(spec))
        store = f"lmcache_tiered: cold store ({self.engine_name})"
        self._sealed = None if seal is None else SealedRecords(seal, self.stats, store)
        #: down (degraded: "down since T: why") and back, checked while it
        #: serves too: a store can fail with nobody asking it
        self.health = TierHealth(
            self.engine_name,
            self._lock,
            self.stats,
            missing=lambda: None,
            recover=self._recover,
            watch=self._watch,
            on_degrade=self._went_down,
            period=lambda: PROBE_S,
            lines=HealthLines(
                degraded=store + " {why}; its chunks are misses until a check "
                "passes (one every {period:g} s)",
                recovered=store + " {how}",
            ),
        )

    @property
    def engine_name(self) -> str:
        return f"l2:{self.spec['type']}"

    @property
    def degraded(self) -> str | None:
        return self.health.degraded

    @property
    def writes_refused(self) -> str | None:
        return self._refused

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
        a thread of its own, waited for up to ``wait_s``."""
        with self._lock:
            digests = [d for k in keys if self._index.pop(d := key_digest(k), None)]
        client = self._client
        if digests and client is not None:
            objects = [object_key(d, HEADER_GROUP) for d in digests]
            objects += [object_key(d, PAYLOAD_GROUP) for d in digests]
            client.delete_later(objects, wait_s)
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
        wanted = {key_digest(k) for k in keys if self.header(k) is None}
        if self.degraded is not None or not wanted:
            return
        buffers = [torch.empty(HEADER_SIZE, dtype=torch.uint8) for _ in wanted]
        ok = self._load([object_key(d, HEADER_GROUP) for d in wanted], buffers)
        found = []
        for digest, buffer, good in zip(wanted, buffers, ok, strict=True):
            if not good:
                continue
            try:
                header = RecordHeader.decode(buffer.numpy().data, self.max_payload)
            except CorruptRecord:
                self.stats.corrupt += 1
                continue
            if key_digest(header.key) == digest:  # else a foreign object
                found.append(header)
        if self._sealed is not None:
            found = self._sealed.sealed(found, lambda header: header)
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
            [object_key(key_digest(keys[i]), PAYLOAD_GROUP) for i in index], buffers
        )
        self.stats.read_latency.observe(time.perf_counter() - started)
        lost = []
        for i, buffer, good in zip(index, buffers, ok, strict=True):
            header = headers[i]
            assert header is not None
            view = buffer.numpy().data.cast("B")
            sealed = self._sealed
            if good and (
                header.payload_matches(view)
                if sealed is None
                else sealed.passes(header, view)
            ):
                out[i] = view
                self.stats.hits += 1
                self.stats.bytes_read += header.payload_size
                continue
            if good and sealed is None:
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
        if self.degraded is not None or self.writes_refused is not None:
            self.stats.puts_dropped += len(todo)
            return stored
        big = [i for i in todo if len(payloads[i].view) > self.max_payload]
        self.stats.puts_dropped += len(big)
        todo = [i for i in todo if i not in big]
        if not todo:
            return stored
        sealed = self._sealed
        headers = [
            payloads[i].header(
                payload_checksum(payloads[i].view),
                0,
                b"" if sealed is None else sealed.sign(payloads[i]),
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
            self._store([object_key(d, PAYLOAD_GROUP) for d in digests], bodies)
            and self._store([object_key(d, HEADER_GROUP) for d in digests], blocks)
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

    def _load(self, keys: list[ObjectKey], buffers: list[torch.Tensor]) -> list[bool]:
        """Load ``keys`` into ``buffers`` (exact sizes); per key whether it
        landed. Misses at once while the store is down, and when it fails."""
        client = self._client
        if client is None or self.degraded is not None:
            return [False] * len(keys)
        try:
            landed = client.load(keys, buffers)
        except StoreUnavailable as exc:
            self.health.degrade(str(exc))
            return [False] * len(keys)
        except Exception:
            logger.exception("lmcache_tiered: store load failed")
            self.health.note_failure("a load failed")
            return [False] * len(keys)
        self.health.note_success()
        return landed

    def _store(self, keys: list[ObjectKey], buffers: list[torch.Tensor]) -> bool:
        """Store ``keys`` from ``buffers``; False if not (untried: down, refusing)."""
        client = self._client
        if client is None or self.degraded is not None or self.writes_refused:
            return False
        try:
            stored = client.store(keys, buffers)
        except StoreUnavailable as exc:
            self.health.degrade(str(exc))
            return False
        except Exception:
            logger.exception("lmcache_tiered: store write failed")
            self.health.note_failure("a write failed")
            return False
        self.health.note_success()
        if not stored:
            self._check_anew()
        return stored

    # ---------------------------------------------------------------- health

    def _adopt(self, fresh: StoreClient) -> None:
        """Serve through ``fresh`` (its checks' short timeout lifted)."""
        fresh.timeout_s = None
        with self._lock:
            old, self._client = self._client, fresh
        if old is not None:
            close_later(old.adapter)

    def _went_down(self, why: str) -> str:
        """The store is down (under the lock, as the health machine degrades
        the tier): drop the adapter and the index, serve misses at once until
        a check on a new adapter passes; what ``degraded`` says."""
        self._down_since = time.time()
        self._refused = None  # the check that brings it back says
        client, self._client = self._client, None
        self._index.clear()
        if client is not None:
            close_later(client.adapter)
        return f"down since {_clock(self._down_since)}: {why}"

    def _recover(self) -> str | None:
        """One check through a new adapter; if it passes, serve through it
        again: how it came back (None while it does not)."""
        check, fresh = self._check_fresh()
        if fresh is None:
            return None
        if check.down is not None:
            close_later(fresh.adapter)
            return None
        since = self._down_since
        self._adopt(fresh)
        return f"back after {time.time() - since:.0f} s (down since {_clock(since)})"

    def _refuse(self, why: str) -> None:
        """Writes are refused while reads are served (full, read-only). The
        client that wrote is swapped for a fresh one: LMCache 0.5.6's RESP
        client fails every read after a refused write ("GET: size header
        mismatch"), so reads go through one that never writes."""
        with self._lock:
            if self.writes_refused is not None or self.degraded is not None:
                return
            self._refused_since = time.time()
            self._refused = f"since {_clock(self._refused_since)}: {why}"
            client, self._client = self._client, None
        logger.warning(
            "lmcache_tiered: cold store (%s) refuses writes %s; its chunks are "
            "still served, writes to it are dropped until a check's write "
            "passes (one every %g s)",
            self.engine_name,
            self.writes_refused,
            PROBE_S,
        )
        if client is not None:
            close_later(client.adapter)
        try:
            self._client = StoreClient(build_adapter(self.spec))
        except Exception as exc:
            self.health.degrade(f"no new client for reads: {exc}")

    def _takes_writes(self) -> None:
        with self._lock:
            if self._refused is None:
                return
            self._refused = None
        logger.warning(
            "lmcache_tiered: cold store (%s) takes writes again after %.0f s",
            self.engine_name,
            time.time() - self._refused_since,
        )

    @property
    def probe_keys(self) -> tuple[ObjectKey, ...]:
        """The store objects the prober writes, in the order it tries them."""
        return tuple(self._probe_keys)

    def _check(self, client: StoreClient, tries: int = PROBE_OBJECTS) -> StoreCheck:
        """Our probe objects in turn, at most ``tries``, until one passes or
        refuses a write (that one is tried first next time); else down."""
        check = StoreCheck(down="no probe object tried")
        for _ in range(min(tries, len(self._probe_keys))):
            check = self._check_one(client, self._probe_keys[0])
            if check.down is None:
                return check
            self._probe_keys.append(self._probe_keys.pop(0))
        return check

    def _check_one(self, client: StoreClient, key: ObjectKey) -> StoreCheck:
        """Write ``key``, then read it back. A write the store answered with a
        refusal is a store that is up but takes no writes; nothing is read
        through a client after a refused write (see :meth:`_refuse`)."""
        data = torch.full((HEADER_SIZE,), 0x5A, dtype=torch.uint8)
        back = torch.zeros(HEADER_SIZE, dtype=torch.uint8)
        try:
            if not client.store([key], [data]):
                # it answered: up, but full or read-only
                return StoreCheck(refused="a check's write was refused")
            landed = client.load([key], [back])[0]
        except StoreUnavailable as exc:
            return StoreCheck(down=str(exc))
        except Exception as exc:
            return StoreCheck(down=f"a check failed: {exc}")
        if not landed:
            return StoreCheck(
                down="the store took a check's write, then did not find it"
            )
        if not torch.equal(back, data):
            return StoreCheck(
                down="the store gave a check's object back with other bytes"
            )
        return StoreCheck()

    def _watch(self) -> None:
        """The prober's check while the store serves: through the client
        that serves, or, while it refuses writes, a new one."""
        client = self._client
        if self._refused is None and client is not None:
            check = self._check(client)
            if client is not self._client:
                return  # swapped meanwhile (a refused write): stale
            self._judge(check)
        else:
            self._check_anew()

    def _judge(self, check: StoreCheck) -> None:
        """Down, refusing writes, or taking them, as ``check`` found."""
        if check.down is not None:
            self.health.degrade(check.down)
        elif check.refused is not None:
            self._refuse(check.refused)
        else:
            self._takes_writes()

    def _check_anew(self) -> None:
        """A check through a new client, which serves from now on if it passes
        (ours may be what failed: LMCache's RESP adapter reports a write to a
        server that died or restarted as not stored, never as an error)."""
        check, fresh = self._check_fresh()
        if fresh is not None and check == StoreCheck():
            self._adopt(fresh)
            self._takes_writes()
            return
        if fresh is not None:
            close_later(fresh.adapter)
        self._judge(check)

    def _check_fresh(self) -> tuple[StoreCheck, StoreClient | None]:
        """One probe object checked through a new client, and that client
        (None if not built): neither a down store's client nor the one that
        serves reads (see :meth:`_refuse`) is used. Each operation waits half
        a period at most: the store's return is seen within two."""
        try:
            client = StoreClient(build_adapter(self.spec), PROBE_S / 2)
        except Exception as exc:
            return StoreCheck(down=f"no new client: {exc}"), None
        return self._check(client, tries=1), client

    def close(self) -> None:
        self.health.close()
        client, self._client = self._client, None
        if client is not None:
            # our probe object goes with us, unless the store is unreachable
            probe = list(self.probe_keys) if self.degraded is None else []
            close_later(client.adapter, delete_first=probe).join(store_client.TIMEOUT_S)


def _clock(wall: float) -> str:
    """A wall-clock time for status and log lines (UTC, to the second)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))
