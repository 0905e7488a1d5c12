"""Where records are checked: one process-wide pool, fed from I/O completions.

A record's check (its CRC32C) starts on :data:`VERIFIERS` from the I/O
engine's completion thread the moment the record lands, while the others
still read; the reader waits once for the whole batch (:class:`CheckBatch`).
Handing each landing to the reader first, which then queued the check, woke
two threads per record instead of one: at RAM speed on two cores that cost
about 0.005 CPU s/GB and 3 % of read GB/s (see docs/diskbench.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

#: Checks records as they land and checksums payloads as they are written
#: (the checksums release the GIL): shared by all tiers of the process, sized
#: to the cores, since it is CPU work.
VERIFIERS = ThreadPoolExecutor(
    max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="lmcache-tiered-crc"
)

_Outcome = TypeVar("_Outcome")


class CheckBatch(Generic[_Outcome]):
    """The checks of one batch read: ``expected`` of them, one per index.

    :meth:`start` may be called from any thread (an engine's completion
    callback, or the reader's own when a read failed at once); :meth:`wait`
    returns once every expected check has run, so no check still writes into
    the caller's buffers, and raises the first error a check raised.
    """

    def __init__(self, size: int, expected: int) -> None:
        self.outcomes: list[_Outcome | None] = [None] * size
        self._left = expected
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        if expected == 0:
            self._done.set()

    def start(self, index: int, check: Callable[..., _Outcome], *args: Any) -> None:
        """Queue ``check(*args)`` as the check of ``index``; run it here if the
        pool takes no more work (the interpreter is exiting)."""
        try:
            VERIFIERS.submit(self._run, index, check, args)
        except RuntimeError:
            self._run(index, check, args)

    def _run(
        self, index: int, check: Callable[..., _Outcome], args: tuple[Any, ...]
    ) -> None:
        try:
            self.outcomes[index] = check(*args)
        except BaseException as exc:
            with self._lock:
                self._error = self._error or exc
        finally:
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self._done.set()

    def wait(self) -> list[_Outcome | None]:
        """Every index's outcome (None where none was checked)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self.outcomes
