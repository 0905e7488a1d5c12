"""What every soak worker does, whatever it drives: the conversations'
bytes, the JSON lines the soak command reads, the check at start of what was
acknowledged before, and the request loop.

Two drivers share it: :mod:`lmcache_tiered.soak.worker` (the plugin in an
LMCache engine in this process) and :mod:`lmcache_tiered.soak.mp_client`
(``lmcache server`` with ``TieredL2Adapter``, through LMCache's
multi-process client). Each says how to read, write, damage and report; the
rules of what counts as served, wrong, lost and acknowledged are here, once.

May touch: what its subclass touches; nothing itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import torch

from lmcache_tiered import testing
from lmcache_tiered.soak.workload import BLOCK_TOKENS, CHUNK_TOKENS, Conversations
from lmcache_tiered.testing import CPUConnector

#: What a worker prints, one JSON object per line, by ``type``.
EVENTS = ("ready", "ack", "tick", "damaged", "error")
#: Seconds between ``tick`` lines.
TICK_S = 1.0
#: Seconds a request's puts may take to be written.
ACK_TIMEOUT_S = 30.0


class Driver(ABC):
    """The request loop over ``spec``'s conversations and its accounting;
    a subclass reads, writes and damages through what it drives."""

    #: the KV's shape and dtype (a tiny model: 1 KiB per token)
    connector: CPUConnector

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.conversations = Conversations(**spec["conversations"])
        self._damage_asked = threading.Event()
        self._lock = threading.Lock()
        #: since the last tick: requests, wrong chunks, slowest read (s)
        self._ops = self._wrong = 0
        self._slowest = 0.0
        self._last_tick = time.monotonic()

    @abstractmethod
    def close(self) -> None:
        """Release what the driver holds (an engine, a server's client)."""

    @classmethod
    def main(cls, description: str | None) -> None:
        """A driver process's entry point: the path of its JSON spec on the
        command line; it runs until killed, then closes."""
        parser = argparse.ArgumentParser(description=description)
        parser.add_argument("spec", help="the soak's JSON spec of this process")
        with open(parser.parse_args().spec) as f:
            spec = json.load(f)
        driver = cls(spec)
        try:
            driver.run(dict(spec["acked"]), dict(spec["damaged"]))
        finally:
            driver.close()

    # --------------------------------------------------------------- bytes

    def tokens(self, conversation: int, depth: int) -> torch.Tensor:
        seeds = [self.conversations.block_seed(conversation, b) for b in range(depth)]
        return torch.cat([testing.make_tokens(BLOCK_TOKENS, seed=s) for s in seeds])

    def kv(self, conversation: int, depth: int) -> torch.Tensor:
        """The KV stored for a prefix (``[layers, 2, tokens, heads, head]``)."""
        seeds = [self.conversations.block_seed(conversation, b) for b in range(depth)]
        blocks = [testing.make_kv(self.connector, BLOCK_TOKENS, seed=s) for s in seeds]
        return torch.cat(blocks, dim=2)

    def served_chunks(
        self, kv: torch.Tensor, hit: torch.Tensor, conversation: int, depth: int
    ) -> tuple[int, int]:
        """(chunks served, chunks wrong) of a read whose tokens ``hit`` marks:
        a chunk is wrong if any byte of it differs from what was stored."""
        expected = self.kv(conversation, depth)
        served = wrong = 0
        for start in range(0, depth * BLOCK_TOKENS, CHUNK_TOKENS):
            span = slice(start, start + CHUNK_TOKENS)
            if not bool(hit[span].any()):
                continue
            served += 1
            if not torch.equal(kv[:, :, span], expected[:, :, span]):
                wrong += 1
        return served, wrong

    def record_read(self, took: float, wrong: int) -> None:
        with self._lock:
            self._wrong += wrong
            self._slowest = max(self._slowest, took)

    # --------------------------------------------------------------- events

    def emit(self, kind: str, **fields: Any) -> None:
        print(json.dumps({"type": kind, "t": time.time(), **fields}), flush=True)

    def tick(self) -> None:
        with self._lock:
            ops, wrong, slowest = self._ops, self._wrong, self._slowest
            self._ops = self._wrong = 0
            self._slowest = 0.0
        self.emit(
            "tick", ops=ops, wrong_chunks=wrong, slowest_read_s=slowest, **self.state()
        )

    def flip(self, name: str, depth: int, slab: str, offset: int) -> None:
        """Flip the byte at ``offset`` of file ``slab``, the payload of
        conversation ``name``'s last chunk at ``depth``; said before it is
        done: a worker killed in between must not leave a damage the soak
        would count as a lost chunk."""
        self.emit("damaged", conversation=name, depth=depth, slab=slab, offset=offset)
        fd = os.open(slab, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0x5A]), offset)
        finally:
            os.close(fd)

    # ------------------------------------------------------ what drives it

    @abstractmethod
    def read(self, conversation: int, depth: int) -> tuple[int, int]:
        """Retrieve a prefix: (chunks served, chunks wrong)."""

    @abstractmethod
    def write(self, conversation: int, depth: int) -> bool:
        """Store a prefix; True once every chunk of it is acknowledged (an
        ``ack`` line), else an ``error`` line says why not."""

    @abstractmethod
    def damage(self, acked: dict[str, int]) -> None:
        """Flip one payload byte of an acknowledged chunk on disk, said first
        in a ``damaged`` line, so that its next read is from that record."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """The tiers' state for a tick: ``degraded`` and ``refused`` (by
        tier), ``corrupt`` (records found damaged so far)."""

    @abstractmethod
    def where(self, conversation: int, depth: int, chunk: int) -> str:
        """Which tier holds a chunk of a prefix (for the report of a loss)."""

    # ---------------------------------------------------------------- start

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
                where = self.where(int(name), depth, served)
                lost_conversations.append(
                    f"{name}: chunks {served}-{chunks - 1} of "
                    f"{depth * BLOCK_TOKENS // CHUNK_TOKENS}, the first in {where}"
                )
        self.emit(
            "ready",
            pid=os.getpid(),
            checked_chunks=checked,
            lost_chunks=lost,
            lost_conversations=lost_conversations,
            wrong_chunks=wrong,
        )

    # ----------------------------------------------------------------- loop

    def run(self, acked: dict[str, int], damaged: dict[str, int]) -> None:
        """Check what was acknowledged, then serve requests until SIGTERM
        or until the soak is gone; SIGUSR1 asks for a damage."""
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
