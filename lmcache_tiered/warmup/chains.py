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
#: the parent of a prompt's first chunk (no digest is empty)
_ROOT = b""


class ChainIndex:
    """parent -> recent children, and child -> its parent, each bounded to
    ``max_parents`` (LRU)."""

    def __init__(self, max_parents: int = 1 << 20) -> None:
        self.max_parents = max_parents
        self._children: OrderedDict[bytes, OrderedDict[bytes, StoreKey]] = OrderedDict()
        #: a key's hash covers its whole prefix: it has one parent
        self._parents: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def learn(self, keys: Sequence[StoreKey], rooted: bool = False) -> None:
        """Record that each key of ``keys`` follows the one before it; with
        ``rooted`` (a lookup's keys: a whole prompt's), that the first key
        has none before it."""
        digests = [key_digest(k) for k in keys]
        with self._lock:
            if rooted and digests:
                self._parents.pop(digests[0], None)
                self._parents[digests[0]] = _ROOT
            for parent, child, key in zip(digests, digests[1:], keys[1:], strict=False):
                children = self._children.pop(parent, None) or OrderedDict()
                children.pop(child, None)
                children[child] = key
                while len(children) > _CHILDREN:
                    children.popitem(last=False)
                self._children[parent] = children
                self._parents.pop(child, None)
                self._parents[child] = parent
            while len(self._children) > self.max_parents:
                self._children.popitem(last=False)
            while len(self._parents) > self.max_parents:
                self._parents.popitem(last=False)

    def runs(self, keys: Sequence[StoreKey]) -> list[range]:
        """Index ranges of ``keys``, each one chain as far as is known: cut
        before a key whose learned parent is another key than the one before
        it. LMCache's multi-process server stores the new chunks of several
        requests in one batch; their lookups taught each chunk's parent."""
        digests = [key_digest(k) for k in keys]
        cuts = [0]
        with self._lock:
            for i in range(1, len(keys)):
                parent = self._parents.get(digests[i])
                if parent is not None and parent != digests[i - 1]:
                    cuts.append(i)
        cuts.append(len(keys))
        return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]

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
