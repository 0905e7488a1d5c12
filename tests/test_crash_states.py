"""Power cuts at every write boundary: a tier reopened on any crash state
serves exact bytes only, and with ``tiered.fsync`` loses nothing it
acknowledged (issue 51, item 1).

The harness (:mod:`lmcache_tiered.testing.crash`,
:mod:`lmcache_tiered.testing.crash_check`) records every change a real tier
makes to its files and rebuilds what a power cut could leave: each prefix of
the stream, and subsets and reorderings of the writes not yet flushed. CI
checks ``LMCACHE_TIERED_CRASH_STATES`` states in all (400 by default, spread
over fsync on/off and verification on/off); set it to 10000 or more for the
long run. Each exploring test prints one ``FIGURES`` line (``pytest -s``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmcache_tiered.storage.layout import Geometry, RecordHeader
from lmcache_tiered.testing.crash import (
    CrashState,
    Op,
    crash_states,
    snapshot,
)
from lmcache_tiered.testing.crash_check import (
    MAX_PAYLOAD,
    TIERS,
    Findings,
    History,
    check_state,
    chunk_key,
    explore,
    record_workload,
)

#: crash states checked in all by the exploring tests (CI: 400)
TOTAL = int(os.environ.get("LMCACHE_TIERED_CRASH_STATES", "400"))
CONFIGS = [(True, True), (True, False), (False, True), (False, False)]
GEOMETRY = Geometry.plan(len(TIERS["warm"][0]), 4096, MAX_PAYLOAD)


def figures(what: str, findings: Findings) -> None:
    print(f"\nFIGURES crash states, {what}: {findings.line()}")
    if findings.refusals:
        print(f"  refusals: {findings.refusals}")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, History]:
    """The seed-1 workload's history, with fsync and without."""
    return {
        fsync: record_workload(
            tmp_path_factory.mktemp(f"rec-{fsync}"), fsync=fsync, seed=1
        )
        for fsync in (True, False)
    }


def final_state(history: History) -> CrashState:
    """The files as the workload left them: the whole stream applied."""
    image = {p: bytearray(c) for p, c in history.ops_base.items()}
    for op in history.ops:
        op.apply(image)
    return CrashState(len(history.ops), (), "final", image)


def test_replaying_the_stream_rebuilds_the_files(tmp_path: Path) -> None:
    """The recorder misses nothing: replaying every recorded change over
    the snapshot gives the files the tier left, byte for byte; and the
    stream holds the format, growth, headers, payloads and flushes."""
    history = record_workload(tmp_path, fsync=True, seed=3)
    replayed = {p: bytes(c) for p, c in final_state(history).image.items()}
    on_disk = {p: bytes(c) for p, c in snapshot(tmp_path).items()}
    assert {p: c for p, c in on_disk.items() if not p.endswith(".lock")} == replayed
    kinds = {(op.kind, op.path.rsplit(".", 1)[-1]) for op in history.ops}
    assert {("truncate", "hdr"), ("extend", "slab"), ("flush", "hdr")} <= kinds
    assert {("write", "hdr"), ("write", "slab")} <= kinds
    assert any(op.path.startswith("cold0/") for op in history.ops)
    gone = [e for e in history.events if e.kind == "gone"]
    assert {e.tier for e in gone} >= {"warm", "cold"}, "evictions in both tiers"


def test_states_cover_every_subset_and_order_of_unflushed_writes() -> None:
    """Three unflushed writes, two of them to the same bytes: every subset,
    and both orders of the clashing pair, are distinct states."""
    ops = [
        Op("write", "f", 0, b"a"),
        Op("flush", "f"),
        Op("write", "f", 1, b"b"),
        Op("write", "f", 2, b"c"),
        Op("write", "f", 2, b"d"),
    ]
    states = list(crash_states(ops, {}, budget=1000, seed=0))
    finals = {bytes(s.image["f"]) for s in states if s.point == len(ops)}
    # b at 1 or not; at 2: nothing, c, d, or c then d / d then c
    assert finals == {
        b"a",
        b"ab",
        b"a\0c",
        b"a\0d",
        b"abc",
        b"abd",
    }, finals
    # the flushed write is in every state after its flush; before, it may be lost
    assert all(s.image["f"][:1] == b"a" for s in states if s.point >= 2)
    assert any(s.point == 1 and not s.image.get("f") for s in states)


def test_a_torn_write_keeps_only_its_chosen_sectors() -> None:
    """A power cut may tear a 4 KiB request into 512-byte sectors."""
    image: dict[str, bytearray] = {"f": bytearray(b"o" * 2048)}
    Op("write", "f", 0, b"n" * 2048).apply(image, sectors=0b0101)
    assert image["f"] == b"n" * 512 + b"o" * 512 + b"n" * 512 + b"o" * 512


@pytest.mark.parametrize(("fsync", "verify"), CONFIGS)
def test_power_cut_serves_exact_bytes(
    recorded: dict[bool, History], tmp_path: Path, fsync: bool, verify: bool
) -> None:
    """On every explored crash state the tiers open or refuse with a message
    naming fsck, serve only bytes some write of that key carried, and with
    fsync serve every chunk acknowledged before the crash (and not evicted
    since), in its acknowledged version. The long run (10,000+ states)
    repeats this over more seeds."""
    budget, seed, total = TOTAL // len(CONFIGS), 1, Findings()
    while total.states < budget:
        history = (
            recorded[fsync]
            if seed == 1
            else record_workload(tmp_path / f"rec{seed}", fsync=fsync, seed=seed)
        )
        found = explore(
            history, tmp_path / "state", budget - total.states, seed=seed, verify=verify
        )
        for name in (
            "states",
            "torn",
            "opened",
            "refused",
            "served",
            "missed",
            "wrong",
            "lost",
            "stale",
            "crashes",
        ):
            setattr(total, name, getattr(total, name) + getattr(found, name))
        total.seconds += found.seconds
        total.problems += found.problems
        for why, n in found.refusals.items():
            total.refusals[why] = total.refusals.get(why, 0) + n
        seed += 1
    figures(f"fsync {fsync}, verify_reads {verify}", total)
    assert total.states >= budget
    assert total.served > 0, "the states must hold chunks to check"
    assert total.clean, total.problems
    if fsync:
        assert total.refused == 0, total.refusals


def _record_at(image: dict[str, bytearray], key: int) -> tuple[int, RecordHeader]:
    """The slot and header of ``key`` in the warm header file of ``image``."""
    headers = image["warm0/kv-w0.hdr"]
    found = []
    for slot in range(len(headers) // 4096 - 1):
        block = bytes(headers[Geometry.header_offset(slot) :][:4096])
        if block[:8] != bytes(8):
            header = RecordHeader.decode(block, MAX_PAYLOAD)
            if header.key == chunk_key(key):
                found.append((slot, header))
    assert found, f"chunk {key} is not in warm's final files"
    return max(found, key=lambda f: f[1].sequence)


def _final_state(history: History) -> tuple[CrashState, list[int]]:
    """The final files, and the chunks warm acknowledged and still holds."""
    return final_state(history), sorted(history.required("warm", len(history.ops)))


def test_checker_sees_a_torn_payload_as_a_miss_not_a_wrong_byte(
    recorded: dict[bool, History], tmp_path: Path
) -> None:
    """A payload byte flipped without fixing its CRC: the tier must miss that
    chunk (and only it), and the checker counts no wrong byte."""
    history = recorded[False]
    state, stored = _final_state(history)
    clean = Findings()
    check_state(history, state, tmp_path, clean)
    slot, header = _record_at(state.image, stored[0])
    extent = GEOMETRY.extents(slot, header.payload_size)[0]
    state.image[f"warm{extent.device}/kv-w0.slab"][extent.offset + 7] ^= 0x40
    torn = Findings()
    check_state(history, state, tmp_path, torn)
    assert clean.clean and torn.clean
    assert torn.served == clean.served - 1 and torn.missed == clean.missed + 1


def test_checker_catches_a_valid_header_over_the_wrong_payload(
    recorded: dict[bool, History], tmp_path: Path
) -> None:
    """A well-formed header (its CRC right) naming chunk A over chunk B's
    payload: the tier serves B's bytes as A, and the checker must say so."""
    history = recorded[False]
    state, stored = _final_state(history)
    image = state.image
    sizes = {i: _record_at(image, i)[1].payload_size for i in stored}
    a, b = next(
        (a, b) for a in stored for b in stored if a != b and sizes[a] == sizes[b]
    )
    _, header_a = _record_at(image, a)
    slot_b, header_b = _record_at(image, b)
    forged = RecordHeader(
        key=header_a.key,
        shape=header_b.shape,
        dtype=header_b.dtype,
        fmt=header_b.fmt,
        payload_size=header_b.payload_size,
        payload_crc=header_b.payload_crc,
        sequence=10**9,
        created_ns=header_b.created_ns,
    )
    offset = Geometry.header_offset(slot_b)
    image["warm0/kv-w0.hdr"][offset : offset + 4096] = forged.encode()
    found = Findings()
    check_state(history, state, tmp_path, found)
    assert found.wrong >= 1 and not found.clean, found.line()
    assert any(f"chunk {a} served wrong bytes" in p for p in found.problems)


def test_checker_catches_a_lost_acknowledged_chunk(
    recorded: dict[bool, History], tmp_path: Path
) -> None:
    """With fsync, a flushed header that vanished is a loss the checker
    reports (as a power cut that dropped flushed data would be)."""
    history = recorded[True]
    state, required = _final_state(history)
    assert required, "the final state must hold acknowledged chunks"
    slot, _ = _record_at(state.image, required[0])
    offset = Geometry.header_offset(slot)
    state.image["warm0/kv-w0.hdr"][offset : offset + 4096] = bytes(4096)
    found = Findings()
    check_state(history, state, tmp_path, found)
    assert found.lost >= 1 and found.wrong == 0, found.line()


def test_explorer_finds_a_tier_that_trusts_torn_records(
    recorded: dict[bool, History], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted tier defect: recovered records served without their CRC
    check. Some crash state must then serve a torn or stale payload, and
    the explorer must report it as wrong bytes."""
    monkeypatch.setattr(RecordHeader, "payload_matches", lambda self, view: True)
    found = explore(recorded[False], tmp_path, 60, seed=1)
    figures("CRC check planted off", found)
    assert found.wrong > 0, found.line()


# ------------------------------------------------- defects the explorer found


def test_storing_a_recovered_chunk_again_makes_it_durable(
    recorded: dict[bool, History], tmp_path: Path
) -> None:
    found = explore(recorded[True], tmp_path, 60, seed=1, re_put=True)
    figures("re-put after the power cut", found)
    assert found.clean, found.problems


def test_a_batch_never_acknowledges_what_it_evicts(tmp_path: Path) -> None:
    history = record_workload(tmp_path / "rec", fsync=True, seed=1, reput_stored=True)
    found = explore(history, tmp_path / "state", 60, seed=1)
    figures("stores of chunks already held", found)
    assert found.clean, found.problems


def test_power_cut_without_fsync_leaves_a_tier_that_starts(
    recorded: dict[bool, History], tmp_path: Path
) -> None:
    found = explore(recorded[False], tmp_path, 60, seed=1)
    figures("fsync off, refusals", found)
    assert found.refused == 0, found.refusals


def test_with_fsync_new_files_have_their_directories_flushed(
    recorded: dict[bool, History],
) -> None:
    ops = recorded[True].ops
    dirs = {d for dirs, _, _ in TIERS.values() for d in dirs}
    flushed = {op.path for op in ops if op.kind == "flush"}
    assert dirs <= flushed, sorted(dirs - flushed)
