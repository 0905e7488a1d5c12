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

It speaks JSON lines on stdout
(:data:`~lmcache_tiered.soak.driver.EVENTS`); the soak command
(:mod:`lmcache_tiered.soak.command`) reads them, kills it, restarts it.

May touch: its engine, the tier files under the directories it is given
(the damage it is asked for); nothing else.
"""

from __future__ import annotations

import random
import time
from typing import Any

from lmcache_tiered import testing
from lmcache_tiered.integration.backend import TieredBackend
from lmcache_tiered.soak.driver import ACK_TIMEOUT_S, Driver
from lmcache_tiered.soak.workload import CHUNK_TOKENS
from lmcache_tiered.storage.tier import Tier


class Worker(Driver):
    """One engine and the checks of what it serves."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
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

    def close(self) -> None:
        testing.destroy_engine(self.engine)

    def state(self) -> dict[str, Any]:
        metrics = self.cache.snapshot()
        return {
            "puts_dropped": metrics["puts_dropped"],
            "degraded": {n: t["degraded"] for n, t in metrics["tiers"].items()},
            "refused": {n: t["writes_refused"] for n, t in metrics["tiers"].items()},
            "corrupt": sum(t["corrupt"] for t in metrics["tiers"].values()),
        }

    def where(self, conversation: int, depth: int, chunk: int) -> str:
        keys = testing.chunk_keys(self.engine, self.tokens(conversation, depth))
        return self.cache.tier_of(keys[chunk]) or "no tier"

    # ---------------------------------------------------------------- reads

    def read(self, conversation: int, depth: int) -> tuple[int, int]:
        """Retrieve a prefix: (chunks served, chunks wrong)."""
        tokens = self.tokens(conversation, depth)
        started = time.monotonic()
        kv, hit = testing.retrieve_tokens(self.engine, tokens, connector=self.connector)
        took = time.monotonic() - started
        served, wrong = self.served_chunks(kv, hit, conversation, depth)
        self.record_read(took, wrong)
        return served, wrong

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
            self.flip(name, acked[name], slab, offset)
            hot = testing.get_local_cpu_backend(self.engine)
            if hot is not None:
                hot.batched_remove([victim])
            return
        self.emit("error", what="damage", why="no acknowledged chunk in warm yet")


def main() -> None:
    Worker.main(__doc__)


if __name__ == "__main__":
    main()
