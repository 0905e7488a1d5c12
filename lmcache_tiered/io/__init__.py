"""I/O engines behind one small protocol (:mod:`lmcache_tiered.io.base`).

:func:`make_engine` picks the engine a tier runs on and says why in the log,
so a silent fallback to the slower thread pool never goes unnoticed.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence

from lmcache_tiered.config import setting_key
from lmcache_tiered.io import probe, provisional, ring
from lmcache_tiered.io.base import ALIGN, IOEngine, IORequest
from lmcache_tiered.io.threads import ThreadEngine

__all__ = [
    "ALIGN",
    "IOEngine",
    "IORequest",
    "ThreadEngine",
    "aligned_buffer",
    "make_engine",
]

logger = logging.getLogger("lmcache_tiered")

ENGINE_KINDS = ("auto", "uring", "threads")


_fallback_reported = False
#: the setting that chooses the engine, as messages cite it
IO_ENGINE = setting_key("io_engine")


def _report_fallback(reason: str) -> None:
    """One ERROR per process: the thread engine is slower and costs more CPU."""
    global _fallback_reported
    if not _fallback_reported:
        _fallback_reported = True
        logger.error(
            "io_uring unusable here, using the thread-pool engine: %s; set "
            "`%s: threads` to choose it explicitly",
            reason,
            IO_ENGINE,
        )


def make_engine(kind: str, fds: Sequence[int], queue_depth: int) -> IOEngine:
    """Build the engine ``kind`` ("auto" | "uring" | "threads") over ``fds``.

    "auto" takes io_uring when the child-process probe
    (:func:`lmcache_tiered.io.probe.uring_verdict`) proved a real ring works
    here, else the thread pool; with no verdict within
    :data:`~lmcache_tiered.io.provisional.START_WAIT_S`, the thread pool
    until there is one (:class:`~lmcache_tiered.io.provisional.ProvisionalEngine`).
    "uring" insists, waits and fails loudly otherwise.
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"io engine must be one of {ENGINE_KINDS}, got {kind!r}")
    if kind == "threads":
        why = f"chosen by {IO_ENGINE}"
    elif kind == "auto" and not probe.verdict_ready(provisional.START_WAIT_S):
        logger.info(
            "I/O engine: threads until the io_uring probe answers (none after "
            "%.0f s): io_uring then takes over",
            provisional.START_WAIT_S,
        )
        return provisional.ProvisionalEngine(
            fds,
            queue_depth,
            lambda: _uring_engine(fds, queue_depth),
            _report_fallback,
        )
    else:
        engine, reason = _uring_engine(fds, queue_depth)
        if engine is not None:
            logger.info("I/O engine: uring, queue depth %d (%s)", queue_depth, reason)
            return engine
        if kind == "uring":
            raise RuntimeError(
                f"{IO_ENGINE} is uring, but io_uring is unusable here: {reason}; "
                f"set `{IO_ENGINE}: threads` to use the thread-pool engine"
            )
        _report_fallback(reason)
        why = f"io_uring unusable: {reason}"
    threads = ThreadEngine(fds, queue_depth)
    logger.info("I/O engine: threads, %d threads (%s)", threads.threads, why)
    return threads


def _uring_engine(fds: Sequence[int], queue_depth: int) -> tuple[IOEngine | None, str]:
    """An io_uring engine if the probe passed and the ring sets up in this
    process too (RLIMIT_MEMLOCK, a sandbox the child escaped), else why not."""
    ok, reason = probe.uring_verdict()
    if not ok:
        return None, reason
    from lmcache_tiered.io.uring import UringEngine

    try:
        return UringEngine(fds, queue_depth), reason
    except OSError as exc:
        return None, f"the probe passed, but here {ring.describe(exc)}"


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable, zeroed, page-aligned (hence :data:`ALIGN`-aligned) buffer.

    O_DIRECT needs aligned memory and ``bytearray``/numpy/torch allocations
    are not; an anonymous mmap is, and it is freed once the view is dropped.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return memoryview(mmap.mmap(-1, max(nbytes, ALIGN)))[:nbytes]
