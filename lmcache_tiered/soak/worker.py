"""The soak's worker process: the plugin in a real LMCache engine, driven as
vLLM drives it, every byte it serves checked.

It replays a bounded set of conversations (:class:`Conversations`): each
request retrieves the longest stored prefix, compares every token's KV with
what was stored for it, stores the whole request and waits until the plugin
has written it (then it is *acknowledged*). At start it checks every
conversation the soak saw acknowledged before (a killed worker's too): each
must be served whole and exact, up to a record the soak damaged since. On
SIGUSR1 it damages one acknowledged chunk on disk (a flipped payload byte),
which must then be a miss, never wrong bytes.

It speaks JSON lines on stdout (:data:`EVENTS`); the soak command
(:mod:`lmcache_tiered.soak.command`) reads them, kills it, restarts it.

May touch: its engine, the tier files under the directories it is given
(the damage it is asked for); nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from typing import Any

import torch

from lmcache_tiered import testing
from lmcache_tiered.integration.backend import TieredBackend
from lmcache_tiered.soak.workload import BLOCK_TOKENS, CHUNK_TOKENS, Conversations
from lmcache_tiered.storage.tier import Tier

#: What the worker prints, one JSON object per line, by ``type``.
EVENTS = ("ready", "ack", "tick", "damaged", "error")
#: Seconds between ``tick`` lines.
TICK_S = 1.0
#: Seconds a request's puts may take to be written.
ACK_TIMEOUT_S = 30.0


class Worker:
    """One engine and the checks of what it serves."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.conversations = Conversations(**spec["conversations"])
        config = testing.build_config(
            chunk_size=CHUNK_TOKENS,
            max_local_cpu_size_gb=spec["hot_gb"],
            storage_plugins=["tiered"],
            extra_config=spec["extra_config"],
        )
        self.engine, self.connector = testing.build_engine(
            config, model_name="soak", log_level="WARNING"
        )
        backend = testing.get_backends(self.engine)["tiered"]
        assert isinstance(backend, TieredBackend) and backend.cache is not None
        self.cache = backend.cache
        self._damage_asked = threading.Event()
        self._lock = threading.Lock()
        #: since the last tick: requests, wrong chunks, slowest read (s)
        self._ops = self._wrong = 0
        self._slowest = 0.0
        self._last_tick = time.monotonic()

    # --------------------------------------------------------------- bytes

    def tokens(self, conversation: int, depth: int) -> torch.Tensor:
        seeds = [self.conversations.block_seed(conversation, b) for b in range(depth)]
        return torch.cat([testing.make_tokens(BLOCK_TOKENS, seed=s) for s in seeds])

    def kv(self, conversation: int, depth: int) -> torch.Tensor:
        """The KV stored for a prefix (the connector's layout, tokens on dim 2)."""
        seeds = [self.conversations.block_seed(conversation, b) for b in range(depth)]
        blocks = [testing.make_kv(self.connector, BLOCK_TOKENS, seed=s) for s in seeds]
        return torch.cat(blocks, dim=2)

    # --------------------------------------------------------------- events

    def emit(self, kind: str, **fields: Any) -> None:
        print(json.dumps({"type": kind, "t": time.time(), **fields}), flush=True)

    def tick(self) -> None:
        with self._lock:
            ops, wrong, slowest = self._ops, self._wrong, self._slowest
            self._ops = self._wrong = 0
            self._slowest = 0.0
        metrics = self.cache.snapshot()
        self.emit(
            "tick",
            ops=ops,
            wrong_chunks=wrong,
            slowest_read_s=slowest,
            puts_dropped=metrics["puts_dropped"],
            degraded={n: t["degraded"] for n, t in metrics["tiers"].items()},
            refused={n: t["writes_refused"] for n, t in metrics["tiers"].items()},
            corrupt=sum(t["corrupt"] for t in metrics["tiers"].values()),
        )

    # ---------------------------------------------------------------- reads

    def read(self, conversation: int, depth: int) -> tuple[int, int]:
        """Retrieve a prefix: (chunks served, chunks wrong). A chunk is wrong
        if any byte of it differs from what was stored for its tokens."""
        tokens = self.tokens(conversation, depth)
        started = time.monotonic()
        kv, hit = testing.retrieve_tokens(self.engine, tokens, connector=self.connector)
        took = time.monotonic() - started
        expected = self.kv(conversation, depth)
        served = wrong = 0
        for start in range(0, len(tokens), CHUNK_TOKENS):
            span = slice(start, start + CHUNK_TOKENS)
            if not bool(hit[span].any()):
                continue
            served += 1
            if not torch.equal(kv[:, :, span], expected[:, :, span]):
                wrong += 1
        with self._lock:
            self._wrong += wrong
            self._slowest = max(self._slowest, took)
        return served, wrong

    def verify(self, acked: dict[str, int], damaged: dict[str, int]) -> None:
        """Every acknowledged conversation, served whole and exact; one
        ``ready`` line with the counts. A conversation whose chunk the soak
        damaged (``damaged``: its depth) and that was not acknowledged that
        deep since must be served up to that chunk (LMCache serves a prefix)."""
        lost = wrong = checked = 0
        lost_conversations = []
        for name, depth in sorted(acked.items()):
            served, bad = self.read(int(name), depth)
            checked += served
            wrong += bad
            chunks = depth * BLOCK_TOKENS // CHUNK_TOKENS
            if name in damaged:
                chunks = damaged[name] * BLOCK_TOKENS // CHUNK_TOKENS - 1
            if served < chunks:
                lost += chunks - served
                keys = testing.chunk_keys(self.engine, self.tokens(int(name), depth))
                where = self.cache.tier_of(keys[served])
                lost_conversations.append(
                    f"{name}: chunks {served}-{chunks - 1} of {len(keys)}, the "
                    f"first in {where or 'no tier'}"
                )
        self.emit(
            "ready",
            pid=os.getpid(),
            checked_chunks=checked,
            lost_chunks=lost,
            lost_conversations=lost_conversations,
            wrong_chunks=wrong,
        )

    # --------------------------------------------------------------- writes

    def write(self, conversation: int, depth: int) -> bool:
        """Store a prefix and wait until every chunk of it is in the warm
        tier's files, the tier a killed process finds again: then it is
        acknowledged (an ``ack`` line), or an ``error`` line says why not.
        (The cold store is not it: the soak restarts it empty.)"""
        tokens = self.tokens(conversation, depth)
        testing.store_tokens(self.engine, tokens, self.kv(conversation, depth))
        if not self.cache.flush(ACK_TIMEOUT_S):
            self.emit("error", what="put not acknowledged", why="still queued")
            return False
        warm = self.cache.tiers["warm"]
        keys = testing.chunk_keys(self.engine, tokens)
        if missing := sum(warm.header(k) is None for k in keys):
            self.emit(
                "error", what="put not acknowledged", why=f"{missing} not in warm"
            )
            return False
        self.emit("ack", conversation=str(conversation), depth=depth)
        return True

    # --------------------------------------------------------------- damage

    def damage(self, acked: dict[str, int]) -> None:
        """Flip one payload byte of an acknowledged chunk in the warm tier,
        and drop it from the CPU tier, so its next read is from the damaged
        record."""
        warm = self.cache.tiers["warm"]
        assert isinstance(warm, Tier)
        for name in random.sample(sorted(acked), len(acked)):
            tokens = self.tokens(int(name), acked[name])
            keys = testing.chunk_keys(self.engine, tokens)
            victim = keys[-1]
            entry = warm.index.get(victim)
            if entry is None:
                continue
            extent = warm.geometry.extents(entry.slot, entry.header.payload_size)[0]
            slab = warm.files.names[extent.device]
            offset = extent.offset + extent.length // 2
            # said before it is done: a worker killed in between must not
            # leave a damage the soak would count as a lost chunk
            self.emit(
                "damaged",
                conversation=name,
                depth=acked[name],
                slab=slab,
                offset=offset,
            )
            fd = os.open(slab, os.O_RDWR)
            try:
                byte = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([byte[0] ^ 0x5A]), offset)
            finally:
                os.close(fd)
            hot = testing.get_local_cpu_backend(self.engine)
            if hot is not None:
                hot.batched_remove([victim])
            return
        self.emit("error", what="damage", why="no acknowledged chunk in warm yet")

    # ----------------------------------------------------------------- loop

    def run(self, acked: dict[str, int], damaged: dict[str, int]) -> None:
        stop = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *_: self._damage_asked.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        self.verify(acked, damaged)
        parent = os.getppid()
        i = self.spec["first_request"]
        while not stop.is_set() and os.getppid() == parent:  # the soak gone: so are we
            conversation, depth = self.conversations.request(i)
            i += 1
            self.read(conversation, depth)
            if self.write(conversation, depth):
                name = str(conversation)
                acked[name] = max(acked.get(name, 0), depth)
            with self._lock:
                self._ops += 1
            if self._damage_asked.is_set():
                self._damage_asked.clear()
                self.damage(acked)
            if time.monotonic() - self._last_tick >= TICK_S:
                self._last_tick = time.monotonic()
                self.tick()
        self.tick()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec", help="the soak's JSON spec of this worker")
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    worker = Worker(spec)
    try:
        worker.run(dict(spec["acked"]), dict(spec["damaged"]))
    finally:
        testing.destroy_engine(worker.engine)


if __name__ == "__main__":
    main()
