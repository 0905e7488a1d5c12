"""The multi-process soak's client: ``lmcache server`` with
``TieredL2Adapter`` driven as vLLM's ``LMCacheMPConnector`` drives it, every
byte it serves checked.

It speaks to the server through LMCache's own client classes, the ones the
connector builds (``LMCacheMPSchedulerAdapter`` for lookups,
``LMCacheMPWorkerAdapter`` for stores and retrieves over a paged KV cache of
CPU tensors, vLLM's layout): per request a lookup (the server prefetches its
L2 into L1), a retrieve of the hits, a store of the whole request and the
session's end, as vLLM's scheduler and worker send them. A store is
*acknowledged* once every chunk of it has a record in the warm tier's files
(read as ``lmcache-tiered inspect`` reads them, beside the live server): what
a killed server finds again. On SIGUSR1 it flips a payload byte of such a
record and drops the chunk from the server's L1 (``DELETE /cache/objects``),
so that its next read is from the damaged record. The request loop, the
start-up check and the JSON lines are :class:`~lmcache_tiered.soak.driver.Driver`'s.

May touch: the warm tier files under the directories it is given (reads;
the damage it is asked for), the server's L1 (the damaged chunk); nothing else.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from typing import Any

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)
from lmcache.v1.distributed.api import ObjectKey, ipc_key_to_object_keys
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.token_hasher import TokenHasher

from lmcache_tiered.integration.mp import OWNER
from lmcache_tiered.keys import key_digest
from lmcache_tiered.ops.records import TierFiles, ToolError, newest
from lmcache_tiered.soak.driver import ACK_TIMEOUT_S, Driver
from lmcache_tiered.soak.workload import BLOCK_TOKENS, CHUNK_TOKENS
from lmcache_tiered.testing import CPUConnector
from lmcache_tiered.testing.lmcache import mp_wire_tokens

#: The model name of the soak's keys, and vLLM's paged KV block (tokens).
MODEL, PAGE_TOKENS = "soak", 16
#: Seconds a request to the server may take (LMCache's default is 300).
MQ_TIMEOUT_S = 60.0
#: Seconds between looks at the warm tier's files while a store is written.
ACK_POLL_S = 0.05


class WarmRecords:
    """The warm tier's records on disk, by key digest: read-only, no lock,
    safe beside the live server (as ``lmcache-tiered inspect``)."""

    def __init__(self, paths: list[str], owner: str) -> None:
        self.paths, self.owner = paths, owner

    def find(self, digests: set[bytes]) -> dict[bytes, tuple[str, int]]:
        """Of ``digests``, those with a record: the slab and offset of a byte
        in the middle of its payload's first extent (the one to damage)."""
        try:
            files = TierFiles(self.paths, self.owner)
        except (ToolError, OSError):
            return {}  # the tier has not opened yet (it opens at the first store)
        with files:
            if files.geometry is None:
                return {}
            records, _ = newest(list(files.scan()))
            found = {}
            for digest in digests & records.keys():
                slot = records[digest]
                assert slot.header is not None
                extent = files.geometry.extents(slot.index, slot.header.payload_size)[0]
                found[digest] = (
                    files.slab_names[extent.device],
                    extent.offset + extent.length // 2,
                )
            return found


class MpClient(Driver):
    """LMCache's connector-side adapters on one server, and the checks."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        self.connector = CPUConnector(2, 2, 64, torch.bfloat16)
        server = spec["server"]
        self.http = f"http://127.0.0.1:{server['http_port']}"
        # straight to the loopback server, whatever proxy the environment names
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        url = f"tcp://127.0.0.1:{server['port']}"
        strategy = ParallelStrategy(
            mla_only=False,
            vllm_world_size=1,
            vllm_worker_id=0,
            tp_size=1,
            pp_size=1,
            n_servers=1,
        )
        self.zmq = zmq.Context()
        self.scheduler = LMCacheMPSchedulerAdapter(
            [url], self.zmq, MODEL, PAGE_TOKENS, strategy, mq_timeout=MQ_TIMEOUT_S
        )
        self.worker = LMCacheMPWorkerAdapter(
            url, self.zmq, MODEL, PAGE_TOKENS, strategy, mq_timeout=MQ_TIMEOUT_S
        )
        pages = self.conversations.blocks * BLOCK_TOKENS // PAGE_TOKENS
        c = self.connector
        # vLLM's paged KV cache per layer: [2, pages, page tokens, heads, head]
        self.kv_caches = {
            f"model.layers.{layer}.self_attn": torch.zeros(
                2, pages, PAGE_TOKENS, c.num_kv_heads, c.head_size, dtype=c.dtype
            )
            for layer in range(c.num_layers)
        }
        self.worker.register_kv_caches(
            self.kv_caches, layout_hints={"kv_layout": "NHD"}
        )
        self.hasher = TokenHasher(CHUNK_TOKENS, "blake3")
        # the warm tier's files are the adapter's (one owner per server)
        self.records = WarmRecords(spec["warm"]["paths"], OWNER)
        self._corrupt = 0

    # ----------------------------------------------------------------- keys

    def request_id(self) -> str:
        return f"soak-{uuid.uuid4().hex[:12]}"

    def keys(self, tokens: list[int]) -> list[ObjectKey]:
        """The server's keys of the request's chunks (as it resolves them)."""
        key = IPCCacheServerKey.from_token_ids(
            MODEL, 1, 0, tokens, 0, len(tokens), request_id="keys"
        )
        hashes = self.hasher.compute_chunk_hashes(tokens)
        return ipc_key_to_object_keys(key, hashes, [0])[0]

    def where(self, conversation: int, depth: int, chunk: int) -> str:
        key = self.keys(self.tokens(conversation, depth).tolist())[chunk]
        digest = key_digest(key)
        return "warm" if self.records.find({digest}) else "no warm record"

    # -------------------------------------------------------------- the KV

    def _pages(self, tokens: int) -> list[list[int]]:
        return [list(range(tokens // PAGE_TOKENS))]

    def _fill(self, kv: torch.Tensor) -> None:
        """Put ``kv`` (``[layers, 2, tokens, heads, head]``) in the first pages."""
        pages = kv.shape[2] // PAGE_TOKENS
        for layer, cache in enumerate(self.kv_caches.values()):
            cache[:, :pages].copy_(
                kv[layer].reshape(2, pages, PAGE_TOKENS, *kv.shape[3:])
            )

    def _gathered(self, tokens: int) -> torch.Tensor:
        """The first pages as ``[layers, 2, tokens, heads, head]``."""
        pages = tokens // PAGE_TOKENS
        return torch.stack(
            [
                c[:, :pages].reshape(2, tokens, *c.shape[3:])
                for c in self.kv_caches.values()
            ]
        )

    # ---------------------------------------------------------------- reads

    def _lookup(self, rid: str, wire_tokens: Any) -> int:
        """The tokens the server holds a prefix of (after its L2 prefetch);
        ``wire_tokens`` as :func:`mp_wire_tokens` gives them."""
        self.scheduler.maybe_submit_lookup_request(rid, wire_tokens)
        deadline = time.monotonic() + MQ_TIMEOUT_S
        while (hit := self.scheduler.check_lookup_result(rid)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookup {rid} unanswered for {MQ_TIMEOUT_S:g} s")
            time.sleep(0.002)
        self.scheduler.cleanup_lookup_result(rid)
        return hit

    def read(self, conversation: int, depth: int) -> tuple[int, int]:
        """Look up and retrieve a prefix as vLLM does: (chunks served,
        chunks wrong)."""
        tokens = self.tokens(conversation, depth).tolist()
        rid = self.request_id()
        for cache in self.kv_caches.values():
            cache.zero_()  # a chunk not retrieved must not pass as served
        started = time.monotonic()
        wire_tokens = mp_wire_tokens(tokens)
        hit = self._lookup(rid, wire_tokens)
        if hit:
            op = LoadStoreOp(wire_tokens, self._pages(hit), 0, hit)
            self.worker.submit_retrieve_request(rid, op, None)
            future, _ = self.worker.retrieve_futures.pop(rid)
            if not future.result(timeout=MQ_TIMEOUT_S):
                hit = 0  # vLLM recomputes a failed load: nothing served
        took = time.monotonic() - started
        self.scheduler.end_session(rid)
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[:hit] = True
        kv = self._gathered(len(tokens))
        served, wrong = self.served_chunks(kv, mask, conversation, depth)
        self.record_read(took, wrong)
        return served, wrong

    # --------------------------------------------------------------- writes

    def write(self, conversation: int, depth: int) -> bool:
        """Store a prefix as vLLM's worker does, then wait until every chunk
        has a record in the warm tier's files: then it is acknowledged."""
        tokens = self.tokens(conversation, depth).tolist()
        rid = self.request_id()
        self._fill(self.kv(conversation, depth))
        self.worker.submit_store_request(
            rid,
            LoadStoreOp(
                mp_wire_tokens(tokens), self._pages(len(tokens)), 0, len(tokens)
            ),
            None,
        )
        stored = self.worker.store_futures.pop(rid).result(timeout=MQ_TIMEOUT_S)
        self.scheduler.end_session(rid)
        if not stored:
            self.emit("error", what="put not acknowledged", why="the server refused it")
            return False
        wanted = {key_digest(k) for k in self.keys(tokens)}
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while missing := wanted - self.records.find(wanted).keys():
            if time.monotonic() > deadline:
                self.emit(
                    "error",
                    what="put not acknowledged",
                    why=f"{len(missing)} not in warm after {ACK_TIMEOUT_S:g} s",
                )
                return False
            time.sleep(ACK_POLL_S)
        self.emit("ack", conversation=str(conversation), depth=depth)
        return True

    # --------------------------------------------------------------- damage

    def damage(self, acked: dict[str, int]) -> None:
        """Flip one payload byte of an acknowledged chunk's warm record, and
        drop the chunk from the server's L1."""
        for name in random.sample(sorted(acked), len(acked)):
            victim = self.keys(self.tokens(int(name), acked[name]).tolist())[-1]
            found = self.records.find({key_digest(victim)})
            if not found:
                continue
            ((slab, offset),) = found.values()
            self.flip(name, acked[name], slab, offset)
            self._http(
                "DELETE",
                "/cache/objects",
                {
                    "tier": "l1",
                    "force": True,
                    "keys": [
                        {
                            "chunk_hash_hex": victim.chunk_hash.hex(),
                            "model_name": victim.model_name,
                            "kv_rank": victim.kv_rank,
                            "object_group_id": victim.object_group_id,
                            "cache_salt": victim.cache_salt,
                        }
                    ],
                },
            )
            return
        self.emit("error", what="damage", why="no acknowledged chunk in warm yet")

    # ---------------------------------------------------------------- state

    def _http(self, method: str, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(
            self.http + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with self._opener.open(request, timeout=10) as answer:
            return json.load(answer)

    def state(self) -> dict[str, Any]:
        """The adapter's tiers from the server's ``/status``."""
        try:
            (adapter,) = self._http("GET", "/status")["storage_manager"]["l2_adapters"]
        except OSError as exc:
            self.emit("error", what="status", why=str(exc))
            return {"degraded": {}, "refused": {}, "corrupt": self._corrupt}
        tiers = adapter["tiers"]
        self._corrupt = sum(t["corrupt"] for t in tiers.values())
        return {
            "degraded": {n: t["degraded"] for n, t in tiers.items()},
            "refused": {n: t["writes_refused"] for n, t in tiers.items()},
            "corrupt": self._corrupt,
        }

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
        self.zmq.term()


def main() -> None:
    MpClient.main(__doc__)


if __name__ == "__main__":
    main()
