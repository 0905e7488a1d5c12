"""Prefix chains learned from what LMCache looks up and stores.

LMCache's keys are chained (a chunk's hash covers its whole prefix), so a key
that followed another once will follow it again. Knowing the children of a
key lets a policy promote the continuation of a prefix before it is asked for.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from lmcache_tiered.keys import StoreKey, key_digest

#: children remembered per parent (a shared system prompt has several)
_CHILDREN = 4


class ChainIndex:
    """parent -> recent children, bounded to ``max_parents`` (LRU)."""

    def __init__(self, max_parents: int = 1 << 20) -> None:
        self.max_parents = max_parents
        self._children: OrderedDict[bytes, OrderedDict[bytes, StoreKey]] = OrderedDict()
        self._lock = threading.Lock()

    def learn(self, keys: Sequence[StoreKey]) -> None:
        """Record that each key of ``keys`` follows the one before it."""
        if len(keys) < 2:
            return
        digests = [key_digest(k) for k in keys]
        with self._lock:
            for parent, child, key in zip(digests, digests[1:], keys[1:], strict=False):
                children = self._children.pop(parent, None) or OrderedDict()
                children.pop(child, None)
                children[child] = key
                while len(children) > _CHILDREN:
                    children.popitem(last=False)
                self._children[parent] = children
            while len(self._children) > self.max_parents:
                self._children.popitem(last=False)

    def continuation(self, key: StoreKey, limit: int) -> list[StoreKey]:
        """Follow the most recent child from ``key``, up to ``limit`` keys."""
        chain: list[StoreKey] = []
        digest = key_digest(key)
        with self._lock:
            while len(chain) < limit:
                children = self._children.get(digest)
                if not children:
                    break
                digest, child = next(reversed(children.items()))
                if child in chain:
                    break
                chain.append(child)
        return chain
