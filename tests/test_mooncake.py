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

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_tiered.storage.mooncake import INSTALL
from lmcache_tiered.testing import netns

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


def test_mooncake_cold_tier_in_its_own_network_namespace() -> None:
    """All of tests/mooncake_netns.py, in one namespace of its own: pass,
    none skipped (its run times are in the output: --durations)."""
    missing = _mooncake_missing() or netns.refused()
    if missing and os.environ.get("LMCACHE_TIERED_REQUIRE_MOONCAKE") == "1":
        pytest.fail(f"LMCACHE_TIERED_REQUIRE_MOONCAKE=1, but {missing}")
    if missing:
        pytest.skip(missing)
    env = os.environ | {NETNS_ENV: "1"}
    run = subprocess.run(
        cases(), capture_output=True, text=True, timeout=600, env=env, cwd=TESTS.parent
    )
    out = run.stdout + run.stderr
    print(out[-6000:])
    assert run.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary
