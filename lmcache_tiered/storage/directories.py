"""A tier's directories, asked about or held before its tier opens.

The multi-process adapter opens its tiers only once it knows their slot size
(at start-up from a superblock, else at the first store), yet must refuse a
second server on the same directories at its start. It asks here for the
recorded slot size and holds each tier's owner lock meanwhile; the tier then
adopts the held lock as it opens, so there is no moment in which another
process could take it. The faces never open a tier's files themselves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from lmcache_tiered.storage.layout import TierNames, read_superblock
from lmcache_tiered.storage.ownership import take_lock
from lmcache_tiered.storage.tierfiles import open_tier_file


def recorded_max_payload(paths: Sequence[str], owner: str) -> int | None:
    """The largest chunk ``owner``'s tier under ``paths`` was formatted for,
    if it was: the slot size to reopen it with, so a restart keeps its data."""
    geometry = read_superblock(TierNames(tuple(paths), owner).header)
    return None if geometry is None else geometry.max_payload


class DirectoryHold:
    """``owner``'s lock file in a tier's directories, locked for this process
    until the tier adopts it (:meth:`adopt`) or it is released; ConfigError
    naming the holder (``setting``: the paths setting to cite) if another
    process holds it."""

    def __init__(
        self, paths: Sequence[str], owner: str, *, setting: str, file_mode: int
    ) -> None:
        self.name = TierNames(tuple(paths), owner).lock
        fd = open_tier_file(self.name, os.O_RDWR | os.O_CREAT, file_mode, setting)
        try:
            take_lock(fd, setting, self.name)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def adopt(self) -> int:
        """Hand the locked descriptor over: from now on its closing is the
        caller's."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise RuntimeError(f"{self.name}: the lock was already handed over")
        return fd

    def release(self) -> None:
        """Close the lock if it is still held here (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
