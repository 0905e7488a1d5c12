"""What the file systems under a tier's directories are: their type, whether
two directories share one, whether another user could write there. The tier
warns from these at start; the benchmarks ask them where memory would pose as
a drive."""

from __future__ import annotations

import contextlib
import os
import stat

#: File systems with no device under them: a "ceiling" there is memory's.
IN_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_type(path: str) -> str:
    """The type of the file system ``path`` is on (``ext4``, ``tmpfs``; ""
    if /proc/mounts cannot say): its longest mount point that holds it."""
    best, kind = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            mount = fields[1]
            holds = path == mount or path.startswith(mount.rstrip("/") + "/")
            if holds and len(mount) > len(best):
                best, kind = mount, fields[2]
    return kind


def shared_file_systems(paths: tuple[str, ...]) -> list[str]:
    """The first two of ``paths`` that lie on one file system (same
    ``st_dev``), if any: striping over them is not striping over devices."""
    seen: dict[int, str] = {}
    for path in paths:
        try:
            device = os.stat(path).st_dev
        except OSError:
            continue
        if (first := seen.setdefault(device, path)) != path:
            return [first, path]
    return []


def exposure_warning(path: str) -> str | None:
    """Why the directory ``path`` (or the one its symbolic link leads to) is
    open to other users, if it is: another user could then plant records
    that this process serves."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    real = os.path.realpath(path)
    name = path if real == path else f"{path} (-> {real})"
    if st.st_uid != os.geteuid():
        return f"{name} is owned by uid {st.st_uid}, not by this process"
    if st.st_mode & stat.S_IWOTH:
        return f"{name} is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    return None
