"""A recorded tier workload, and the check of every crash state of it.

:func:`record_workload` runs stores (with the demotions a full warm tier makes
to cold, as :meth:`lmcache_tiered.cache.tiered_cache.TieredCache.store`
does), removals, chunks stored again with new bytes, evictions and a restart
on a tiny warm tier (two directories) and a cold tier shared with another
host (each host's files in one directory), under
:class:`lmcache_tiered.testing.crash.Recorder`, and notes when each chunk was
written, acknowledged and evicted. :func:`explore` opens real tiers on every
crash state :func:`lmcache_tiered.testing.crash.crash_states` builds and checks:
the tier opens (or refuses with a message naming ``fsck``), every chunk it
serves is exactly some version written for its key, and with ``fsync`` every
chunk acknowledged before the crash point (and not evicted or removed since)
is served, in its last acknowledged version. Each host's cold files are also
opened read-only, as the other host sharing them reads them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered.config import ConfigError, TierOptions
from lmcache_tiered.io import aligned_buffer
from lmcache_tiered.keys import StoreKey
from lmcache_tiered.storage.layout import align_up
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.testing.crash import (
    CrashState,
    Image,
    Op,
    Recorder,
    crash_states,
    materialize,
    snapshot,
)

#: largest chunk: two 4 KiB stripe units, one per warm directory
MAX_PAYLOAD = 8192
#: a partial chunk's size: unaligned, so its tail goes through a bounce buffer
PARTIAL = 5000
SLOT_DISK = MAX_PAYLOAD + 4096
TIERS: dict[str, tuple[tuple[str, ...], int, str]] = {
    # name: directories, slots, owner (the cold tier's carries a host id)
    "warm": (("warm0", "warm1"), 4, "kv-w0"),
    "cold": (("cold0",), 6, "kv-w0-hosta"),
    # another host's cold files in the same shared directory
    "cold-b": (("cold0",), 6, "kv-w0-hostb"),
}
DIRS = sorted({d for dirs, _, _ in TIERS.values() for d in dirs})
EventKind = Literal["written", "ack", "gone"]


def chunk_key(i: int) -> StoreKey:
    return CacheEngineKey("crash-model", 1, 0, i, torch.bfloat16, None)


def chunk_bytes(i: int, version: int) -> bytes:
    """The bytes of version ``version`` of chunk ``i``, the same every run."""
    size = PARTIAL if i % 3 == 0 else MAX_PAYLOAD
    return random.Random(i * 7919 + version).randbytes(size)


def payload(i: int, version: int) -> Payload:
    data = chunk_bytes(i, version)
    view = aligned_buffer(align_up(len(data)))[: len(data)]
    view[:] = data
    shape = torch.Size([len(data)])
    return Payload(chunk_key(i), shape, torch.uint8, MemoryFormat.KV_2LTD, view, True)


def tier_options(root: Path, name: str, *, verify: bool, fsync: bool) -> TierOptions:
    return TierOptions(
        name=name,
        paths=tuple(str(root / d) for d in TIERS[name][0]),
        stripe_bytes=4096,
        io_engine="threads",
        queue_depth=16,
        direct_io=True,
        verify_reads=verify,
        fsync=fsync,
        file_mode=0o600,
        paths_setting=f"tiered.{name}.paths",
        capacity_setting=f"tiered.{name}.capacity_gb",
        slot_setting="tiered.slot_mb",
    )


def open_tier(
    root: Path, name: str, *, verify: bool, fsync: bool, read_only: bool = False
) -> Tier:
    """A real tier on the files of tier ``name`` under ``root``."""
    _, slots, owner = TIERS[name]
    return Tier(
        tier_options(root, name, verify=verify, fsync=fsync),
        owner=owner,
        max_payload=MAX_PAYLOAD,
        capacity_bytes=slots * SLOT_DISK,
        read_only=read_only,
    )


@dataclass(frozen=True, slots=True)
class Event:
    """``key`` (version ``version``) was written to / acknowledged by / evicted
    or removed from ``tier`` when ``point`` ops had been issued."""

    point: int
    tier: str
    kind: EventKind
    key: int
    version: int


@dataclass
class History:
    """What the workload did, placed in the recorded stream."""

    ops_base: Image
    ops: list[Op] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    fsync: bool = False

    def allowed(self, tier: str, key: int, point: int) -> set[int]:
        """Versions of ``key`` written to ``tier`` before ``point``."""
        return {
            e.version
            for e in self.events
            if e.tier == tier and e.key == key and e.kind == "written"
            if e.point < point
        }

    def keys(self, tier: str) -> list[int]:
        return sorted({e.key for e in self.events if e.tier == tier})

    def context(self, point: int) -> bytes:
        """What the checks of a state at ``point`` depend on besides its
        files: the chunks it must serve (none without fsync). The versions
        it may serve only grow with the point: an image is checked once, at
        the point it first came up (the earliest, but in the random phase)."""
        if not self.fsync:
            return b""
        return repr([sorted(self.required(t, point).items()) for t in TIERS]).encode()

    def required(self, tier: str, point: int) -> dict[int, int]:
        """Chunks that must be served after a power cut at ``point`` (with
        fsync): acknowledged, not evicted or removed since; their version."""
        last: dict[int, Event] = {}
        for e in self.events:
            if e.tier == tier and e.kind != "written" and e.point <= point:
                last[e.key] = e
        return {k: e.version for k, e in last.items() if e.kind == "ack"}


@dataclass
class Workload:
    """Runs the recorded workload; see :func:`record_workload`."""

    root: Path
    recorder: Recorder
    history: History
    fsync: bool
    tiers: dict[str, Tier] = field(default_factory=dict)
    #: the version each chunk's next write carries
    version: dict[int, int] = field(default_factory=dict)

    def note(self, tier: str, kind: EventKind, key: int, version: int) -> None:
        self.history.events.append(Event(len(self.recorder), tier, kind, key, version))

    def open(self) -> None:
        for name in TIERS:
            tier = open_tier(self.root, name, verify=True, fsync=self.fsync)
            tier.on_evict = self._evicted(name)
            self.tiers[name] = tier

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()

    def _evicted(self, name: str) -> Callable[[list[StoreKey]], None]:
        def evicted(keys: list[StoreKey]) -> None:
            for key in keys:
                assert isinstance(key, CacheEngineKey)
                self.note(name, "gone", key.chunk_hash, -1)

        return evicted

    def write(
        self,
        name: str,
        items: Sequence[tuple[int, int]],
        evict_only: list[StoreKey] | None = None,
    ) -> list[bool]:
        """``write_payloads`` of (chunk, version) pairs, noted."""
        for i, v in items:
            self.note(name, "written", i, v)
        payloads = [payload(i, v) for i, v in items]
        done = self.tiers[name].write_payloads(payloads, evict_only)
        for (i, v), ok in zip(items, done, strict=True):
            if ok:
                self.note(name, "ack", i, v)
        return done

    def store(self, chunks: Sequence[int]) -> None:
        """A store as TieredCache does it: warm's next victims copied to cold
        first, then the chunks to warm, what warm refused to cold."""
        warm = self.tiers["warm"]
        items = [(i, self.version.setdefault(i, 0)) for i in chunks]
        cold = self.tiers["cold"]
        victims = warm.victims(len(items))
        missing = [k for k in victims if cold.header(k) is None]
        copies = [
            (k, p)
            for k, p in zip(missing, warm.read_payloads(missing), strict=True)
            if p
        ]
        moved = [(self._id(k), self._version_of(k, p)) for k, p in copies]
        if moved:
            self.write("cold", moved)
        evictable = [k for k in victims if cold.header(k) is not None]
        stored = self.write("warm", items, evict_only=evictable)
        below = [item for item, ok in zip(items, stored, strict=True) if not ok]
        if below:
            self.write("cold", below)
        # host B stores the same prefixes into its own files beside ours
        # (those it does not hold: see ``reput_stored``)
        host_b = self.tiers["cold-b"]
        self.write(
            "cold-b", [it for it in items if host_b.header(chunk_key(it[0])) is None]
        )

    def remove(self, i: int) -> None:
        """Forget chunk ``i`` everywhere; its next store carries new bytes."""
        for name, tier in self.tiers.items():
            if tier.remove(chunk_key(i)):
                self.note(name, "gone", i, -1)
        self.version[i] = self.version.get(i, 0) + 1

    @staticmethod
    def _id(key: StoreKey) -> int:
        assert isinstance(key, CacheEngineKey)
        return key.chunk_hash

    def _version_of(self, key: StoreKey, copy: Payload) -> int:
        i = self._id(key)
        data = bytes(copy.view)
        found = [v for v in range(self.version[i] + 1) if chunk_bytes(i, v) == data]
        assert found, f"warm served chunk {i} with bytes of no version"
        return found[-1]


def record_workload(
    root: Path, *, fsync: bool, seed: int, steps: int = 16, reput_stored: bool = False
) -> History:
    """Record a seeded workload on empty tiers under ``root``: its history.

    Chunks stored again are ones warm no longer holds (evicted, removed),
    unless ``reput_stored``: a batch that stores a chunk warm holds and
    evicts it for the batch's other chunks acknowledges it all the same
    (see tests/test_crash_states.py)."""
    for d in DIRS:
        (root / d).mkdir(parents=True, exist_ok=True)
    recorder = Recorder(root)
    history = History(snapshot(root), fsync=fsync)
    work = Workload(root, recorder, history, fsync)
    rng = random.Random(seed)
    fresh = 0
    with recorder.recording():
        work.open()
        try:
            for step in range(steps):
                if step == steps // 2:
                    work.close()
                    work.open()
                elif step % 5 == 4 and work.version:
                    work.remove(rng.choice(sorted(work.version)))
                else:
                    count = rng.randint(1, 3)
                    again = [
                        i
                        for i in sorted(work.version)
                        if rng.random() < 0.2
                        and (
                            reput_stored or chunk_key(i) not in work.tiers["warm"].index
                        )
                    ]
                    chunks = again[:1] + list(range(fresh, fresh + count))
                    fresh += count
                    work.store(chunks)
        finally:
            work.close()
    history.ops = recorder.ops
    return history


@dataclass
class Findings:
    """What the explorer saw, summed over the states it checked."""

    states: int = 0
    #: states in which some write was torn
    torn: int = 0
    opened: int = 0
    refused: int = 0
    served: int = 0
    missed: int = 0
    wrong: int = 0
    lost: int = 0
    stale: int = 0
    crashes: int = 0
    seconds: float = 0.0
    #: the first problems found, each with the state that showed it
    problems: list[str] = field(default_factory=list)
    #: why tiers refused to open (paths left out), and how often
    refusals: dict[str, int] = field(default_factory=dict)

    def problem(self, state: CrashState, what: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(
                f"{what} [point {state.point}, {state.how}, "
                f"kept {list(state.kept)[:12]}]"
            )

    @property
    def clean(self) -> bool:
        return not (self.wrong or self.lost or self.stale or self.crashes)

    def line(self) -> str:
        return (
            f"{self.states} crash states ({self.torn} with torn writes) in "
            f"{self.seconds:.1f} s: opened "
            f"{self.opened}, refused {self.refused}, chunks served {self.served}, "
            f"missed {self.missed}, wrong {self.wrong}, lost {self.lost}, stale "
            f"{self.stale}, crashes {self.crashes}"
        )


def check_state(
    history: History,
    state: CrashState,
    scratch: Path,
    findings: Findings,
    *,
    verify: bool = True,
    re_put: bool = False,
) -> None:
    """Open tiers on ``state`` (written under ``scratch``) and check what they
    serve; ``re_put`` first stores again every chunk the warm tier recovered
    and checks that each acknowledged one is served after another restart."""
    materialize(state.image, scratch, DIRS)
    findings.states += 1
    findings.torn += bool(state.torn)
    # first each host's cold files as the other host reads them (read-only,
    # as SharedCold does: while their owner is still down), then each owner's
    # own restart (which may format files that hold nothing yet)
    views = [("cold", True), ("cold-b", True)] + [(name, False) for name in TIERS]
    for name, read_only in views:
        required = history.required(name, state.point) if history.fsync else {}
        if re_put and name == "warm":
            required = _re_put(history, state, scratch, required, verify, findings)
        if read_only and _header_name(name) not in state.image:
            if required:  # its owner has not even created it: nothing to read
                _refused(state, findings, name, "no header file", required)
            continue
        try:
            tier = open_tier(
                scratch, name, verify=verify, fsync=history.fsync, read_only=read_only
            )
        except (ConfigError, OSError, ValueError) as exc:
            if not read_only:  # its owner must always start
                findings.crashes += 1
                findings.problem(state, f"{name} raised {exc!r}")
            else:  # SharedCold skips such files until its next look
                _refused(state, findings, name, f"skipped: {exc}", required)
            continue
        except Exception as exc:  # a crash: what the check is for
            findings.crashes += 1
            findings.problem(state, f"{name} raised {exc!r}")
            continue
        try:
            _check_tier(history, state, tier, name, required, verify, findings)
        finally:
            tier.close()


def _header_name(name: str) -> str:
    dirs, _, owner = TIERS[name]
    return f"{dirs[0]}/{owner}.hdr"


def _refused(
    state: CrashState,
    findings: Findings,
    name: str,
    why: str,
    required: dict[int, int],
) -> None:
    """A tier that did not open: counted with its reason (paths left out),
    and every chunk it had to serve counted lost."""
    findings.refused += 1
    reason = why.split(": ", 1)[-1].split(";")[0].split(" /")[0]
    findings.refusals[reason] = findings.refusals.get(reason, 0) + 1
    for i in required:
        findings.lost += 1
        findings.problem(state, f"{name} did not open, chunk {i} lost: {why}")


def _check_tier(
    history: History,
    state: CrashState,
    tier: Tier,
    name: str,
    required: dict[int, int],
    verify: bool,
    findings: Findings,
) -> None:
    if (why := tier.degraded) is not None:
        if "fsck" not in why:
            findings.crashes += 1
            findings.problem(state, f"{name} refused without saying what to do: {why}")
        _refused(state, findings, name, why, required)
        return
    findings.opened += 1
    keys = history.keys(name)
    # twice: with verification off only a recovered record's first read is checked
    for attempt in range(1 if verify else 2):
        got = tier.read_payloads([chunk_key(i) for i in keys])
        for i, served in zip(keys, got, strict=True):
            if served is None:
                findings.missed += attempt == 0
                if i in required and attempt == 0:
                    findings.lost += 1
                    findings.problem(state, f"{name}: acknowledged chunk {i} lost")
                continue
            findings.served += attempt == 0
            data = bytes(served.view)
            versions = {
                v
                for v in history.allowed(name, i, state.point)
                if chunk_bytes(i, v) == data
            }
            if not versions or served.shape != torch.Size([len(data)]):
                findings.wrong += 1
                findings.problem(state, f"{name}: chunk {i} served wrong bytes")
            elif i in required and required[i] not in versions:
                findings.stale += 1
                findings.problem(
                    state,
                    f"{name}: chunk {i} served version {sorted(versions)}, "
                    f"acknowledged {required[i]}",
                )


def _re_put(
    history: History,
    state: CrashState,
    scratch: Path,
    required: dict[int, int],
    verify: bool,
    findings: Findings,
) -> dict[int, int]:
    """Store again what the warm tier recovered (as LMCache does on a miss,
    here even for what it says it holds); the chunks it acknowledged join
    ``required``."""
    tier = open_tier(scratch, "warm", verify=verify, fsync=history.fsync)
    try:
        ids = sorted(Workload._id(k) for k in tier.stored_keys())
        items = []
        for i in ids:
            versions = history.allowed("warm", i, state.point)
            if versions:
                items.append((i, max(versions)))
        done = tier.write_payloads([payload(i, v) for i, v in items])
    finally:
        tier.close()
    required = dict(required)
    required.update((i, v) for (i, v), ok in zip(items, done, strict=True) if ok)
    return required


def explore(
    history: History,
    scratch: Path,
    budget: int,
    *,
    seed: int = 0,
    verify: bool = True,
    re_put: bool = False,
    on_state: Callable[[CrashState], None] | None = None,
) -> Findings:
    """Check up to ``budget`` crash states of ``history``'s stream."""
    findings = Findings()
    started = time.perf_counter()
    quiet = logging.getLogger("lmcache_tiered")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        states = crash_states(
            history.ops, history.ops_base, budget, seed, context=history.context
        )
        for state in states:
            if on_state is not None:
                on_state(state)
            check_state(history, state, scratch, findings, verify=verify, re_put=re_put)
    finally:
        quiet.setLevel(level)
    findings.seconds = time.perf_counter() - started
    return findings
