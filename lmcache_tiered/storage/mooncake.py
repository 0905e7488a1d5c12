"""Mooncake Store as an L2 adapter of LMCache, over Mooncake's Python client.

LMCache's own ``mooncake_store`` adapter needs a C++ extension no LMCache
wheel ships, so this connector talks to ``mooncake.store`` (PyPI
``mooncake-transfer-engine-non-cuda``; ``pip install
"lmcache-tiered[mooncake]"``) and plugs into LMCache through its own
``native_plugin`` adapter type, which wraps it in LMCache's
``NativeConnectorL2Adapter``::

    {"type": "native_plugin", "module_path": "lmcache_tiered.storage.mooncake",
     "class_name": "MooncakeConnector",
     "adapter_params": {"master_server_address": "10.0.0.2:50051",
                        "local_hostname": "10.0.0.5"}}

That JSON works as ``tiered.cold.adapter`` (the cold tier on Mooncake) and as
``lmcache server --l2-adapter`` on its own. The client holds no memory of the
pool (global segment 0): the pool's memory lives in ``mooncake_client``
processes, so it outlives the engines.

Data path: gets land straight in the caller's buffers (``batch_get_into`` on
their addresses: no copy in Python), sets are upserts (``batch_upsert_from``:
``put`` of an existing key keeps the old bytes), lookups one
``batch_is_exist``. A read or a lookup leases its object (the master's
``-default_kv_lease_ttl``, 10 s by default) and Mooncake refuses to remove it
meanwhile: such deletes are kept and retried once a second until they pass,
and a set of the same key cancels them.

Failure: Mooncake's own timeouts are set (``timeout_s``, before the first
client starts), so a hung master or memory process costs one operation at
most that long; a lost master's fixed retry costs 4.3 s. The first operation
that fails for want of the master or a memory process (RPC or transfer
failure) marks the store *unreachable*: one WARNING line, and every
operation fails at once until a check of our own (a small upsert and read
back, every :data:`RECHECK_S` s on a thread of its own) passes. The cold
tier asks :meth:`MooncakeConnector.unreachable` why its store failed (the
wrapper's completions carry one bool per key), so a lost Mooncake is a store
that is down there, not one that refuses writes.

One client per master and hostname serves every connector of the process:
Mooncake's setup against a master that does not answer retries 40-90 s
holding the GIL, while a client that is up reconnects by itself when its
master returns. A master whose port takes no connection within ``timeout_s``
(at least 2 s) fails at once, naming the setting.

May touch: the Mooncake pool ``master_server_address`` names; nothing on disk.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger("lmcache_tiered")

#: Debian packages whose libraries Mooncake's wheel links.
DEBIAN_PACKAGES = ("libibverbs1", "libnuma1", "libcurl4")
INSTALL = (
    'pip install "lmcache-tiered[mooncake]" (mooncake-transfer-engine-non-cuda) '
    f"and apt-get install {' '.join(DEBIAN_PACKAGES)}"
)
#: Seconds a Mooncake operation may block by default: below the cold tier's
#: own timeout (store_client.TIMEOUT_S), so a hung master shows as a failure.
DEFAULT_TIMEOUT_S = 2.0
#: Seconds between checks of an unreachable store and retries of deletes
#: refused for a lease.
RECHECK_S = 1.0
#: Deletes waiting for a lease to end, at most (the oldest are dropped).
MAX_PENDING_DELETES = 1 << 16
#: Bytes of the object the check writes and reads back.
CHECK_BYTES = 4096

# Mooncake's error codes (mooncake-store's ErrorCode) this connector acts on
NOT_FOUND = -704
HAS_LEASE = -706
#: what the codes seen here mean, for error text
CODE_NAMES = {
    -200: "no space (or no memory process registered yet)",
    -600: "buffer too small",
    NOT_FOUND: "not found",
    HAS_LEASE: "leased by a read",
}
#: codes that say the master or a memory process is lost, not the object
UNREACHABLE = {
    -800: "a transfer failed (a memory process lost or hung?)",
    -900: "an RPC to the master failed (master lost?)",
    -901: "an RPC to the master timed out (master hung?)",
}

Completion = tuple[int, bool, str, list[bool] | None]
_PARAMS = (
    "master_server_address",
    "local_hostname",
    "metadata_server",
    "protocol",
    "local_buffer_size",
    "timeout_s",
    "num_workers",
)


def adapter_spec(
    master_server_address: str, local_hostname: str, **params: Any
) -> dict[str, Any]:
    """The ``native_plugin`` JSON (as a dict) for a Mooncake pool."""
    return {
        "type": "native_plugin",
        "module_path": __name__,
        "class_name": MooncakeConnector.__name__,
        "adapter_params": {
            "master_server_address": master_server_address,
            "local_hostname": local_hostname,
            **params,
        },
    }


def _store_class() -> Any:
    """Mooncake's client class; ImportError saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            f"lmcache_tiered: the Mooncake connector needs Mooncake's client "
            f"({exc}); {INSTALL}"
        ) from None
    return MooncakeDistributedStore


def _set_timeouts(timeout_s: float) -> None:
    """Mooncake's timeouts, from its environment (read when its library
    loads: the first connector's hold for the process; a value the user set
    wins): an RPC to a hung master, a transfer to a hung memory
    process. Quiet logs unless asked for."""
    ms = max(1, round(timeout_s * 1000))
    seconds = str(max(1, round(timeout_s)))
    for name, value in (
        ("MC_RPC_TIMEOUT_MS", str(ms)),
        ("MC_RPC_CONNECT_TIMEOUT_MS", str(max(1, ms // 2))),
        ("MC_TCP_PROGRESS_TIMEOUT_SEC", seconds),
        ("MC_TCP_STATUS_TIMEOUT_SEC", seconds),
        ("MC_LOG_LEVEL", "ERROR"),
    ):
        os.environ.setdefault(name, value)


def _check_hostname(hostname: str) -> None:
    """ValueError unless ``hostname`` is an address of this host: Mooncake
    tells its peers to reach this client there."""
    try:
        family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((hostname, 0))
    except OSError as exc:
        raise ValueError(
            f"adapter_params.local_hostname: {hostname!r} is not an address of "
            f"this host ({exc}); set it to this host's IP on the network the "
            f"Mooncake master and memory processes reach"
        ) from None


def _size(name: str, value: Any) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = -1
    if size <= 0:
        raise ValueError(f"adapter_params.{name}: expected bytes > 0, got {value!r}")
    return size


def _addresses(views: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Each buffer's address and size, no copy (LMCache's memoryviews, or
    anything with the buffer protocol)."""
    arrays = [np.frombuffer(v, dtype=np.uint8) for v in views]
    return [int(a.ctypes.data) for a in arrays], [a.size for a in arrays]


def _codes(codes: Sequence[int]) -> str:
    """Failed codes of a batch, counted and named, for error text."""
    failed = [c for c in codes if c < 0]
    names = CODE_NAMES | UNREACHABLE
    return ", ".join(
        f"{c} {names.get(c, 'error')} x{failed.count(c)}" for c in sorted(set(failed))
    )


class PoolClosed(RuntimeError):
    """The process's Mooncake client was closed (at exit)."""


class _Pool:
    """One Mooncake client of this process for one master and hostname,
    shared by its connectors: whether it is reachable, the check that says
    when it is again, and deletes waiting for leases."""

    def __init__(self, client: Any, master: str, hostname: str) -> None:
        self.client = client
        self.master = master
        self.hostname = hostname
        self.down: str | None = None
        self._down_since = 0.0
        self._lock = threading.Lock()
        #: deletes refused for a lease (or an outage), retried in order
        self._pending: dict[str, None] = {}
        #: held while a delete runs, so a set of the same key waits for it
        self.delete_lock = threading.Lock()
        self._check_key = f"lmcache-tiered-check@{hostname}@{os.getpid()}"
        self._check_buffer = np.full(CHECK_BYTES, 0x5A, dtype=np.uint8)
        self._closed = threading.Event()
        #: calls under way, counted so close waits for them
        self._calls = 0
        self._idle = threading.Condition()
        threading.Thread(
            target=self._maintain, name="lmcache-tiered-mooncake", daemon=True
        ).start()

    def call(self, method: str, *args: Any) -> Any:
        """Mooncake's ``method`` on the client, never once it is closed (a
        call on a closed client crashes the process)."""
        with self._idle:
            if self._closed.is_set():
                raise PoolClosed(f"the Mooncake client of {self.master} is closed")
            self._calls += 1
        try:
            return getattr(self.client, method)(*args)
        finally:
            with self._idle:
                self._calls -= 1
                self._idle.notify_all()

    def failed(self, codes: Sequence[int]) -> None:
        """Mark the pool unreachable if ``codes`` say the master or a memory
        process is lost (one WARNING line per outage)."""
        lost = [c for c in codes if c in UNREACHABLE]
        if not lost:
            return
        with self._lock:
            if self.down is not None:
                return
            self._down_since = time.time()
            self.down = (
                f"Mooncake pool (master {self.master}) unreachable since "
                f"{time.strftime('%H:%M:%S', time.gmtime(self._down_since))} UTC: "
                f"{UNREACHABLE[lost[0]]} (code {lost[0]})"
            )
        logger.warning(
            "lmcache_tiered: %s; its objects are misses and writes fail until a "
            "check passes (one every %g s; is mooncake_master running at %s and "
            "a mooncake_client holding the pool's memory?)",
            self.down,
            RECHECK_S,
            self.master,
        )

    def defer_deletes(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._pending[key] = None
            while len(self._pending) > MAX_PENDING_DELETES:
                del self._pending[next(iter(self._pending))]

    def cancel_deletes(self, keys: Sequence[str]) -> None:
        """A set of ``keys`` is coming: their pending deletes would remove it."""
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)

    def _maintain(self) -> None:
        while not self._closed.wait(RECHECK_S):
            try:
                if self.down is not None:
                    self._check()
                elif self._pending:
                    self._retry_deletes()
            except PoolClosed:
                return
            except Exception:
                logger.exception("lmcache_tiered: Mooncake upkeep failed")

    def _check(self) -> None:
        """A small upsert and read back; on success the pool serves again."""
        buffer = self._check_buffer
        address = int(buffer.ctypes.data)
        put = self.call("upsert_from", self._check_key, address, CHECK_BYTES)
        back = np.zeros(CHECK_BYTES, dtype=np.uint8)
        got = NOT_FOUND
        if put == 0:
            got = self.call(
                "get_into", self._check_key, int(back.ctypes.data), CHECK_BYTES
            )
        if got != CHECK_BYTES or not np.array_equal(back, buffer):
            return
        with self._lock:
            since, self.down = self._down_since, None
        logger.warning(
            "lmcache_tiered: Mooncake pool (master %s) answers again after %.0f s",
            self.master,
            time.time() - since,
        )

    def _retry_deletes(self) -> None:
        with self.delete_lock:
            with self._lock:
                keys = list(self._pending)
            codes = self.call("batch_remove", keys)
            with self._lock:
                for key, code in zip(keys, codes, strict=True):
                    if code != HAS_LEASE and code not in UNREACHABLE:
                        self._pending.pop(key, None)

    def close(self) -> None:
        """Close the client once no call is under way (within 5 s; else it
        is left open: better than a crash)."""
        with self._idle:
            self._closed.set()
            idle = self._idle.wait_for(lambda: self._calls == 0, timeout=5)
        if idle:
            self.client.close()


_POOLS: dict[tuple[str, ...], _Pool] = {}
_POOLS_LOCK = threading.Lock()


def _answers(master: str, wait_s: float) -> None:
    """ConnectionError unless the master's RPC port takes a connection
    within ``wait_s``: Mooncake's setup against a port nobody listens on
    retries for 90 s holding the GIL (every thread of the process stops)."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"adapter_params.master_server_address: expected host:port of "
            f"mooncake_master's -rpc_port, got {master!r}"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), wait_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"lmcache_tiered: no Mooncake master answers at {master} ({exc}; "
            f"waited up to {wait_s:g} s): start mooncake_master there, or fix "
            f"adapter_params.master_server_address (host:port of its -rpc_port)"
        ) from None


def _pool(
    master: str, hostname: str, metadata: str, protocol: str, buffer: int, wait_s: float
) -> _Pool:
    """The process's client for this master, set up if need be. A master
    that takes connections but never answers (stopped) still holds the
    first setup up to 40 s: Mooncake's setup cannot be bounded from here."""
    key = (master, hostname, metadata, protocol, str(buffer))
    with _POOLS_LOCK:
        if (pool := _POOLS.get(key)) is not None:
            return pool
        _answers(master, wait_s)
        client = _store_class()()
        rc = client.setup(hostname, metadata, 0, buffer, protocol, "", master)
        if rc != 0:
            raise ConnectionError(
                f"lmcache_tiered: Mooncake's client setup against the master at "
                f"{master} failed (code {rc}; adapter_params.master_server_address,"
                f" local_hostname {hostname}, protocol {protocol}): check that "
                f"mooncake_master runs there and this host reaches it"
            )
        pool = _POOLS[key] = _Pool(client, master, hostname)
        return pool


def close_pools() -> None:
    """Close every client of this process (at exit; tests between pools),
    each waited for at most a few seconds: a client of a lost master may hang."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    closing = [threading.Thread(target=p.close, daemon=True) for p in pools]
    for thread in closing:
        thread.start()
    for thread in closing:
        thread.join(5)


atexit.register(close_pools)


class MooncakeConnector:
    """The connector LMCache's ``native_plugin`` adapter type wraps (see the
    module docstring): ``submit_batch_*`` queue an operation and return its
    id; a worker runs it and files a completion, ``event_fd`` says there are
    some, ``drain_completions`` hands them over.

    ``adapter_params``: ``master_server_address`` (host:port of
    mooncake_master's RPC), ``local_hostname`` (this host's address the pool
    reaches), ``metadata_server`` (default ``P2PHANDSHAKE``), ``protocol``
    (``tcp``), ``local_buffer_size`` (bytes of the client's transfer buffer,
    default 16 MiB), ``timeout_s`` (Mooncake's RPC and transfer timeouts,
    default 2), ``num_workers`` (operations in flight, default 2)."""

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(_PARAMS))
        if unknown:
            raise ValueError(
                f"adapter_params: unknown {', '.join(unknown)} for the Mooncake "
                f"connector; it takes {', '.join(_PARAMS)}"
            )
        master = params.get("master_server_address")
        hostname = params.get("local_hostname")
        for name, value in (
            ("master_server_address", master),
            ("local_hostname", hostname),
        ):
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"adapter_params.{name}: missing; the Mooncake connector needs "
                    f"master_server_address (host:port of mooncake_master) and "
                    f"local_hostname (this host's address the pool reaches)"
                )
        assert isinstance(master, str) and isinstance(hostname, str)
        protocol = str(params.get("protocol", "tcp"))
        if protocol != "tcp":
            raise ValueError(
                f"adapter_params.protocol: {protocol!r} is not supported; the "
                f"connector reads into LMCache's buffers unregistered, which "
                f"Mooncake allows over tcp only"
            )
        timeout_s = float(params.get("timeout_s", DEFAULT_TIMEOUT_S))
        if not timeout_s > 0:
            raise ValueError(f"adapter_params.timeout_s: expected > 0, got {timeout_s}")
        workers = int(params.get("num_workers", 2))
        if workers < 1:
            raise ValueError(
                f"adapter_params.num_workers: expected >= 1, got {workers}"
            )
        buffer = _size("local_buffer_size", params.get("local_buffer_size", 16 << 20))
        _check_hostname(hostname)
        _set_timeouts(timeout_s)  # before Mooncake's library loads: read then
        _store_class()  # what to install, before anything starts
        metadata = str(params.get("metadata_server", "P2PHANDSHAKE"))
        self.pool = _pool(
            master, hostname, metadata, protocol, buffer, max(timeout_s, 2.0)
        )
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._done: list[Completion] = []
        self._closed = False
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._workers = [
            threading.Thread(
                target=self._work, name="lmcache-tiered-mooncake-op", daemon=True
            )
            for _ in range(workers)
        ]
        for worker in self._workers:
            worker.start()

    # ------------------------------------------------------- the protocol

    def event_fd(self) -> int:
        return self._efd

    def submit_batch_get(self, keys: list[str], views: list[Any]) -> int:
        return self._submit(self._get, keys, views)

    def submit_batch_set(self, keys: list[str], views: list[Any]) -> int:
        return self._submit(self._set, keys, views)

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit(self._exists, keys)

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit(self._delete, keys)

    def drain_completions(self) -> list[Completion]:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._efd)
            done, self._done = self._done, []
        return done

    def unreachable(self) -> str | None:
        """Why the pool cannot be reached now (the cold tier then counts its
        store as down), or None."""
        return self.pool.down

    def close(self) -> None:
        """Stop this connector's workers (an operation under way finishes on
        its own); the process's client stays for other connectors."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._efd)
        for _ in self._workers:
            self._queue.put(None)

    # ------------------------------------------------------- the operations

    def _submit(
        self, op: Callable[..., tuple[bool, str, list[bool]]], *args: Any
    ) -> int:
        future = next(self._ids)

        def run() -> None:
            if not args[0]:  # no keys
                self._complete(future, True, "", [])
                return
            if self.pool.down is not None:
                if op == self._delete:  # done once the pool is back
                    self.pool.defer_deletes(args[0])
                    self._complete(future, True, "", [True] * len(args[0]))
                    return
                self._complete(future, False, self.pool.down, None)
                return
            try:
                ok, error, results = op(*args)
            except PoolClosed as exc:
                self._complete(future, False, str(exc), None)
                return
            except Exception as exc:
                logger.exception("lmcache_tiered: a Mooncake operation failed")
                self._complete(future, False, f"{type(exc).__name__}: {exc}", None)
                return
            self._complete(future, ok, error, results)

        self._queue.put(run)
        return future

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            job()

    def _complete(
        self, future: int, ok: bool, error: str, results: list[bool] | None
    ) -> None:
        with self._lock:
            if self._closed:
                return
            self._done.append((future, ok, error, results))
            os.eventfd_write(self._efd, 1)

    def _get(self, keys: list[str], views: list[Any]) -> tuple[bool, str, list[bool]]:
        """Into the callers' buffers; a key lands only if its object has
        exactly the buffer's size."""
        addresses, sizes = _addresses(views)
        codes = self.pool.call("batch_get_into", keys, addresses, sizes)
        self.pool.failed(codes)
        landed = [c == s for c, s in zip(codes, sizes, strict=True)]
        return all(landed), _codes(codes), landed

    def _set(self, keys: list[str], views: list[Any]) -> tuple[bool, str, list[bool]]:
        addresses, sizes = _addresses(views)
        with self.pool.delete_lock:  # after a delete of the same key under way
            self.pool.cancel_deletes(keys)
        codes = self.pool.call("batch_upsert_from", keys, addresses, sizes)
        self.pool.failed(codes)
        stored = [c == 0 for c in codes]
        return all(stored), _codes(codes), stored

    def _exists(self, keys: list[str]) -> tuple[bool, str, list[bool]]:
        codes = self.pool.call("batch_is_exist", keys)
        self.pool.failed(codes)
        failed = [c for c in codes if c < 0]
        return not failed, _codes(codes), [c == 1 for c in codes]

    def _delete(self, keys: list[str]) -> tuple[bool, str, list[bool]]:
        """Removed, gone already, or kept until its lease ends (then removed
        by the pool's upkeep): each is a delete done, as far as LMCache
        needs to know."""
        with self.pool.delete_lock:
            codes = self.pool.call("batch_remove", keys)
        self.pool.failed(codes)
        later = [
            k
            for k, c in zip(keys, codes, strict=True)
            if c == HAS_LEASE or c in UNREACHABLE
        ]
        self.pool.defer_deletes(later)
        done = [c in (0, NOT_FOUND, HAS_LEASE) or c in UNREACHABLE for c in codes]
        return all(done), _codes(codes), done
