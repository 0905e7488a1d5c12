"""A cold tier shared by several hosts: each writes its own files, all read all.

Each host's cold files carry its ``tiered.host_id``, so hosts never write the
same file. Every few seconds :class:`SharedCold` looks for the other hosts'
header files in the cold tier's first directory and (re)reads them through
read-only tiers. A chunk another host is still writing is invisible (its
header comes last), and one it rewrites while we read fails its CRC check,
which read-only tiers apply to every read: never served half-done.

Any member of the group the directory is shared with can put any file there:
a name that is not a regular file (a FIFO, which would block ``open()``
forever) is skipped with one WARNING, and every file is opened without
blocking (:func:`lmcache_tiered.storage.files.open_regular`). A host whose
files will not open (half deleted, other paths than ours, no engine for them)
is a miss: one WARNING, then tries backed off up to :data:`RETRY_MAX_S`; a host
whose header file is gone is forgotten and its files closed.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

from lmcache_tiered.config import ConfigError, TieredConfig, setting_key
from lmcache_tiered.keys import StoreKey
from lmcache_tiered.storage.changes import log_stamp
from lmcache_tiered.storage.files import file_kind, printable
from lmcache_tiered.storage.health import JOIN_S
from lmcache_tiered.storage.layout import RecordHeader, TierNames
from lmcache_tiered.storage.seal import RecordSeal
from lmcache_tiered.storage.tier import Tier

logger = logging.getLogger("lmcache_tiered")

#: seconds between looks at what the other hosts stored
REFRESH_S = 2.0
#: longest wait before another try at a host whose files would not open (the
#: wait doubles from REFRESH_S with each failure in a row)
RETRY_MAX_S = 60.0
#: a header file is read again only if its size or mtime changed, or its
#: owner's change log did, or (an owner with no log) its mtime was within this
#: many seconds of our last read (a file system with coarse timestamps could
#: hide a write in the same tick; a log's size shows every batch logged)
MTIME_SLACK_S = 2.0
#: a header file's size and mtime_ns, and its change log's (inode, size)
Stamp = tuple[int, int, tuple[int, int] | None]


class SharedCold:
    """The other hosts' files in our cold tier's directories, read-only."""

    def __init__(
        self,
        own: Tier | None,
        settings: TieredConfig,
        *,
        max_payload: int,
        seal: RecordSeal | None = None,
    ) -> None:
        """``seal``: the fleet secret's; the other hosts' records are then
        served only with a valid MAC (see :class:`Tier`)."""
        self._own = own
        self._settings = settings
        self._max_payload = max_payload
        self._seal = seal
        self._foreign: dict[str, Tier] = {}
        #: header file -> its stamp, then the wall time, when we last read it
        self._read_at: dict[str, tuple[int, int, tuple[int, int] | None, float]] = {}
        #: names already warned about as not being tier files
        self._refused: set[str] = set()
        #: header file -> (failures in a row, monotonic time of the next try)
        self._failing: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if own is not None:
            self.refresh()
            self._thread = threading.Thread(
                target=self._run, name="lmcache-tiered-shared", daemon=True
            )
            self._thread.start()

    def tiers(self) -> list[Tier]:
        with self._lock:
            return list(self._foreign.values())

    def find(self, key: StoreKey) -> RecordHeader | None:
        return next((h for t in self.tiers() if (h := t.header(key))), None)

    def refresh(self) -> None:
        """Open the header files that appeared, re-read the known ones that
        changed, forget the ones that are gone. Never raises for one host's
        files: they are a miss, tried again later (see :meth:`_failed`)."""
        own, settings = self._own, self._settings
        assert own is not None and settings.cold is not None
        listed: set[str] = set()
        for name in sorted(os.listdir(own.paths[0])):
            owner = TierNames.owner_of(name)
            if owner is None or owner == own.owner:
                continue
            listed.add(name)
            if not self._trusted_host(owner):
                self._refuse(name, f"its host is not in {setting_key('cold.owners')}")
                continue
            failing = self._failing.get(name)
            if failing is not None and time.monotonic() < failing[1]:
                continue
            tier = self._foreign.get(name)
            try:
                info = os.stat(os.path.join(own.paths[0], name), follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    self._refuse(name, f"a {file_kind(info.st_mode)}")
                    continue
                log = log_stamp(TierNames(tuple(own.paths), owner).changes)
                stamp = (info.st_size, info.st_mtime_ns, log)
                if self._unchanged(name, stamp):
                    continue
                read_at = time.time()
                if tier is None:
                    tier = Tier(
                        settings.tier_options(settings.cold),
                        owner=owner,
                        max_payload=self._max_payload,
                        capacity_bytes=settings.cold.capacity_bytes,
                        read_only=True,
                        seal=self._seal,
                    )
                    with self._lock:
                        self._foreign[name] = tier
                else:
                    tier.refresh()
                self._read_at[name] = (*stamp, read_at)
                self._failing.pop(name, None)
            except ConfigError as exc:  # a link, a FIFO... planted under a tier name
                self._failed(name, str(exc))
            except FileNotFoundError as exc:  # gone meanwhile: forgotten below
                logger.debug("shared cold tier: skipping %s: %s", name, exc)
            except Exception as exc:  # half-made files, an engine it cannot build
                self._failed(name, f"{type(exc).__name__}: {exc}")
        self._forget((set(self._foreign) | set(self._failing)) - listed)
        if self._stop.is_set():  # closed meanwhile: close what we opened
            for tier in self.tiers():
                tier.close()

    def _trusted_host(self, owner: str) -> bool:
        """Whether ``cold.owners`` lets us read the files of ``owner``."""
        hosts = self._settings.cold_owners
        return hosts is None or TierNames.host_of(owner) in hosts

    def _failed(self, name: str, why: str) -> None:
        """Another host's files would not open or read: a miss, warned once
        per name, tried again after a wait that doubles up to RETRY_MAX_S
        (every try may cost descriptors, an engine, a log line)."""
        count = self._failing.get(name, (0, 0.0))[0] + 1
        wait = min(REFRESH_S * 2 ** min(count - 1, 16), RETRY_MAX_S)
        self._failing[name] = (count, time.monotonic() + wait)
        if name in self._refused:
            logger.debug("shared cold tier: still skipping %s: %s", name, why)
            return
        self._refuse(
            name, f"{why} (tried again later, at most every {RETRY_MAX_S:.0f} s)"
        )

    def _forget(self, names: set[str]) -> None:
        """Close and forget the hosts whose header files are gone."""
        for name in names:
            with self._lock:
                tier = self._foreign.pop(name, None)
            self._read_at.pop(name, None)
            self._failing.pop(name, None)
            self._refused.discard(name)
            if tier is not None:
                logger.info("shared cold tier: %s is gone; its files are closed", name)
                tier.close()

    def _refuse(self, name: str, why: str) -> None:
        """Skip another host's files that are not tier files (warned once)."""
        if name not in self._refused:
            self._refused.add(name)
            logger.warning(
                "shared cold tier: ignoring %s: %s", printable(name), printable(why)
            )

    def _unchanged(self, name: str, stamp: Stamp) -> bool:
        """Whether header file ``name`` and its change log are as we last read
        them (only a file we opened has a record), with a write in the same
        timestamp tick as that read ruled out where there is no log."""
        read = self._read_at.get(name)
        return (
            read is not None
            and read[:3] == stamp
            and (stamp[2] is not None or read[3] - stamp[1] / 1e9 > MTIME_SLACK_S)
        )

    def _run(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self.refresh()
            except OSError as exc:
                logger.warning("shared cold tier: cannot list it: %s", exc)
            except Exception:  # a bug: the refresher must outlive it
                logger.exception("shared cold tier: refresh failed")

    def close(self) -> None:
        """Stop the refresher (waiting JOIN_S at most: a hung file system can
        hold it in a read; it closes what it opens after that) and close the
        other hosts' tiers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(JOIN_S)
            if self._thread.is_alive():
                logger.warning("shared cold tier: refresher stuck in I/O; left behind")
        for tier in self.tiers():
            tier.close()
