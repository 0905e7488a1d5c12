"""What LMCache is told the L2 adapter holds: listeners, usage, key listing.

LMCache's multi-process server learns which chunks an L2 adapter holds only
from the adapter: the ``on_l2_keys_stored/deleted`` calls its listeners
hear, the usage counters of ``L2AdapterInterface`` (its eviction reads
them) and ``list_l2_keys`` (the server's key-listing API). The tiers change
on their own (warm evicts, demotes to cold, drops a bad record), so
:class:`L2Ledger` keeps one record of the chunks LMCache last heard of as
stored and reconciles it with the cache after every change the cache
reports: a chunk is in L2 while some tier of ours holds it, so a demotion
to cold is no deletion, and a chunk that leaves its last tier (eviction,
bad record, ``delete``) is one. Each chunk is charged one warm slot on disk.

May touch: the listener and usage API of ``L2AdapterInterface`` (its base
class) and the cache's ``holds``/``header`` (no I/O); nothing of the
adapter's tasks or threads.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence

from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

from lmcache_tiered._lmcache import seed_l2_usage
from lmcache_tiered.cache.tiered_cache import TieredCache
from lmcache_tiered.keys import StoreKey, key_digest


class L2Ledger(L2AdapterInterface):
    """The part of an L2 adapter that keeps LMCache's view of what it holds
    in step with a :class:`TieredCache` (``self.cache``, None until open)."""

    cache: TieredCache | None

    def __init__(self, max_capacity_bytes: int) -> None:
        super().__init__(max_capacity_bytes=max_capacity_bytes)
        #: the chunks LMCache's listeners last heard of as stored, by digest
        self._in_l2: dict[bytes, ObjectKey] = {}
        self._in_l2_lock = threading.Lock()
        #: bytes each chunk counts for in LMCache's usage: one warm slot on disk
        self._charge = 0

    def _follow(self, cache: TieredCache) -> None:
        """Count what ``cache`` recovered from disk as in L2, and hear of
        every later change from it."""
        self._charge = charge = cache.warm.geometry.slot_disk_bytes
        recovered = [k for k in cache.stored_keys() if isinstance(k, ObjectKey)]
        with self._in_l2_lock:
            for key in recovered:
                self._in_l2[key_digest(key)] = key
            seed_l2_usage(self, [key.cache_salt for key in recovered], charge)
        cache.on_change = lambda keys: self._reconcile(cache, keys)

    def _reconcile(self, cache: TieredCache, keys: Sequence[StoreKey]) -> None:
        """Tell LMCache's listeners and usage counters which of ``keys``
        entered or left L2. A chunk is in L2 while some tier of ours holds it:
        a warm victim demoted to cold is not deleted, nor is a cold victim
        warm still holds; one that leaves its last tier (eviction, bad
        record, ``delete``) is. The cache calls this after every such change;
        one lock makes listeners hear stored and deleted in turn for each
        chunk, whichever threads changed it."""
        stored: list[ObjectKey] = []
        deleted: list[ObjectKey] = []
        with self._in_l2_lock:
            for key in keys:
                if not isinstance(key, ObjectKey):
                    continue
                digest = key_digest(key)
                if cache.holds(key):
                    if digest not in self._in_l2:
                        self._in_l2[digest] = key
                        stored.append(key)
                elif self._in_l2.pop(digest, None) is not None:
                    deleted.append(key)
            if stored:
                self._notify_keys_stored(stored, [self._charge] * len(stored))
            if deleted:
                self._notify_keys_deleted(deleted, [self._charge] * len(deleted))

    def register_listener(self, listener: L2AdapterListener) -> None:
        """Register ``listener`` and tell it of the chunks already stored
        (recovered after a restart), as LMCache's raw-block adapter does."""
        with self._in_l2_lock:
            super().register_listener(listener)
            keys = list(self._in_l2.values())
            if keys:
                listener.on_l2_keys_stored(keys, [self._charge] * len(keys))

    def list_l2_keys(
        self,
        model_name: str | None = None,
        page_size: int = 500,
        cursor: str | None = None,
    ) -> KeyListPage:
        """A page of the keys in L2 (the server's key-listing API), in digest
        order; the cursor is the last digest of the previous page, so keys
        stored or evicted between pages never shift the rest."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        try:
            after = b"" if cursor is None else bytes.fromhex(cursor)
        except ValueError:
            raise ValueError(f"malformed cursor {cursor!r}") from None
        with self._in_l2_lock:
            # one page and one more (is there a next page?), not a full sort
            resident = heapq.nsmallest(
                page_size + 1,
                (
                    (digest, key)
                    for digest, key in self._in_l2.items()
                    if digest > after
                    and (model_name is None or key.model_name == model_name)
                ),
                key=lambda item: item[0],
            )
        page = resident[:page_size]
        cache = self.cache
        entries = []
        for _, key in page:
            header = None if cache is None else cache.header(key)
            if header is not None:  # else evicted since the snapshot
                entries.append(
                    KeyEntry(
                        key=key.to_encoded_object_key(),
                        size_bytes=header.payload_size,
                    )
                )
        more = len(resident) > page_size
        return KeyListPage(tuple(entries), page[-1][0].hex() if more else None)
