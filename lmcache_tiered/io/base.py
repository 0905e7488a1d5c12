"""The one small protocol every I/O engine speaks.

A tier turns each chunk read or write into a batch of :class:`IORequest`
(file, offset, buffer) and hands the whole batch to an engine at once, so the
engine can keep every device busy. Engines differ only in how they move the
bytes (io_uring, a thread pool); the tier never knows which one it has.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

#: Alignment for O_DIRECT buffers, offsets and lengths (safe on every NVMe).
ALIGN = 4096
#: Longest an engine's close (and the writer's, for the batch it is writing)
#: waits for I/O already in flight. A hung drive can hold a request for
#: minutes: the close then returns, requests not yet started fail with
#: ECANCELED, and the engine frees its resources (its own descriptors, the
#: ring, whose registered files hold their own references) when the last one
#: completes, so no request ever reaches a descriptor number the caller has
#: closed and reused.
CLOSE_WAIT_S = 5.0


def write_depth(queue_depth: int) -> int:
    """Most writes an engine keeps in flight: half its depth (at least one),
    so reads, which go first, always find room beside a long run of writes."""
    return max(1, queue_depth // 2)


@dataclass(frozen=True, slots=True)
class IORequest:
    """One contiguous transfer between a registered file and a buffer.

    ``file`` is the index of the file in the engine's ``fds`` (not an fd), so
    engines can use registered (fixed) files. For O_DIRECT, ``offset``,
    ``len(buffer)`` and the buffer's address must be multiples of
    :data:`ALIGN`.
    """

    file: int
    offset: int
    buffer: memoryview


class IOEngine(abc.ABC):
    """Moves batches of :class:`IORequest` between memory and files.

    Thread-safe: several threads may submit at once. ``submit`` never blocks on
    the I/O itself; it returns a future that resolves, once every request of
    the batch has completed, to one result per request: the number of bytes
    transferred (short at end of file) or ``-errno``. A failed request never
    raises; the caller decides what a short or failed transfer means.
    """

    #: Short name shown in logs and benchmark reports.
    name: str = "abstract"
    #: Whether :meth:`register_buffers` can make transfers cheaper.
    supports_fixed_buffers: bool = False

    def __init__(self, fds: Sequence[int], queue_depth: int) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.fds = list(fds)
        self.queue_depth = queue_depth

    @abc.abstractmethod
    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        """Start every request of the batch (up to ``queue_depth`` in flight)."""

    def submit_many(
        self, batches: Sequence[Sequence[IORequest]], write: bool
    ) -> list[Future[list[int]]]:
        """Start several batches at once: one future each, as :meth:`submit`
        gives. Engines that can hand them over in one wake-up override it."""
        return [self.submit(requests, write) for requests in batches]

    def read(self, requests: Sequence[IORequest]) -> list[int]:
        """Blocking read of a batch: ``submit(requests, write=False).result()``."""
        return self.submit(requests, write=False).result()

    def write(self, requests: Sequence[IORequest]) -> list[int]:
        """Blocking write of a batch: ``submit(requests, write=True).result()``."""
        return self.submit(requests, write=True).result()

    def register_buffers(self, regions: Sequence[memoryview]) -> bool:
        """Declare memory that later requests will use; True if it helps.

        Engines without :attr:`supports_fixed_buffers` accept nothing and
        return False: every buffer works with every engine regardless.
        """
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for in-flight requests (at most :data:`CLOSE_WAIT_S`), then
        release the engine's resources.

        The file descriptors belong to the caller and stay open; once close
        returns the caller may close them, even with requests still stuck in
        flight.
        """

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EngineWrapper(IOEngine):
    """Another engine's I/O, seen or changed on its way: the base of the
    wrappers set through ``Tier.engine`` (a modelled device's delay, an
    injected fault). Everything not overridden goes to ``inner`` unchanged."""

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner.fds, inner.queue_depth)
        self.inner = inner
        self.supports_fixed_buffers = inner.supports_fixed_buffers

    @property
    def name(self) -> str:  # type: ignore[override]
        """The inner engine's, as it is now (a provisional engine's changes)."""
        return self.inner.name

    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        return self.submit_many([requests], write)[0]

    def submit_many(
        self, batches: Sequence[Sequence[IORequest]], write: bool
    ) -> list[Future[list[int]]]:
        return self.inner.submit_many(batches, write)

    def register_buffers(self, regions: Sequence[memoryview]) -> bool:
        return self.inner.register_buffers(regions)

    def close(self) -> None:
        self.inner.close()
