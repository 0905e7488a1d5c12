"""``lmcache-tiered soak`` (issue 27, item 6): a brief run of the real thing
under every fault it injects (a real LMCache engine in a worker process it
SIGKILLs, a real redis-server it stops and kills, real records it damages),
one that must fail (acknowledged chunks evicted look lost), and the verdict's
rules on made-up samples."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from lmcache_tiered.cli import main
from lmcache_tiered.cli.soak import parse_faults
from lmcache_tiered.soak.report import Fault, Sample, SoakResult, verdict

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (apt-get install redis-server; "
    ".ci/run installs it)",
)


def soak(tmp_path: Path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "soak.json"
    code = main(["soak", "--dir", str(tmp_path / "run"), "--json", str(out), *argv])
    return code, json.loads(out.read_text())


@needs_redis
def test_a_brief_soak_under_every_fault_passes(tmp_path: Path) -> None:
    """Kills, store outages (SIGSTOP, killed and restarted empty, full) and
    damaged records in 75 s: every acknowledged chunk is found after each
    restart, no wrong byte, the damage is caught by checksums, and the cold
    tier serves and takes writes again after each store fault."""
    picture = tmp_path / "soak.png"
    code, result = soak(
        tmp_path,
        "--duration", "75s",
        "--faults", "kill=25s,store=20s,damage=10s",
        "--plot", str(picture),
    )  # fmt: skip
    assert result["failures"] == [] and code == 0
    kinds = [f["kind"] for f in result["faults"]]
    assert kinds.count("kill") == 2
    store_faults = [f["what"] for f in result["faults"] if f["kind"] == "store"]
    assert [w.split()[0] for w in store_faults] == ["SIGSTOP", "killed,", "full,"]
    assert result["restarts"] == 2 and result["deaths"] == []
    assert result["checked_chunks"] > 0  # the restarted workers read them back
    assert result["wrong_chunks"] == 0 and result["lost_chunks"] == 0
    assert result["damaged"] >= 1 and result["corrupt_seen"] >= 1
    assert result["requests"] > 100
    assert picture.stat().st_size > 10_000


def test_a_soak_whose_chunks_do_not_survive_fails(tmp_path: Path) -> None:
    """A warm tier far smaller than the conversations evicts acknowledged
    chunks: the worker started after the kill misses them, and the soak says
    FAIL with the count (the check a real loss would meet)."""
    code, result = soak(
        tmp_path,
        "--duration", "20s",
        "--faults", "kill=10s",
        "--store", "none",
        "--warm-gb", "0.01",
        "--plot", "none",
    )  # fmt: skip
    assert code == 1
    assert result["lost_chunks"] > 0
    assert any("acknowledged chunks lost" in f for f in result["failures"])


def samples(rss_mib: list[int], files: int = 20, threads: int = 20) -> list[Sample]:
    return [
        Sample(t=10.0 * i, rss=m << 20, files=files, threads=threads, requests=i)
        for i, m in enumerate(rss_mib)
    ]


def test_the_verdict_fails_growth_stalls_and_deaths_and_passes_a_plateau() -> None:
    flat = SoakResult(
        duration_s=90, faults_asked={}, requests=10, acked=10, stopped_in_s=1
    )
    flat.samples = samples([400, 500, 520, 510, 515, 520, 518, 519, 521])
    assert verdict(flat, stall_s=2) == []
    leak = SoakResult(
        duration_s=90, faults_asked={}, requests=10, acked=10, stopped_in_s=1
    )
    leak.samples = samples([400, 450, 500, 550, 600, 650, 700, 750, 800])
    assert verdict(leak, stall_s=2) == ["RSS grew: 650 -> 800 MiB"]
    outage = Fault(start=30, end=40, kind="store", what="SIGSTOP 10 s")
    stalls = SoakResult(
        duration_s=90, faults_asked={}, requests=10, acked=10, stopped_in_s=1
    )
    stalls.faults = [outage]
    stalls.stalls = [(35.0, 5.0)]  # the one the outage may cost
    assert verdict(stalls, stall_s=2) == []
    stalls.stalls.append((70.0, 3.0))
    assert verdict(stalls, stall_s=2) == ["1 reads over 2 s outside store outages"]
    died = SoakResult(
        duration_s=90, faults_asked={}, requests=10, acked=10, deaths=[(5, -11)]
    )
    assert verdict(died, stall_s=2) == [
        "1 worker deaths (exit -11)",
        "the last worker did not close (killed)",
    ]


def test_files_and_threads_a_store_fault_holds_are_not_a_leak() -> None:
    """A tier whose store refuses writes serves reads through a fresh client
    until the store takes writes again: more files and threads during the
    fault and BACK_S after, late in a run or not. The same climb outside any
    fault fails."""
    full = Fault(start=70, end=80, kind="store", what="full, writes refused 10 s")
    bump = samples([500] * 10, files=20, threads=20)
    bump[8] = Sample(t=80.0, rss=500 << 20, files=40, threads=40, requests=8)
    during = SoakResult(
        duration_s=90, faults_asked={}, requests=10, acked=10, stopped_in_s=1
    )
    during.samples, during.faults = bump, [full]
    assert verdict(during, stall_s=2) == []
    after = SoakResult(
        duration_s=90, faults_asked={}, requests=10, acked=10, stopped_in_s=1
    )
    after.samples = bump
    assert verdict(after, stall_s=2) == [
        "files grew: 20 -> 40",
        "threads grew: 20 -> 40",
    ]


def test_a_bad_fault_schedule_names_the_option_and_the_form() -> None:
    assert parse_faults("kill=10m,damage=30s") == {"kill": 600.0, "damage": 30.0}
    assert parse_faults("none") == {}
    with pytest.raises(argparse.ArgumentTypeError, match="--faults: 'kil=1m'"):
        parse_faults("kil=1m")
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        parse_faults("kill=soon")
