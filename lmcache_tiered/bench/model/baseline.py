"""vLLM's GPU prefix cache, the seed's baseline that has nothing else, and
the all-hot bound that has an unbounded one.

vLLM keeps the KV blocks of finished requests in HBM until it needs the room
(automatic prefix caching, on by default): a new request reuses its longest
cached prefix, whole blocks of 16 tokens, and computes the rest. Every
variant of the bench has this cache in front of LMCache, as vLLM does;
``no_external_cache`` has only it (the seed's baseline: "no external cache
acceleration", every miss recomputed).

The model (:class:`GpuPrefixCache`):

- capacity: the profile's HBM KV budget in tokens
  (:attr:`~lmcache_tiered.bench.model.profiles.ModelProfile.gpu_kv_tokens`); the
  scaled-down bench stores fewer bytes per token but the same tokens, so the
  capacity is in tokens and does not scale;
- granularity: the trace's 512-token blocks (chained ids: an equal id is an
  equal prefix), each holding up to 512 tokens in whole 16-token vLLM blocks;
- a request's blocks are held while it runs, from when vLLM schedules them:
  its cached prefix and what LMCache loads when it is admitted, each prompt
  chunk's blocks when the chunk is computed (vLLM allocates a step's blocks
  as it schedules the step), so a long prefill pushes finished requests'
  blocks out as it goes; the model neither preempts nor refuses a request for
  lack of room. They become evictable when it finishes, tail first, as
  vLLM's free-block queue orders them; eviction is least recently used
  first. (Holding a prompt only from its prefill's end left the model 5 %
  fewer prompt tokens to compute than the real vLLM-CPU had on
  ``agent-cpu``, 2 % after; near saturation vLLM alone's modelled TTFT p50
  moved from 3.21 to 3.71 s with it, against a real 5.55 s.)
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from lmcache_tiered.bench.common import trace

#: The variant with vLLM's GPU prefix cache only: no LMCache at all.
NO_EXTERNAL_CACHE = "no_external_cache"
#: LMCache's stock disk backend (``LocalDiskBackend``) on one drive: what an
#: LMCache user has today.
LOCAL_DISK = "lmcache_local_disk"
#: The bound on every cache: vLLM with unbounded HBM, so every reused token
#: (a prefix some earlier request computed) is served at no cost at all.
ALL_HOT = "all_hot_bound"
#: The GPU prefix cache's capacity in the all-hot bound (tokens).
UNBOUNDED = 1 << 62
#: vLLM's KV block size (tokens): the unit of a prefix-cache hit.
VLLM_BLOCK_TOKENS = 16


def _covered(request: trace.Request, index: int) -> int:
    """Whole vLLM blocks' tokens of the request's ``index``-th trace block."""
    tokens = min(trace.BLOCK_TOKENS, request.input_length - index * trace.BLOCK_TOKENS)
    return tokens // VLLM_BLOCK_TOKENS * VLLM_BLOCK_TOKENS


class GpuPrefixCache:
    """The tokens of each trace block vLLM holds in HBM, LRU over free blocks."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"GPU KV capacity must be >= 0, got {capacity_tokens}")
        self.capacity = capacity_tokens
        #: trace block id -> tokens held (whole vLLM blocks)
        self._held: dict[int, int] = {}
        #: running requests holding each block
        self._refs: Counter[int] = Counter()
        #: blocks no running request holds, least recently used first
        self._free: OrderedDict[int, None] = OrderedDict()
        #: blocks each running request (its owner id) holds: its first ones
        self._holding: dict[int, int] = {}
        self.used = 0
        self.hit_tokens_total = 0
        self.evicted_tokens = 0

    def hit_tokens(self, request: trace.Request) -> int:
        """The request's cached prefix in tokens (whole vLLM blocks, never the
        whole prompt: vLLM always computes the last token)."""
        hit = 0
        for index, block in enumerate(request.hash_ids):
            needed, held = _covered(request, index), self._held.get(block, 0)
            hit += min(needed, held)
            if held < needed or needed < trace.BLOCK_TOKENS:
                break
        hit = min(
            hit, (request.input_length - 1) // VLLM_BLOCK_TOKENS * VLLM_BLOCK_TOKENS
        )
        self.hit_tokens_total += hit
        return hit

    def hold(self, owner: int, request: trace.Request, tokens: int) -> None:
        """``owner`` (a running request) has its prompt in HBM up to
        ``tokens`` (whole vLLM blocks): the blocks that covers are held while
        it runs. Called again as its prefill goes on; ``owner`` holds each
        block once."""
        touched = self._holding.get(owner, 0)
        count = 0
        # the blocks before the last one held are whole already: start there
        for index in range(max(touched - 1, 0), len(request.hash_ids)):
            block = request.hash_ids[index]
            start = index * trace.BLOCK_TOKENS
            computed = max(0, tokens - start) // VLLM_BLOCK_TOKENS * VLLM_BLOCK_TOKENS
            covered = min(_covered(request, index), computed)
            if not covered:
                break
            count = index + 1
            old = self._held.get(block, 0)
            if covered > old:
                self._held[block] = covered
                self.used += covered - old
            if index >= touched:
                self._refs[block] += 1
                self._free.pop(block, None)
        self._holding[owner] = max(touched, count)
        self._evict()

    def preload(self, requests: Iterable[trace.Request]) -> None:
        """Start with ``requests``' whole prompts held and free, in this order
        (``--restart``'s bound: every prompt is cached before the replay)."""
        for request in requests:
            self.hold(-1, request, request.input_length)
            self.release(-1, request)

    def release(self, owner: int, request: trace.Request) -> None:
        """``owner`` finished: the blocks it held become evictable, tail first."""
        blocks = request.hash_ids[: self._holding.pop(owner, 0)]
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] <= 0:
                del self._refs[block]
                self._free[block] = None
        self._evict()

    def _evict(self) -> None:
        while self.used > self.capacity and self._free:
            block, _ = self._free.popitem(last=False)
            tokens = self._held.pop(block)
            self.used -= tokens
            self.evicted_tokens += tokens

    def metrics(self) -> dict[str, int]:
        """What the JSON shows of the cache."""
        return {
            "capacity_tokens": self.capacity,
            "used_tokens": self.used,
            "hit_tokens": self.hit_tokens_total,
            "evicted_tokens": self.evicted_tokens,
        }
