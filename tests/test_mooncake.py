"""The Mooncake cold tier's tests (tests/mooncake_netns.py), each run in a
network namespace of its own with only loopback up.

Every Mooncake process and client opens listeners on all addresses whatever
its flags say (the client's handshake on 0.0.0.0, its transfers on [::]), so
the tests' mooncake_master, mooncake_client and engines run in a namespace
where nothing but 127.0.0.1 exists: ``unshare -n`` (root), then ``ip link set
lo up``, then pytest on that module. They skip only where Mooncake is not
installed or the namespace is refused; .ci/run installs Mooncake and runs as
root, so there nothing is skipped (its stable leg sets
LMCACHE_TIERED_REQUIRE_MOONCAKE=1: a skip would be a failure there).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_tiered import cli
from lmcache_tiered.storage.mooncake import INSTALL
from lmcache_tiered.testing import netns
from lmcache_tiered.testing.mooncake import MooncakePool

TESTS = Path(__file__).resolve().parent
CASES = TESTS / "mooncake_netns.py"
NETNS_ENV = "LMCACHE_TIERED_MOONCAKE_NETNS"


def _mooncake_missing() -> str | None:
    """Why Mooncake's client cannot be imported here (None: it can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"Mooncake is not usable here ({exc}); {INSTALL} (.ci/run does)"
    return None


def cases(test: str | None = None) -> list[str]:
    """The command that runs the cases (one, or all) in a namespace."""
    target = str(CASES) if test is None else f"{CASES}::{test}"
    return netns.command([
        sys.executable, "-m", "pytest", target, "-q", "-n", "0", "-p",
        "no:cacheprovider", "-o", "addopts=", "--durations=0", "-rs",
        "--rootdir", str(TESTS.parent),
    ])  # fmt: skip


def require_mooncake() -> None:
    """Skip where Mooncake or a namespace is missing; fail there instead
    under LMCACHE_TIERED_REQUIRE_MOONCAKE=1 (CI's stable leg)."""
    missing = _mooncake_missing() or netns.refused()
    if missing and os.environ.get("LMCACHE_TIERED_REQUIRE_MOONCAKE") == "1":
        pytest.fail(f"LMCACHE_TIERED_REQUIRE_MOONCAKE=1, but {missing}")
    if missing:
        pytest.skip(missing)


def test_mooncake_cold_tier_in_its_own_network_namespace() -> None:
    """All of tests/mooncake_netns.py, in one namespace of its own: pass,
    none skipped (its run times are in the output: --durations)."""
    require_mooncake()
    env = os.environ | {NETNS_ENV: "1"}
    run = subprocess.run(
        cases(), capture_output=True, text=True, timeout=600, env=env, cwd=TESTS.parent
    )
    out = run.stdout + run.stderr
    print(out[-6000:])
    assert run.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary


# ------------------------------------- the benchmarks' own pool, from outside


def lmcache_tiered(*argv: str) -> subprocess.CompletedProcess[str]:
    """The command, as a user runs it, outside any namespace: a run with a
    pool of its own runs itself again in one."""
    assert not netns.isolated()
    command = [sys.executable, "-m", "lmcache_tiered.cli", *argv]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=TESTS.parent
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def test_bench_runs_on_a_mooncake_pool_of_its_own(tmp_path: Path) -> None:
    """``bench --cold-adapter mooncake``: the bench starts a pool on loopback
    in a namespace of its own; A's chunks go to the pool (a warm tier of 3
    chunks, no CPU tier) and its follow-up turns are served from it."""
    require_mooncake()
    from test_bench import SMALL, mooncake, write_trace

    warm = tmp_path / "warm"
    warm.mkdir()
    chunk = 256 * 128  # tokens x KV bytes per token of SMALL
    a, c = list(range(1, 7)), list(range(20, 26))
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            mooncake(0, 6 * 512, a),
            mooncake(1_000, 6 * 512, c),
            mooncake(2_000, 6 * 512 + 300, [*a, 9]),
        ],
    )
    out = tmp_path / "r.json"
    done = lmcache_tiered(
        "bench", "--trace", str(trace), *SMALL, "--warm", str(warm),
        "--cold-adapter", "mooncake", "--hot-gb", "0",
        "--warm-gb", str(3 * (chunk + 4096) / 2**30), "--concurrency", "1",
        "--policies", "none", "--no-baseline", "--plot", "none",
        "--json", str(out),
    )  # fmt: skip
    assert "cold on a real MooncakeConnector store" in done.stdout
    document = json.loads(out.read_text())
    params = document["config"]["cold_adapter"]["adapter_params"]
    assert params["master_server_address"].startswith("127.0.0.1:")
    assert params["local_hostname"] == "127.0.0.1"
    cold = document["policies"]["none"]["backend_metrics"]["tiers"]["cold"]
    assert cold["bytes_written"] > 0 and cold["hits"] > 0 and cold["misses"] == 0


def test_diskbench_measures_a_mooncake_pool_of_its_own(tmp_path: Path) -> None:
    """``diskbench --mp --store mooncake``: the connector is a contender,
    its chunks found after a restart and read back, not judged as a disk."""
    require_mooncake()
    out = tmp_path / "d.json"
    done = lmcache_tiered(
        "diskbench", "--mp", "--store", "mooncake", "--workdir", str(tmp_path),
        "--total-gb", "0.03", "--chunk-mb", "1", "--placements", "1",
        "--rounds", "1", "--json", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    (spec,) = result["stores"]
    assert spec["class_name"] == "MooncakeConnector"
    store = result["mp"]["store_mooncakeconnector"]
    assert store["store"] and store["restart"] == "recovered"
    assert store["read_gbps"] > 0 and store["write_gbps"] > 0
    assert all(g["against"] != "store_mooncakeconnector" for g in result["mp_goals"])
    assert "MooncakeConnector store (cold tier, no drive)" in done.stdout
    assert "no drive, no NIC, no RDMA" in done.stdout


def test_a_pool_of_its_own_is_refused_where_it_could_reach_out(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No pool starts outside a namespace of its own; a benchmark or a soak
    that cannot make one says why and what to do instead, and starts
    nothing."""
    with pytest.raises(RuntimeError, match="listen on all addresses"):
        MooncakePool(tmp_path)
    monkeypatch.setattr(netns, "refused", lambda: "no network namespace (test)")
    assert cli.main(["bench", "--cold-adapter", "mooncake", "--plot", "none"]) == 2
    err = capsys.readouterr().err
    assert "--cold-adapter mooncake starts a Mooncake pool" in err
    assert "no network namespace (test): run it as root, or start a pool" in err
    assert cli.main(["diskbench", "--mp", "--store", "mooncake"]) == 2
    assert "--store mooncake starts a Mooncake pool" in capsys.readouterr().err
    assert cli.main(["soak", "--store", "mooncake", "--plot", "none"]) == 2
    assert "soak: --store mooncake starts a Mooncake pool" in capsys.readouterr().err
    redis = json.dumps({"type": "resp", "host": "127.0.0.1", "port": 6379})
    argv = ["diskbench", "--mp", "--store", "mooncake", "--store", redis]
    assert cli.main(argv) == 2
    assert "where the other --store cannot be reached" in capsys.readouterr().err
    assert cli.main(["diskbench", "--store", redis]) == 2
    assert "--store adds contenders to --mp" in capsys.readouterr().err


def test_a_soak_on_a_mooncake_pool_of_its_own_passes_its_outages(
    tmp_path: Path,
) -> None:
    """``soak --store mooncake``: the soak runs itself again in a namespace
    of its own, its cold tier on a pool of its own whose master is stopped,
    then its memory process killed (back empty), then its master killed and
    restarted, then its memory process stopped, a worker killed between:
    nothing wrong, nothing acknowledged lost, served again after each."""
    require_mooncake()
    out = tmp_path / "soak.json"
    done = lmcache_tiered(
        "soak", "--store", "mooncake", "--duration", "60s",
        "--faults", "store=14s,kill=30s", "--outage", "8s",
        "--dir", str(tmp_path / "run"), "--json", str(out), "--plot", "none",
    )  # fmt: skip
    assert "PASS" in done.stdout
    result = json.loads(out.read_text())
    assert result["store"] == "Mooncake pool" and result["failures"] == []
    outages = [f["what"] for f in result["faults"] if f["kind"] == "store"]
    assert outages == [
        "master SIGSTOP 8 s",
        "memory process killed, restarted empty after 8 s",
        "master killed, restarted after 8 s",
        "memory process SIGSTOP 8 s",
    ]
    assert result["restarts"] == 1 and result["checked_chunks"] > 0
    assert result["wrong_chunks"] == 0 and result["lost_chunks"] == 0
    assert result["not_back"] == []
