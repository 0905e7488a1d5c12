"""Whether a tier serves: failed I/O in a row, degrading, probing, recovering.

One machine for every kind of tier. A record that fails its checks is a miss
and is dropped; a device or store that fails is a miss for the whole tier.
After :data:`DEGRADE_AFTER` failed operations in a row, or when the tier says
so (its files vanished from their paths; a store timed out), the tier is
*degraded*: one WARNING line says why, its lookups and reads are misses, its
writes are dropped, and the other tiers keep serving. A prober thread retries
every period through the tier's ``recover`` until it serves again (one line
again). A tier that must be watched while healthy (a store, which can fail
with nobody asking it) gives ``watch``, run every period on the same thread.

:class:`TierHealth` holds this state under the tier's own lock and does no
I/O itself: the tier hands it ``missing`` (which file left its path),
``recover`` (one probe), and how its lines read (:class:`HealthLines`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lmcache_tiered.keys import key_text
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage.files import printable
from lmcache_tiered.storage.layout import RecordHeader

logger = logging.getLogger("lmcache_tiered")

#: Failed I/O operations in a row (no success between) that degrade a tier.
DEGRADE_AFTER = 3
#: Seconds between checks that a tier's files are still at its paths, and
#: between probes of a degraded tier.
PROBE_S = 5.0
#: Seconds between WARNING lines about damaged chunks of one tier; the lines
#: carry the running count, so none goes unreported.
DAMAGE_LOG_S = 10.0
#: Seconds :meth:`TierHealth.close` waits for the prober (stuck in I/O on a
#: hung device, it is a daemon thread and is left behind).
JOIN_S = 10.0


@dataclass(frozen=True, slots=True)
class HealthLines:
    """How a tier's state changes read in the log (``{who}``, ``{why}``,
    ``{period}``, ``{how}`` filled in)."""

    degraded: str = (
        "tier {who} degraded: {why}; its reads are misses and its writes are "
        "dropped until a probe (every {period:g} s) finds it working"
    )
    recovered: str = "tier {who} recovered: {how}"


def _probe_s() -> float:
    return PROBE_S


class TierHealth:
    """The health of tier ``name``: its reason for being degraded (None:
    healthy), its failures in a row, its operations using the files, its
    prober.

    ``missing()`` names the first of the tier's files no longer at its path;
    ``recover()`` is one probe of a degraded tier: how it serves again, or
    None while it does not.
    """

    def __init__(
        self,
        name: str,
        lock: threading.Lock,
        stats: TierStats,
        *,
        missing: Callable[[], str | None],
        recover: Callable[[], str | None],
        watch: Callable[[], None] | None = None,
        on_degrade: Callable[[str], str] | None = None,
        period: Callable[[], float] = _probe_s,
        lines: HealthLines = HealthLines(),
    ) -> None:
        """``on_degrade`` runs under the lock as the tier degrades and turns
        the reason into what :attr:`degraded` says (a store drops its client
        there); ``period`` gives the prober's period, read at each wait."""
        self.name = name
        self.stats = stats
        #: why the tier is degraded (None: healthy)
        self.degraded: str | None = None
        self.closed = False
        self._lock = lock
        self._missing = missing
        self._recover = recover
        self._watch = watch
        self._on_degrade = on_degrade
        self._period = period
        self._lines = lines
        self._failures = 0
        #: operations using the files now; a reopen waits for none
        self._busy = 0
        self._next_check = time.monotonic() + PROBE_S
        #: monotonic time before which damaged chunks are only counted
        self._damage_quiet_until = 0.0
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        if watch is not None:
            self._start_prober()

    @contextlib.contextmanager
    def in_use(self) -> Iterator[bool]:
        """Wrap an operation that does I/O; it yields False (skip it: a miss
        or a drop) while the tier is degraded or closed. Every PROBE_S the
        tier checks that its files are still the ones at its paths."""
        with self._lock:
            now = time.monotonic()
            check = self.degraded is None and not self.closed
            check = check and now >= self._next_check
            if check:
                self._next_check = now + PROBE_S
        if check and (gone := self._missing()) is not None:
            self.degrade(f"{gone} was removed or replaced")
        with self._lock:
            usable = self.degraded is None and not self.closed
            self._busy += usable
        try:
            yield usable
        finally:
            if usable:
                with self._lock:
                    self._busy -= 1

    def busy_locked(self) -> bool:
        """Whether an operation uses the files now (lock held)."""
        return self._busy > 0

    def note_io(self, failure: tuple[str, int] | None) -> None:
        """Count an I/O operation: ``failure`` is (file, errno) of an error,
        None for a success."""
        if failure is None:
            self.note_success()
        else:
            name, error = failure
            self.note_failure(f"{name}: {os.strerror(error)}", "failed I/O operations")

    def note_success(self) -> None:
        with self._lock:
            self._failures = 0

    def note_failure(self, what: str, operations: str = "failed operations") -> None:
        """Count a failed operation (``what`` failed); DEGRADE_AFTER in a row
        degrade the tier."""
        with self._lock:
            self._failures += 1
            if self._failures >= DEGRADE_AFTER:
                self.degrade_locked(f"{what} ({self._failures} {operations} in a row)")

    def degrade(self, reason: str) -> None:
        with self._lock:
            self.degrade_locked(reason)

    def degrade_locked(self, reason: str) -> None:
        """Stop using the tier (one log line) and start the prober."""
        if self.degraded is not None or self.closed:
            return
        if self._on_degrade is not None:
            reason = self._on_degrade(reason)
        self.degraded = reason
        self.stats.degradations += 1
        logger.warning(
            self._lines.degraded.format(
                who=self.name, why=reason, period=self._period()
            )
        )
        if self._prober is None:
            self._start_prober()

    def _start_prober(self) -> None:
        self._prober = threading.Thread(
            target=self._probe_loop,
            name=f"lmcache-tiered-probe-{self.name}",
            daemon=True,
        )
        self._prober.start()

    def _probe_loop(self) -> None:
        """Probe while degraded; while healthy, watch (or end, with nothing
        to watch: the next degradation starts a prober again)."""
        while not self._stop.wait(self._period()):
            if self.degraded is None:
                if self._watch is None:
                    with self._lock:  # a degradation now starts a new prober
                        if self.degraded is None:
                            self._prober = None
                            return
                    continue
                try:
                    self._watch()
                except Exception:  # a bug in the check: keep watching
                    logger.exception("tier %s: health check failed", self.name)
                continue
            try:
                how = self._recover()
            except Exception as exc:  # still broken: try again later
                logger.debug("tier %s: probe failed: %s", self.name, exc)
                continue
            if how is not None:
                with self._lock:
                    self.degraded = None
                    self._failures = 0
                    self._next_check = time.monotonic() + PROBE_S
                logger.warning(self._lines.recovered.format(who=self.name, how=how))

    def damaged(self, header: RecordHeader, what: str) -> bool:
        """Count a record that fails its checks and log it (one line per
        DAMAGE_LOG_S at most, with the count so far); False (drop it)."""
        with self._lock:
            self.stats.corrupt += 1
            count = self.stats.corrupt
            now = time.monotonic()
            if now < self._damage_quiet_until:
                return False
            self._damage_quiet_until = now + DAMAGE_LOG_S
        logger.warning(
            "tier %s: chunk %s %s; dropped (%d damaged records so far; at most "
            "one such line every %g s)",
            self.name,
            printable(key_text(header.key)),
            what,
            count,
            DAMAGE_LOG_S,
        )
        return False

    def close(self) -> bool:
        """Mark the tier closed and stop the prober; False if it already was."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            prober = self._prober
        self._stop.set()
        if prober is not None:
            prober.join(JOIN_S)
            if prober.is_alive():
                logger.warning(
                    "tier %s: its prober is stuck in I/O; closing without it",
                    self.name,
                )
        return True
