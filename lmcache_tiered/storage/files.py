"""Opening and printing what another process or host may have planted.

A tier's directories can be shared (a group-shared cold tier, a world-writable
scratch directory): any name in them may be a symbolic link, a FIFO or a
device instead of a data file. ``open()`` of a FIFO blocks until a writer
comes, forever if none does, so every tier file is opened without following
links and without blocking, and kept only if it is a regular file. Text read
from such files (model names in keys, owner names from file names) is escaped
before it reaches a terminal or a log.
"""

from __future__ import annotations

import fcntl
import os
import stat


class NotRegularFile(OSError):
    """A name that should be a data file is something else (FIFO, device...)."""


class UntrustedOwner(OSError):
    """Another host's file is owned by a user this host does not trust."""


def check_owner_trusted(fd: int, name: str, uids: frozenset[int] | None) -> None:
    """UntrustedOwner unless the file ``fd`` (``name``) is owned by one of
    ``uids`` (None: any user): in a directory a group shares, another member
    can plant files under a host's names."""
    uid = os.fstat(fd).st_uid
    if uids is not None and uid not in uids:
        trusted = ", ".join(str(u) for u in sorted(uids))
        raise UntrustedOwner(
            f"{name} is owned by uid {uid}, not by a trusted user ({trusted})"
        )


def file_kind(mode: int) -> str:
    """What ``st_mode`` says a file is, in words."""
    kinds = (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    )
    return next((name for test, name in kinds if test(mode)), "special file")


def open_regular(name: str, flags: int, mode: int = 0o600) -> int:
    """A descriptor for the regular file ``name``, in blocking mode.

    Opened with O_NOFOLLOW (OSError ELOOP for a link) and O_NONBLOCK, so a
    FIFO cannot stall the open; anything but a regular file is closed again
    and raises :class:`NotRegularFile`.
    """
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            raise NotRegularFile(f"{name} is a {file_kind(kind)}, not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_lock(fd: int) -> bool:
    """Take the exclusive ``flock`` of ``fd`` without waiting (how a live
    tier owns its files); False if another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_holder(fd: int) -> int | None:
    """The process holding the ``flock`` of ``fd``'s file, from /proc/locks
    (None where it cannot be told): named in a refusal, so the operator knows
    which server to stop."""
    info = os.fstat(fd)
    file_id = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if "FLOCK" in fields and "->" not in fields and file_id in fields:
                    return int(fields[fields.index(file_id) - 1])
    except (OSError, ValueError):
        pass
    return None


def printable(text: str) -> str:
    """``text`` safe to print: backslashes and unprintable characters (escape
    sequences, bidi controls) as Python escapes; :func:`unprintable` undoes it."""
    return "".join(
        ch if ch.isprintable() and ch != "\\" else ch.encode("unicode_escape").decode()
        for ch in text
    )


def unprintable(text: str) -> str:
    """The text :func:`printable` was given (ValueError on a bad escape)."""
    try:
        return text.encode("ascii", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise ValueError(f"bad escape in {text!r}: {exc.reason}") from None
