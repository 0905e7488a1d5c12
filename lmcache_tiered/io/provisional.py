"""An engine that serves on threads until the io_uring probe has spoken.

The probe child (:mod:`lmcache_tiered.io.probe`) takes tens of milliseconds;
one that hangs in the kernel holds its verdict back for up to its timeout
(20 s). A tier must not wait that long to serve its first request, so with
``tiered.io_engine: auto`` and no verdict after :data:`START_WAIT_S`, the
tier gets a :class:`ProvisionalEngine`: the thread pool now, io_uring once
the probe passes. Each batch goes whole to one engine, so no request is
served twice or half by each; the thread pool finishes what it holds before
it is closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from lmcache_tiered.io.base import IOEngine, IORequest
from lmcache_tiered.io.threads import ThreadEngine

logger = logging.getLogger("lmcache_tiered")

#: How long a tier waits for the probe's verdict before it starts on threads.
START_WAIT_S = 2.0

#: Builds the io_uring engine once the probe passed: the engine, or why not.
UringFactory = Callable[[], tuple[IOEngine | None, str]]


class ProvisionalEngine(IOEngine):
    """The thread pool until ``make_uring`` (run on a thread of its own: it
    waits for the probe) builds io_uring, then io_uring; ``on_fallback``
    hears why when it cannot."""

    #: buffers given now are kept and registered with io_uring at the switch
    supports_fixed_buffers = True

    def __init__(
        self,
        fds: Sequence[int],
        queue_depth: int,
        make_uring: UringFactory,
        on_fallback: Callable[[str], None],
    ) -> None:
        super().__init__(fds, queue_depth)
        self._lock = threading.Lock()
        self._engine: IOEngine = ThreadEngine(fds, queue_depth)
        self.name = self._engine.name
        self._regions: list[memoryview] = []
        #: the thread pool while the switch waits for what it holds
        self._retiring: IOEngine | None = None
        self._closed = False
        self._started = time.monotonic()
        self._make_uring = make_uring
        self._on_fallback = on_fallback
        self.switched = threading.Event()
        threading.Thread(
            target=self._switch_when_proven, name="lmcache-tiered-probe", daemon=True
        ).start()

    @property
    def current(self) -> IOEngine:
        """The engine batches go to now."""
        return self._engine

    def _switch_when_proven(self) -> None:
        engine, reason = self._make_uring()
        waited = time.monotonic() - self._started
        if engine is None:
            self._on_fallback(reason)
            logger.info(
                "I/O engine: staying on threads after %.1f s (%s)", waited, reason
            )
            return
        with self._lock:
            closed = self._closed
            if not closed:
                if self._regions:
                    engine.register_buffers(self._regions)
                old, self._engine = self._engine, engine
                self._retiring = old
                self.name = engine.name
        if closed:  # the tier closed while the probe ran
            engine.close()
            return
        old.close()  # waits for what it holds; new batches go to io_uring
        with self._lock:
            self._retiring = None
        logger.info(
            "I/O engine: uring from now on, after %.1f s on threads (%s)",
            waited,
            reason,
        )
        self.switched.set()

    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        # under the lock: the switch never closes an engine a batch is entering
        with self._lock:
            if self._closed:
                raise RuntimeError("the I/O engine is closed")
            return self._engine.submit(requests, write)

    def submit_many(
        self, batches: Sequence[Sequence[IORequest]], write: bool
    ) -> list[Future[list[int]]]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the I/O engine is closed")
            return self._engine.submit_many(batches, write)

    def register_buffers(self, regions: Sequence[memoryview]) -> bool:
        """Kept for io_uring, registered there when it takes over."""
        with self._lock:
            self._regions = list(regions)
            return self._engine.register_buffers(regions)

    def close(self) -> None:
        """Close the current engine and the thread pool still being retired
        by a switch (each bounded: see CLOSE_WAIT_S), so that neither does
        I/O on descriptors the tier closes next."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engines = [self._engine]
            if self._retiring is not None:
                engines.append(self._retiring)
        for engine in engines:
            engine.close()
