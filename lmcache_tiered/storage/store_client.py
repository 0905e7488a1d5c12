"""Talking to a store through one of LMCache's L2 adapters, never for long.

:class:`StoreClient` drives one adapter as LMCache's own controllers do
(lookup-and-lock, load, unlock; store tasks and their results) and waits for
each operation at most :data:`TIMEOUT_S`: LMCache's native Redis client can
leave an operation pending forever (a stopped server), so a timed-out one
raises :class:`StoreTimeout` and its buffers stay referenced for good (the
adapter may still write into them). A failed operation of an adapter that can
say its store is lost (our Mooncake connector) raises :class:`StoreDown`.
Adapters are closed on a daemon thread (:func:`close_later`), since a client
stuck on a hung store may never return.

This module also owns the names of our objects in a store
(:func:`object_key`, :func:`probe_key`): the cold tier, its prober and
``inspect`` all use them.

May touch: the adapter it is given; nothing of ours on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

from lmcache_tiered._lmcache import build_l2_adapter, flat_memory_obj, native_connector
from lmcache_tiered.config import PREFIX, ConfigError
from lmcache_tiered.keys import DIGEST_SIZE

logger = logging.getLogger("lmcache_tiered")

#: Seconds one store operation may take before the store counts as hung.
TIMEOUT_S = 5.0
#: The model name of our objects in the store (their namespace).
NAMESPACE = "lmcache-tiered"
#: Object groups of a chunk's two objects in the store.
PAYLOAD_GROUP, HEADER_GROUP = 0, 1
#: Seconds between polls of an operation's result.
_POLL_S = 0.0005


class StoreUnavailable(Exception):
    """The store cannot serve now: the cold tier counts it as down."""


class StoreTimeout(StoreUnavailable):
    """The store did not answer within :data:`TIMEOUT_S`."""


class StoreDown(StoreUnavailable):
    """An operation failed and the adapter says its store is lost."""


def down_reason(adapter: L2AdapterInterface) -> str | None:
    """Why ``adapter``'s store is lost, where it can say (a ``native_plugin``
    connector with ``unreachable()``, such as our Mooncake connector: the
    completions LMCache's wrapper hands on are one bool per key); else None."""
    ask = getattr(native_connector(adapter), "unreachable", None)
    return ask() if callable(ask) else None


def object_key(digest: bytes, group: int) -> ObjectKey:
    """The store's name of one object of the chunk with key digest ``digest``."""
    return ObjectKey(
        chunk_hash=digest, model_name=NAMESPACE, kv_rank=0, object_group_id=group
    )


def probe_key(owner: str) -> ObjectKey:
    """The object the prober named ``owner`` writes and reads back (a tier:
    its host and process; ``inspect``: its host, looked up only)."""
    digest = hashlib.blake2b(f"probe@{owner}".encode(), digest_size=DIGEST_SIZE)
    return object_key(digest.digest(), PAYLOAD_GROUP)


def build_adapter(spec: Mapping[str, Any]) -> L2AdapterInterface:
    """The adapter ``spec`` (``tiered.cold.adapter``) describes, built by
    LMCache; ConfigError naming the setting for a spec LMCache refuses."""
    try:
        return build_l2_adapter(json.dumps(spec))
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{PREFIX}cold.adapter: {exc}") from None


def answer(query: Callable[[], Any], timeout: float) -> Any:
    """Poll ``query`` until it answers (not None), for at most ``timeout``
    seconds; None if it never did."""
    deadline = time.monotonic() + timeout
    while (result := query()) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)
    return result


class StoreClient:
    """One adapter, each operation waited for at most ``timeout_s`` (None:
    :data:`TIMEOUT_S`). Operations raise what the adapter raised, or
    :class:`StoreTimeout`."""

    def __init__(
        self, adapter: L2AdapterInterface, timeout_s: float | None = None
    ) -> None:
        self.adapter = adapter
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        #: finished stores popped by another caller, by task id
        self._stores_done: dict[int, Any] = {}
        #: buffers of operations that never finished, kept for the adapter
        self._abandoned: list[Any] = []

    def load(self, keys: list[ObjectKey], buffers: list[torch.Tensor]) -> list[bool]:
        """Load ``keys`` into ``buffers`` (exact sizes); per key whether it
        landed. Look up and lock, load what was found, unlock: LMCache's Redis
        client drops its connection on a read of a missing key."""
        adapter = self.adapter
        landed = [False] * len(keys)
        objs = [flat_memory_obj(b) for b in buffers]
        found: list[int] = []
        try:
            task = adapter.submit_lookup_and_lock_task(keys, {})
            held = self._wait(lambda: adapter.query_lookup_and_lock_result(task), [])
            found = [i for i in range(len(keys)) if held.test(i)]
            if len(found) < len(keys):
                self._raise_if_down()
            if found:
                task = adapter.submit_load_task(
                    [keys[i] for i in found], [objs[i] for i in found]
                )
                bitmap = self._wait(lambda: adapter.query_load_result(task), objs)
                for n, i in enumerate(found):
                    landed[i] = bool(bitmap.test(n))
                if not all(landed[i] for i in found):
                    self._raise_if_down()
        finally:
            if found:
                adapter.submit_unlock([keys[i] for i in found])
        return landed

    def store(self, keys: list[ObjectKey], buffers: list[torch.Tensor]) -> bool:
        """One store task; whether the store took it."""
        objs = [flat_memory_obj(b) for b in buffers]
        task = self.adapter.submit_store_task(keys, objs)
        result = self._wait(lambda: self._store_result(task), objs)
        if not result.is_successful():
            self._raise_if_down()
        return bool(result.is_successful())

    def _raise_if_down(self) -> None:
        """StoreDown if the adapter says its store is lost: then a failed
        operation is an outage, not a miss or a refused write."""
        why = down_reason(self.adapter)
        if why is not None:
            raise StoreDown(why)

    def delete_later(self, objects: list[ObjectKey], wait_s: float) -> None:
        """Delete ``objects`` on a thread of its own (LMCache's native
        adapters block up to 30 s), waited for up to ``wait_s``."""
        deleting = threading.Thread(
            target=_delete, args=(self.adapter, objects), daemon=True
        )
        deleting.start()
        deleting.join(wait_s)

    def _store_result(self, task: int) -> Any:
        """The result of store ``task``: LMCache pops every finished store at
        once, so each caller files the others' for them."""
        with self._lock:
            self._stores_done.update(self.adapter.pop_completed_store_tasks())
            return self._stores_done.pop(task, None)

    def _wait(self, query: Callable[[], Any], objs: list[Any]) -> Any:
        """Poll ``query`` until it answers; after the timeout keep the
        operation's buffers for good and raise StoreTimeout."""
        timeout = TIMEOUT_S if self.timeout_s is None else self.timeout_s
        result = answer(query, timeout)
        if result is None:
            self._abandoned.append(objs)
            raise StoreTimeout(f"an operation took over {timeout:g} s")
        return result


def _delete(adapter: L2AdapterInterface, objects: list[ObjectKey]) -> None:
    try:
        adapter.delete(objects)
    except Exception:
        logger.exception("lmcache_tiered: store delete failed")


def close_later(
    adapter: L2AdapterInterface, delete_first: list[ObjectKey] | None = None
) -> threading.Thread:
    """Close ``adapter`` (after deleting ``delete_first``) on a daemon thread:
    a client stuck on a hung store may never return from either."""

    def close() -> None:
        if delete_first:
            _delete(adapter, delete_first)
        adapter.close()

    thread = threading.Thread(
        target=close, name="lmcache-tiered-store-close", daemon=True
    )
    thread.start()
    return thread


@dataclass(frozen=True, slots=True)
class StoreCheck:
    """What one check of a store found: why it is ``down`` (serves nothing),
    or why it ``refused`` a write (serves reads only), or neither."""

    down: str | None = None
    refused: str | None = None
