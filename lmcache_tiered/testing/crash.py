"""Crash states a power cut can leave a tier's files in, built from a
recorded write stream (CrashMonkey, OSDI 2018; ALICE, OSDI 2014).

A kill -9 leaves the page cache and the drive's write cache to finish every
write the process issued; a power cut does not: a drive may persist the
writes since its last flush in any order, or only some of them. So the
harness records every change a tier makes to its files, in issue order
(:class:`Recorder`: writes through its I/O engine, ``ftruncate``,
``posix_fallocate``, and the ``fdatasync``/``fsync`` that flush them), and
:func:`crash_states` rebuilds, for every point of that stream, the files a
power cut there could leave: everything flushed, plus any subset, in any
order, of the writes not flushed yet (some torn into 512-byte sectors).
:mod:`lmcache_tiered.testing.crash_check` opens a tier on each and checks
what it serves.

Model: a flush of a file makes every earlier change to that file durable; a
file exists from its first recorded change (its directory entry is taken as
durable, which ext4's journal gives with the first fdatasync: see the
durability section of docs/design.md for the gap POSIX leaves there).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import random
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from unittest import mock

from lmcache_tiered import io
from lmcache_tiered.io.base import EngineWrapper, IOEngine, IORequest
from lmcache_tiered.storage import tierfiles

OpKind = Literal["write", "truncate", "extend", "flush"]
#: a crash state's files: path relative to the root -> content
Image = dict[str, bytearray]
#: What a drive writes whole or not at all: a 4 KiB request may be torn into
#: these (512-byte logical blocks; AWUPF guarantees no more).
SECTOR = 512
#: Share of the writes kept in a random crash state that are kept torn.
TORN_SHARE = 0.15


@dataclass(frozen=True, slots=True)
class Op:
    """One change to a file (or a flush of it), as issued.

    ``write``: ``data`` at ``offset``; ``truncate``: size becomes ``offset``;
    ``extend`` (fallocate): size at least ``offset``; ``flush``: everything
    issued before to ``path`` is durable.
    """

    kind: OpKind
    path: str
    offset: int = 0
    data: bytes = b""

    def apply(self, image: Image, sectors: int = -1) -> None:
        """This change made to ``image`` (a flush changes nothing); of a
        write, only the :data:`SECTOR`-byte sectors set in the mask
        ``sectors`` (a write torn by the power cut)."""
        if self.kind == "flush":
            return
        content = image.setdefault(self.path, bytearray())
        if self.kind == "truncate":
            del content[self.offset :]
            content.extend(bytes(self.offset - len(content)))
        elif self.kind == "extend":
            content.extend(bytes(max(0, self.offset - len(content))))
        else:
            end = self.offset + len(self.data)
            content.extend(bytes(max(0, end - len(content))))
            for start in range(0, len(self.data), SECTOR):
                if sectors >> (start // SECTOR) & 1:
                    piece = self.data[start : start + SECTOR]
                    at = self.offset + start
                    content[at : at + len(piece)] = piece

    def overlaps(self, other: Op) -> bool:
        """Whether applying the two in either order can differ."""
        if self.path != other.path:
            return False
        if self.kind != "write" or other.kind != "write":
            return True
        return self.offset < other.offset + len(
            other.data
        ) and other.offset < self.offset + len(self.data)


class Recorder:
    """The stream of changes made to the files under ``root``, in issue
    order; :meth:`recording` installs it. ``mark`` notes the workload's own
    events (acknowledgements, evictions) at their place in the stream."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.ops: list[Op] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.ops)

    def _path(self, fd: int) -> str | None:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        if not name.startswith(self.root + os.sep):
            return None
        return os.path.relpath(name, self.root)

    def note(self, fd: int, kind: OpKind, offset: int = 0, data: bytes = b"") -> None:
        """Record a change to ``fd``'s file, if it lies under the root."""
        if (path := self._path(fd)) is not None:
            with self._lock:
                self.ops.append(Op(kind, path, offset, data))

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorder]:
        """Record while inside: every engine a tier's files make is wrapped
        by :class:`RecordingEngine`, and the ``os`` calls that change or flush
        a file are seen on their way (they bypass the engine)."""
        truncate, fallocate = os.ftruncate, os.posix_fallocate

        def make_engine(kind: str, fds: Sequence[int], depth: int) -> IOEngine:
            # the function tierfiles imported: its own name is patched here
            return RecordingEngine(io.make_engine(kind, fds, depth), self)

        def ftruncate(fd: int, length: int) -> None:
            truncate(fd, length)
            self.note(fd, "truncate", length)

        def posix_fallocate(fd: int, offset: int, length: int) -> None:
            fallocate(fd, offset, length)
            self.note(fd, "extend", offset + length)

        def flusher(call: Callable[[int], None]) -> Callable[[int], None]:
            def flush(fd: int) -> None:
                call(fd)
                self.note(fd, "flush")

            return flush

        with contextlib.ExitStack() as patches:
            for target, name, value in (
                (tierfiles, "make_engine", make_engine),
                (os, "ftruncate", ftruncate),
                (os, "posix_fallocate", posix_fallocate),
                (os, "fdatasync", flusher(os.fdatasync)),
                (os, "fsync", flusher(os.fsync)),
            ):
                patches.enter_context(mock.patch.object(target, name, value))
            yield self


class RecordingEngine(EngineWrapper):
    """Every write request's bytes go to the recorder, in submission order,
    before the inner engine starts them."""

    def __init__(self, inner: IOEngine, recorder: Recorder) -> None:
        super().__init__(inner)
        self.recorder = recorder

    def submit_many(
        self, batches: Sequence[Sequence[IORequest]], write: bool
    ) -> list[Future[list[int]]]:
        if write:
            for requests in batches:
                for r in requests:
                    self.recorder.note(
                        self.fds[r.file], "write", r.offset, bytes(r.buffer)
                    )
        return self.inner.submit_many(batches, write)


def snapshot(root: Path) -> Image:
    """The files under ``root`` now: the image a recorded stream starts from."""
    image: Image = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                image[os.path.relpath(path, root)] = bytearray(f.read())
    return image


def materialize(image: Image, root: Path, dirs: Sequence[str]) -> None:
    """Make ``root`` hold exactly ``image`` (and the directories ``dirs``)."""
    if root.exists():
        shutil.rmtree(root)
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    for path, content in image.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


def image_digest(image: Image) -> bytes:
    """Identifies an image's content: equal states are checked once."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(image):
        h.update(path.encode() + b"\0" + len(image[path]).to_bytes(8, "little"))
        h.update(image[path])
    return h.digest()


@dataclass(frozen=True, slots=True)
class CrashState:
    """The files a power cut at ``point`` (ops before it issued) could leave:
    the durable ones, plus ``kept`` (indexes of unflushed ops, in the order
    the drive persisted them). ``how`` names the kind of choice."""

    point: int
    kept: tuple[int, ...]
    how: str
    image: Image
    #: (op index, mask of the sectors of it that reached the disk)
    torn: tuple[tuple[int, int], ...] = ()


def _pending_at(
    ops: Sequence[Op], base: Image
) -> Iterator[tuple[int, Image, list[int]]]:
    """For each point 0..len(ops): the durable image there and the unflushed
    ops (indexes, issue order). The image is shared: copy it to change it."""
    durable = {p: bytearray(c) for p, c in base.items()}
    pending: dict[str, list[int]] = {}
    for point in range(len(ops) + 1):
        yield point, durable, sorted(i for v in pending.values() for i in v)
        if point == len(ops):
            return
        op = ops[point]
        if op.kind == "flush":
            for i in pending.pop(op.path, []):
                ops[i].apply(durable)
        else:
            pending.setdefault(op.path, []).append(point)
            durable.setdefault(op.path, bytearray())


def _build(
    ops: Sequence[Op],
    durable: Image,
    kept: Sequence[int],
    torn: Sequence[tuple[int, int]] = (),
) -> Image:
    image = {p: bytearray(c) for p, c in durable.items()}
    masks = dict(torn)
    for i in kept:
        ops[i].apply(image, masks.get(i, -1))
    return image


def _orders(ops: Sequence[Op], subset: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``subset`` in issue order, and, where some of its ops overlap (their
    order matters), every other order of those (at most 4 of them)."""
    clash = [
        i for i in subset if any(ops[i].overlaps(ops[j]) for j in subset if j != i)
    ]
    if len(clash) < 2 or len(clash) > 4:
        return [subset]
    rest = [i for i in subset if i not in clash]
    return [tuple(rest) + perm for perm in itertools.permutations(clash)]


def crash_states(
    ops: Sequence[Op],
    base: Image,
    budget: int,
    seed: int,
    exhaustive: int = 4,
    context: Callable[[int], bytes] = lambda point: point.to_bytes(8, "little"),
) -> Iterator[CrashState]:
    """Up to ``budget`` distinct crash states of the stream ``ops`` over
    ``base``, most telling first.

    First, in three quarters of the budget at most: every prefix (a kill -9
    at each write boundary) and, at each point, only what was flushed; then,
    where at most ``exhaustive`` writes are unflushed, every subset of them
    in every order that matters. Then, seeded, random subsets of the
    unflushed writes in random orders, some of them torn into
    :data:`SECTOR`-byte pieces, at random points. Equal images with equal
    ``context(point)`` (by default: at one point) are yielded once; a caller
    whose checks differ less between points says so there.
    """
    rng = random.Random(seed)
    seen: set[bytes] = set()
    count = 0

    def fresh(state: CrashState, limit: int = budget) -> bool:
        nonlocal count
        digest = image_digest(state.image) + context(state.point)
        if digest in seen or count >= limit:
            return False
        seen.add(digest)
        count += 1
        return True

    # a quarter of the budget is kept for the random states; a small budget
    # looks at evenly spread points, not at the start of the stream only
    systematic = budget - budget // 4
    every = max(1, -(-3 * (len(ops) + 1) // max(systematic, 1)))
    busy: list[tuple[int, list[int]]] = []
    for point, durable, pending in _pending_at(ops, base):
        if len(pending) > 1:
            busy.append((point, pending))
        if point % every:
            continue
        for kept, how in ((tuple(pending), "prefix"), ((), "flushed only")):
            state = CrashState(point, kept, how, _build(ops, durable, kept))
            if fresh(state, systematic):
                yield state
    small = _subsets(ops, base, exhaustive, every)
    for state in small:
        if count >= systematic:
            break
        if fresh(state, systematic):
            yield state
    misses = 0
    while busy and count < budget and misses < 20 * budget:
        point, pending = busy[rng.randrange(len(busy))]
        share = rng.random()
        chosen = [i for i in pending if rng.random() < share]
        rng.shuffle(chosen)
        torn = tuple(
            (i, rng.randrange(1, (1 << sectors) - 1))
            for i in chosen
            if (sectors := -(-len(ops[i].data) // SECTOR)) > 1
            and rng.random() < TORN_SHARE
        )
        how = "random subset, torn writes" if torn else "random subset"
        state = state_at(ops, base, point, tuple(chosen), how, torn)
        if fresh(state):
            yield state
        else:
            misses += 1


def _subsets(
    ops: Sequence[Op], base: Image, limit: int, every: int
) -> Iterator[CrashState]:
    """Every subset, in every order that matters, of the unflushed ops at
    each ``every``-th point where there are 2 to ``limit`` of them."""
    for point, durable, pending in _pending_at(ops, base):
        if point % every or not 2 <= len(pending) <= limit:
            continue
        for size in range(1, len(pending)):
            for subset in itertools.combinations(pending, size):
                for kept in _orders(ops, subset):
                    yield CrashState(point, kept, "subset", _build(ops, durable, kept))
        for kept in _orders(ops, tuple(pending))[1:]:
            yield CrashState(point, kept, "reordered", _build(ops, durable, kept))


def state_at(
    ops: Sequence[Op],
    base: Image,
    point: int,
    kept: tuple[int, ...],
    how: str,
    torn: tuple[tuple[int, int], ...] = (),
) -> CrashState:
    """One crash state built from scratch: what was flushed before ``point``,
    then ``kept``."""
    durable = {p: bytearray(c) for p, c in base.items()}
    flushed_upto: dict[str, int] = {}
    for i in range(point):
        if ops[i].kind == "flush":
            flushed_upto[ops[i].path] = i
    for i in range(point):
        op = ops[i]
        if op.kind == "flush":
            continue
        durable.setdefault(op.path, bytearray())
        if i < flushed_upto.get(op.path, -1):
            op.apply(durable)
    return CrashState(point, kept, how, _build(ops, durable, kept, torn), torn)
