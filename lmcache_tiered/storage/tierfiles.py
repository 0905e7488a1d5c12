"""One owner's files of a live tier: open, lock, preallocate, read back, close.

:class:`TierFileSet` opens the slabs and the header file named by
:class:`lmcache_tiered.storage.layout.TierNames` (never through a link, never a FIFO,
O_DIRECT if configured), locks them for this process, runs the I/O engine over
them, grows them, and rebuilds what they hold at start-up (:meth:`load`). It
knows the files and the layout, not the index nor the tier's health: I/O
failures come back as results (``-errno``), for the tier to count.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from lmcache_tiered.config import ConfigError, TierOptions
from lmcache_tiered.io import IOEngine, aligned_buffer, make_engine
from lmcache_tiered.io.base import ALIGN, IORequest
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage.files import (
    NotRegularFile,
    UntrustedOwner,
    check_owner_trusted,
    open_regular,
)
from lmcache_tiered.storage.filesystems import exposure_warning, shared_file_systems
from lmcache_tiered.storage.layout import (
    HEADER_SIZE,
    SCAN_BYTES,
    CorruptRecord,
    Extent,
    Geometry,
    RecordHeader,
    TierNames,
    align_up,
    newest,
    scan_headers,
)
from lmcache_tiered.storage.ownership import OwnerLease, take_lock

logger = logging.getLogger("lmcache_tiered")
#: Logged where a tier's directories share a file system (a caller that
#: does so on purpose, with its drives modelled, can filter it by this text).
SHARED_FILE_SYSTEM_WARNING = (
    "tier %s: %s are on one file system: chunks are striped over directories, "
    "not devices, so reads get no faster; list one directory per NVMe device in %s"
)

#: What :meth:`TierFileSet.load` found: the records a tier serves, in recency
#: order, and the slots its files hold; or why the files cannot be read.
Loaded = tuple[list[tuple[int, RecordHeader]], int] | str


class Unreadable(Exception):
    """A header file read failed (the message says which blocks and why)."""


@dataclass(slots=True)
class Transfer:
    """The I/O of one record within a batch, with any bounce buffer it needs."""

    slot: int
    requests: list[IORequest] = field(default_factory=list)
    #: (bounce buffer, payload start, length) to copy after a read
    bounces: list[tuple[memoryview, int, int]] = field(default_factory=list)


def plan_transfer(
    geometry: Geometry,
    slot: int,
    size: int,
    view: memoryview,
    direct: bool,
    reading: bool,
) -> Transfer:
    """Requests for one record: straight into/out of ``view`` when it is
    aligned, through a small bounce buffer for any unaligned part."""
    transfer = Transfer(slot)
    for extent in geometry.extents(slot, size):
        buffer = _extent_buffer(extent, view, direct, transfer, reading)
        transfer.requests.append(IORequest(extent.device, extent.offset, buffer))
    return transfer


def _extent_buffer(
    extent: Extent, view: memoryview, direct: bool, transfer: Transfer, reading: bool
) -> memoryview:
    padded = align_up(extent.length)
    end = extent.start + padded
    if direct and end <= len(view):
        return view[extent.start : end]
    bounce = aligned_buffer(padded)
    if reading:
        transfer.bounces.append((bounce, extent.start, extent.length))
    else:
        bounce[: extent.length] = view[extent.start : extent.start + extent.length]
    return bounce


def _identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino): which file a descriptor is, however it was named."""
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def open_tier_file(name: str, flags: int, mode: int, setting: str) -> int:
    """Open ``name`` as a tier file: a regular file only, never through a
    symbolic link (:func:`~lmcache_tiered.storage.files.open_regular`); a ConfigError
    naming ``setting`` and the fix otherwise."""
    try:
        return open_regular(name, flags, mode)
    except NotRegularFile as exc:
        raise ConfigError(
            f"{setting}: {exc}; tier files are only regular files: remove it"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{setting}: {_why_not_opened(name, exc)}") from None


def _why_not_opened(name: str, exc: OSError) -> str:
    """What is wrong with tier file ``name`` that ``open`` refused, and the fix."""
    if exc.errno == errno.ELOOP:
        return (
            f"{name} is a symbolic link; tier files are never opened through "
            "links: remove it"
        )
    if exc.errno == errno.EISDIR:
        return f"{name} is a directory; tier files are only regular files: remove it"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"cannot open {name}: {exc.strerror}; give the user LMCache runs as "
            "read and write access to it and its directory (chmod, chown, a "
            "writable mount), or remove it"
        )
    return f"cannot open {name}: {exc.strerror}"


class TierFileSet:
    """The slab per device and the header file (the last of :attr:`names`)
    of one owner, with the engine that moves their bytes.

    ``read_only``: another process's files, seen through a shared file
    system: never written, locked or formatted here.
    """

    def __init__(
        self,
        options: TierOptions,
        names: TierNames,
        geometry: Geometry,
        stats: TierStats,
        *,
        read_only: bool,
    ) -> None:
        self.options = options
        self.owner = names.owner
        self.geometry = geometry
        self.stats = stats
        self.read_only = read_only
        self.direct_io = options.direct_io
        #: the slabs, then the header file
        self.names = [*names.slabs, names.header]
        self.header_file = len(self.names) - 1
        self._lock_name = names.lock
        self.fds: list[int] = []
        self._lock_fds: list[int] = []
        #: our claim in the lock file (writable files only)
        self.lease: OwnerLease | None = None
        self.engine: IOEngine
        name = options.name
        for path in options.paths:
            if (why := exposure_warning(path)) is not None:
                logger.warning(
                    "tier %s: %s; another user could plant data in it", name, why
                )
        if not read_only and (shared := shared_file_systems(options.paths)):
            logger.warning(
                SHARED_FILE_SYSTEM_WARNING,
                name,
                " and ".join(shared),
                options.paths_setting,
            )

    # --------------------------------------------------------- open, close

    def open(self, held_lock: Callable[[], int] | None = None) -> None:
        """Lock the files for this process, then open (creating) them and
        start the engine. ``held_lock`` hands over the owner's lock file,
        already locked by this process (a directory hold): it is used as is.

        Locks live on descriptors of their own: an io_uring ring keeps its
        registered files open for a while after it is torn down. Besides the
        owner's lock file, each slab is locked itself, so two processes whose
        first paths differ still cannot share a slab (a directory listed by
        both, under any name).
        """
        kind, depth = self.options.io_engine, self.options.queue_depth
        if self.read_only:
            # another host's files: a later one may be missing (its host has
            # other paths, or is half deleted); never leak the earlier ones
            fds: list[int] = []
            try:
                for name in self.names:
                    fds.append(self._open(name))
                engine = make_engine(kind, fds, depth)
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            self.fds, self._lock_fds, self.engine = fds, [], engine
            return
        lock_fds: list[int] = []
        fds = []
        try:
            if held_lock is not None:
                lock_fds.append(held_lock())
            else:
                lock_fds.append(self._open(self._lock_name, data=False))
                self._take_lock(lock_fds[0], self._lock_name, "is held")
            for name in self.names:
                fds.append(self._open(name))
            self._refuse_shared_files(fds)
            for name, fd in zip(self.names[: self.header_file], fds, strict=False):
                lock_fds.append(self._open(name, data=False))
                if _identity(lock_fds[-1]) != _identity(fd):
                    raise OSError(errno.EAGAIN, f"{name} was replaced while opening")
                self._take_lock(lock_fds[-1], name, "is in use")
            engine = make_engine(kind, fds, depth)
        except BaseException:
            for fd in [*fds, *lock_fds]:
                os.close(fd)
            raise
        self._lock_fds = lock_fds
        self.fds, self.engine = fds, engine
        self.lease = OwnerLease(lock_fds[0], self._lock_name)

    def _take_lock(self, fd: int, name: str, what: str) -> None:
        """flock ``fd`` for this process; ConfigError if another holds it."""
        take_lock(fd, self.options.paths_setting, name, what)

    def _refuse_shared_files(self, fds: Sequence[int]) -> None:
        """ConfigError if two of the names are one file (a hard link): their
        stripe units would overwrite each other."""
        seen: dict[tuple[int, int], str] = {}
        for name, fd in zip(self.names, fds, strict=True):
            if (first := seen.setdefault(_identity(fd), name)) != name:
                raise ConfigError(
                    f"{self.options.paths_setting}: {first} and {name} are the "
                    "same file (a hard link); remove the link"
                )

    def _open(self, name: str, *, data: bool = True) -> int:
        """Open one file: only a regular file, never through a symbolic link
        and without blocking (see :mod:`lmcache_tiered.storage.files`), with the
        configured mode whatever the umask or an earlier run left; O_DIRECT
        for a data file if configured."""
        flags = os.O_RDONLY if self.read_only else os.O_RDWR | os.O_CREAT
        fd = open_tier_file(
            name, flags, self.options.file_mode, self.options.paths_setting
        )
        try:
            if data:
                self._set_direct(fd, name)
                self._check_owner(fd, name)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_owner(self, fd: int, name: str) -> None:
        """Another host's file: owned by a trusted user (ConfigError); ours:
        warned about if another user owns it, else given the configured mode."""
        if self.read_only:
            try:
                return check_owner_trusted(fd, name, self.options.owner_uids)
            except UntrustedOwner as exc:
                raise ConfigError(f"{exc}; {self.options.owner_uids_setting}") from None
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            logger.warning(
                "tier %s: %s is owned by uid %d, not by this process; another user "
                "could plant data in it",
                self.options.name,
                name,
                info.st_uid,
            )
        elif stat.S_IMODE(info.st_mode) != self.options.file_mode:
            os.fchmod(fd, self.options.file_mode)

    def _set_direct(self, fd: int, name: str) -> None:
        """Switch ``fd`` to O_DIRECT if configured; buffered I/O for all the
        files if the file system refuses it."""
        if not self.direct_io:
            return
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            logger.warning(
                "%s: the file system refuses O_DIRECT; tier %s uses buffered "
                "I/O (page cache) instead",
                name,
                self.options.name,
            )
            self.direct_io = False

    def close(self) -> None:
        """Stop the engine and close the files and the locks (idempotent)."""
        if not self.fds:
            return
        fds, self.fds, self._lock_fds = [*self.fds, *self._lock_fds], [], []
        self.lease = None
        try:
            self.engine.close()
        finally:
            failed = []
            for fd in fds:
                try:
                    os.close(fd)
                except OSError as exc:
                    failed.append(f"{fd}: {exc.strerror}")
            if failed:
                # someone else closed a descriptor of ours: a bug to report
                raise OSError(f"closing tier {self.options.name}'s files: {failed}")

    def missing(self) -> str | None:
        """The first of the files that is no longer at its path."""
        if not self.fds:
            return self.names[0]
        for name, fd in zip(self.names, self.fds, strict=True):
            try:
                on_path = os.stat(name, follow_symlinks=False)
                ours = os.fstat(fd)
            except OSError:
                return name
            if (on_path.st_dev, on_path.st_ino) != (ours.st_dev, ours.st_ino):
                return name
        return None

    # ------------------------------------------------------------------ I/O

    def submit(self, requests: Sequence[IORequest], write: bool) -> Future[list[int]]:
        """The engine's future for a batch; one already failed with EIO when
        the engine refuses it (closed, out of resources): I/O never raises."""
        return self.submit_many([requests], write)[0]

    def submit_many(
        self, batches: Sequence[Sequence[IORequest]], write: bool
    ) -> list[Future[list[int]]]:
        """:meth:`submit` for several batches handed to the engine at once."""
        try:
            return self.engine.submit_many(batches, write)
        except Exception as exc:
            logger.debug("tier %s: engine refused a batch: %s", self.options.name, exc)
            failed = []
            for requests in batches:
                future: Future[list[int]] = Future()
                future.set_result([-errno.EIO] * len(requests))
                failed.append(future)
            return failed

    def first_error(
        self, requests: Sequence[IORequest], results: Sequence[int]
    ) -> tuple[str, int] | None:
        """(file name, errno) of the first failed request of a batch, if any."""
        return next(
            (
                (self.names[r.file], -n)
                for r, n in zip(requests, results, strict=True)
                if n < 0
            ),
            None,
        )

    def written(
        self, requests: Sequence[IORequest], writing: Future[list[int]]
    ) -> tuple[list[bool], tuple[str, int] | None]:
        """Wait for a submitted write batch, then fdatasync the files if
        configured: success per request, and the first failure (file, errno).
        A failed fdatasync fails the whole batch: nothing unsynced is
        acknowledged."""
        results = writing.result()
        failure = self.first_error(requests, results)
        written = [n >= len(r.buffer) for r, n in zip(requests, results, strict=True)]
        if self.options.fsync and any(written):
            try:
                for fd in self.fds:
                    os.fdatasync(fd)
            except OSError as exc:
                failure = ("fdatasync of its files", exc.errno or errno.EIO)
                written = [False] * len(written)
        return written, failure

    def preallocate(self, first: int, count: int) -> None:
        """Make room for slots ``first`` to ``first + count - 1`` on every
        device; OSError, with the files as they were, if that fails."""
        per_device = self.geometry.per_device
        slabs, header = self.fds[: self.header_file], self.fds[self.header_file]
        try:
            for fd in slabs:
                os.posix_fallocate(fd, first * per_device, count * per_device)
            os.posix_fallocate(
                header, Geometry.header_offset(first), count * HEADER_SIZE
            )
        except OSError:
            # give back what the failed attempt got: the files then hold
            # exactly the slots the tier counts
            with contextlib.suppress(OSError):
                for fd in slabs:
                    os.ftruncate(fd, first * per_device)
                os.ftruncate(header, Geometry.header_offset(first))
            raise

    def probe_io(self) -> bool:
        """Read the superblock and write it back unchanged, and read the first
        block of every slab: the devices answer again."""
        block = aligned_buffer(HEADER_SIZE)
        superblock = IORequest(self.header_file, 0, block)
        if self.submit([superblock], write=False).result() != [HEADER_SIZE]:
            return False
        if Geometry.decode_superblock(block) != self.geometry:
            return False
        if self.submit([superblock], write=True).result() != [HEADER_SIZE]:
            return False
        slabs = [
            IORequest(i, 0, aligned_buffer(ALIGN))
            for i, fd in enumerate(self.fds[: self.header_file])
            if os.fstat(fd).st_size >= ALIGN
        ]
        return all(n == ALIGN for n in self.submit(slabs, write=False).result())

    # ------------------------------------------------------------ start-up

    def load(self, max_slots: int) -> Loaded:
        """What the files hold (at most ``max_slots``), or a fresh format of
        them; why not, when they cannot be read.

        Files are emptied only when they hold nothing yet, or a superblock
        this package sealed with another layout or format version (settings
        changed). A read error or a damaged superblock returns the reason
        instead and leaves every byte where it is: the tier starts degraded,
        and ``fsck`` can look at the files. Raises OSError when the
        superblock cannot be written: a tier that cannot record its layout
        must not take writes.
        """
        header_fd = self.fds[self.header_file]
        size = os.fstat(header_fd).st_size
        block = aligned_buffer(HEADER_SIZE)
        on_disk, sealed, written_with = None, False, ""
        if size:
            request = IORequest(self.header_file, 0, block)
            (got,) = self.submit([request], write=False).result()
            if got < 0 and not self.read_only:
                return self._unreadable(
                    f"its superblock read failed: {os.strerror(-got)}"
                )
            if got == HEADER_SIZE:
                on_disk = Geometry.decode_superblock(block)
                sealed = Geometry.superblock_sealed(block)
                written_with = Geometry.describe_superblock(block) if sealed else ""
        if on_disk == self.geometry:
            try:
                return self._scan(size, max_slots)
            except Unreadable as exc:
                return self._unreadable(str(exc))
        if self.read_only:
            return [], 0
        if size and not sealed and not self._holds_nothing(size):
            return self._unreadable("its superblock is damaged")
        if sealed:
            logger.warning(
                "tier %s: %s was written with other settings or another release "
                "(%s; now %s): starting the tier empty, its chunks are dropped",
                self.options.name,
                self.names[-1],
                written_with,
                self.geometry,
            )
        for fd in self.fds:
            os.ftruncate(fd, 0)
        block[:] = self.geometry.encode_superblock()
        superblock = [IORequest(self.header_file, 0, block)]
        ok, _ = self.written(superblock, self.submit(superblock, write=True))
        if ok != [True]:
            raise OSError(errno.EIO, f"cannot write the superblock of {self.names[-1]}")
        self._sync_format()
        return [], 0

    def _sync_format(self) -> None:
        """Make a fresh format durable whatever ``fsync`` says, once: else a
        power cut could keep later writes but not the superblock (a tier that
        refuses to start until ``fsck``), or lose a new file's name (POSIX
        records it only with an fsync of its directory)."""
        for fd in self.fds:
            os.fdatasync(fd)
        for path in self.options.paths:
            directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

    def _holds_nothing(self, header_size: int) -> bool:
        """Whether the files hold no record at all (a format cut short), so
        formatting them loses nothing."""
        slabs = self.fds[: self.header_file]
        return header_size <= HEADER_SIZE and not any(
            os.fstat(fd).st_size for fd in slabs
        )

    def _unreadable(self, what: str) -> str:
        """Why the tier does not start on its files, and what to do."""
        return (
            f"{self.names[-1]}: {what}; its files are left as they are: check "
            f"them with `lmcache-tiered fsck {' '.join(self.options.paths)} "
            f"--owner {self.owner}`, or remove them to start the tier empty"
        )

    def _scan(self, size: int, max_slots: int) -> Loaded:
        """Every valid header, the newest per key; Unreadable if a read
        fails (a read-only tier takes a failed read as the file's end).
        Damaged records are dropped with one summary line."""
        header = self.names[self.header_file]
        damage: list[str] = []
        if size % HEADER_SIZE:
            damage.append(
                f"{header} ends inside the header of slot {size // HEADER_SIZE - 1} "
                "(truncated): later records are lost"
            )
        buffer = aligned_buffer(SCAN_BYTES)

        def read(first: int, count: int) -> memoryview:
            view = buffer[: count * HEADER_SIZE]
            request = IORequest(self.header_file, Geometry.header_offset(first), view)
            (got,) = self.submit([request], write=False).result()
            if got < 0 and not self.read_only:
                raise Unreadable(
                    f"reading the headers of slots {first}-{first + count - 1} "
                    f"failed: {os.strerror(-got)}"
                )
            return view[: max(got, 0)]

        slots = min(size // HEADER_SIZE - 1, max_slots)
        blocks, slots = scan_headers(read, slots, self.geometry.max_payload)
        found = [(s, h) for s, h in blocks if not isinstance(h, CorruptRecord)]
        if bad := len(blocks) - len(found):
            damage.append(f"{bad} damaged headers in {header}")
        whole = self.within_slabs(found)
        if cut := len(found) - len(whole):
            damage.append(
                f"{cut} records running past the end of a slab (truncated or "
                f"replaced): {', '.join(self.names[: self.header_file])}"
            )
        self.stats.corrupt += bad + cut + (1 if size % HEADER_SIZE else 0)
        if damage:
            logger.log(
                logging.DEBUG if self.read_only else logging.WARNING,
                "tier %s: dropped at start-up, their slots reused: %s; inspect "
                "them with `lmcache-tiered fsck %s --owner %s`",
                self.options.name,
                "; ".join(damage),
                " ".join(self.options.paths),
                self.owner,
            )
        live, _ = newest(whole, lambda record: record[1])
        logger.log(
            logging.DEBUG if self.read_only else logging.INFO,
            "tier %s: recovered %d chunks from %s",
            self.options.name,
            len(live),
            header,
        )
        return list(live.values()), slots

    def within_slabs(
        self, found: list[tuple[int, RecordHeader]]
    ) -> list[tuple[int, RecordHeader]]:
        """The records whose payload lies inside the slabs (a slab may have
        been truncated, or replaced by an empty one)."""
        sizes = [os.fstat(fd).st_size for fd in self.fds[: self.header_file]]
        return [
            (slot, header)
            for slot, header in found
            if all(
                e.offset + e.length <= sizes[e.device]
                for e in self.geometry.extents(slot, header.payload_size)
            )
        ]
