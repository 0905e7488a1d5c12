"""The soak's workload: a bounded set of conversations and the seeds of
their blocks' tokens and KV (the soak command and each of its workers agree
on every byte without passing any; this module loads neither torch nor
LMCache, so the command starts fast).

May touch: nothing.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

#: Tokens per conversation block (Mooncake's hash-id block), and per chunk.
BLOCK_TOKENS, CHUNK_TOKENS = 512, 256


@dataclass(frozen=True, slots=True)
class Conversations:
    """``count`` conversations of up to ``blocks`` blocks each, all opening
    with one shared block (a system prompt); request ``i`` reads a prefix of
    one of them, picked from ``seed``. Bounded on purpose: the warm tier holds
    them all, so a missing acknowledged chunk is a lost one, not an eviction."""

    count: int
    blocks: int
    seed: int

    def request(self, i: int) -> tuple[int, int]:
        """(conversation, depth in blocks) of request ``i``."""
        pick = random.Random(self.seed * 1_000_003 + i)
        conversation = min(int(pick.paretovariate(1.2)) - 1, self.count - 1)
        return conversation, pick.randint(1, self.blocks)

    def block_seed(self, conversation: int, block: int) -> int:
        """The seed of a block's tokens and KV: one per (conversation, block),
        so two prefixes never share a chunk's bytes (block 0 excepted)."""
        name = "system" if block == 0 else f"{self.seed}/{conversation}/{block}"
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest())

    @property
    def chunk_count(self) -> int:
        """Distinct chunks of the whole set (an upper bound)."""
        return (1 + (self.blocks - 1) * self.count) * BLOCK_TOKENS // CHUNK_TOKENS
