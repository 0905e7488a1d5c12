"""Raw read ceiling of a tier's devices: fio, or the package's own loop.

Benchmarks quote the tier's bandwidth against what the disks can deliver at
all. fio is the reference where it is installed; where it is not,
:func:`raw_read_gbps` measures the same access (chunk-sized O_DIRECT reads,
a deep queue, files read side by side) through this package's engines.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

from lmcache_tiered.io import ALIGN, IOEngine, IORequest, aligned_buffer, make_engine

logger = logging.getLogger("lmcache_tiered")


#: Name of the test file created inside a directory given as a path.
TEST_FILE_NAME = "lmcache-tiered-rawio.bin"
#: fio's queue depth, the one quoted in DESIGN.md.
FIO_IODEPTH = 32
#: cgroup v1's per-device read bandwidth limits ("major:minor bytes/s" lines)
THROTTLE_FILE = "blkio.throttle.read_bps_device"


def prepare_files(
    paths: Sequence[str], chunk_bytes: int, total_bytes: int
) -> list[str]:
    """One test file per path, together holding ``total_bytes`` in whole chunks.

    A directory gets a file named :data:`TEST_FILE_NAME`; any other path is
    the file itself. A file already big enough is reused as is (writing 1 GiB
    costs more than reading it); a shorter one is rewritten with O_DIRECT so
    no page-cache copy of it lingers to flatter the reads.
    """
    if not paths:
        raise ValueError("need at least one path")
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}")
    chunks = math.ceil(math.ceil(total_bytes / chunk_bytes) / len(paths))
    file_bytes = chunks * chunk_bytes
    files = [
        os.path.join(path, TEST_FILE_NAME) if os.path.isdir(path) else path
        for path in paths
    ]
    for name in files:
        if os.path.exists(name) and os.path.getsize(name) >= file_bytes:
            continue
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            with make_engine("auto", [fd], 8) as engine:
                source = aligned_buffer(chunk_bytes)
                source[:] = os.urandom(chunk_bytes)
                writes = (
                    IORequest(0, index * chunk_bytes, source) for index in range(chunks)
                )
                _transfer(engine, writes, chunk_bytes, True, 8)
        finally:
            os.close(fd)
    return files


def raw_read_gbps(
    paths: list[str],
    chunk_bytes: int,
    total_bytes: int,
    queue_depth: int = 32,
    engine: str = "uring",
    fixed_buffers: bool = True,
) -> float:
    """Read ``total_bytes`` (whole chunks) with O_DIRECT; GB/s (1e9 bytes/s).

    Chunk ``k`` comes from file ``k % len(paths)`` at ``(k // len) * chunk``:
    every file is read sequentially, all of them at once, like a striped
    tier. ``queue_depth`` reads stay in flight, landing in ``queue_depth``
    reused buffers (registered with the ring when ``fixed_buffers``).
    Only the reads are timed, not the creation of the files.
    """
    files = prepare_files(paths, chunk_bytes, total_bytes)
    chunks = math.ceil(total_bytes / chunk_bytes)
    fds = [os.open(name, os.O_RDONLY | os.O_DIRECT) for name in files]
    try:
        with make_engine(engine, fds, queue_depth) as io:
            pool = aligned_buffer(queue_depth * chunk_bytes)
            if fixed_buffers:
                io.register_buffers([pool])
            buffers = [
                pool[slot * chunk_bytes : (slot + 1) * chunk_bytes]
                for slot in range(queue_depth)
            ]
            reads = (
                IORequest(
                    index % len(fds),
                    (index // len(fds)) * chunk_bytes,
                    buffers[index % queue_depth],
                )
                for index in range(chunks)
            )
            start = time.perf_counter()
            _transfer(io, reads, chunk_bytes, False, queue_depth)
            elapsed = time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
    return chunks * chunk_bytes / elapsed / 1e9


def _transfer(
    engine: IOEngine,
    requests: Iterator[IORequest],
    chunk_bytes: int,
    write: bool,
    window: int,
) -> None:
    """Run ``requests`` in batches of ``window``, two batches outstanding.

    The second batch waits in the engine while the first is in flight, so
    the queue never drains between batches. Raises on any failed or short
    transfer: a ceiling measured over errors would be meaningless.
    """
    outstanding: deque[tuple[list[IORequest], Future[list[int]]]] = deque()
    while batch := list(itertools.islice(requests, window)):
        outstanding.append((batch, engine.submit(batch, write)))
        if len(outstanding) > 1:
            _check(*outstanding.popleft(), chunk_bytes, write)
    while outstanding:
        _check(*outstanding.popleft(), chunk_bytes, write)


def _check(
    batch: list[IORequest],
    future: Future[list[int]],
    chunk_bytes: int,
    write: bool,
) -> None:
    for request, result in zip(batch, future.result(), strict=True):
        if result != chunk_bytes:
            what = os.strerror(-result) if result < 0 else f"{result} bytes"
            raise RuntimeError(
                f"{'write' if write else 'read'} of file {request.file} "
                f"at {request.offset} failed: {what}"
            )


def fio_read_gbps(paths: list[str], chunk_bytes: int, total_bytes: int) -> float | None:
    """fio's read GB/s over the same files (io_uring, O_DIRECT, depth 32).

    None when fio is not installed; raises when it is and fails.
    """
    fio = shutil.which("fio")
    if fio is None:
        return None
    files = prepare_files(paths, chunk_bytes, total_bytes)
    command = [
        fio,
        "--name=rawio",
        "--ioengine=io_uring",
        "--direct=1",
        f"--iodepth={FIO_IODEPTH}",
        "--rw=read",
        f"--bs={chunk_bytes}",
        f"--io_size={math.ceil(total_bytes / chunk_bytes) * chunk_bytes}",
        "--readonly",
        "--output-format=json",
        "--filename=" + ":".join(name.replace(":", "\\:") for name in files),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr[-500:]}")
    # fio may print notes before the JSON document.
    report = json.loads(done.stdout[done.stdout.index("{") :])
    return float(report["jobs"][0]["read"]["bw_bytes"]) / 1e9


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False (logged) if refused."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        logger.warning("cannot drop the page cache (%s); reads may be warm", exc)
        return False
    return True


def reads_capped(
    proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"
) -> bool:
    """Whether this process's reads run under a bandwidth cap: a cgroup v1
    ``blkio`` read throttle or a v2 ``io.max`` ``rbps`` limit, as a capped
    rig sets them. Goals set for capped drives are judged only then, goals at
    RAM speed only without."""
    try:
        with open(proc_cgroup) as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return False
    for _, controllers, path in memberships:
        group = path.lstrip("/")
        if "blkio" in controllers.split(","):
            limits = _text(os.path.join(cgroup_root, "blkio", group, THROTTLE_FILE))
            if limits.strip():
                return True
        elif not controllers:  # the v2 hierarchy, alone or beside v1
            for base in (cgroup_root, os.path.join(cgroup_root, "unified")):
                limits = _text(os.path.join(base, group, "io.max"))
                if any(
                    f.startswith("rbps=") and f != "rbps=max" for f in limits.split()
                ):
                    return True
    return False


def _text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
