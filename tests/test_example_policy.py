"""The example third-party policy (examples/warmup_policy_example) installs as
its own package and loads through its entry point, like any user's policy.

It is pip-installed (no network, no build isolation) from a copy, so build
files stay out of the source tree, into a temporary target put on sys.path:
the environment itself is left as it was.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lmcache.utils import CacheEngineKey

from lmcache_tiered.warmup import installed_policies, load_policy

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "warmup_policy_example"


class View:
    """Every chunk in warm, fixed clock: all the example policy asks."""

    def where(self, key: CacheEngineKey) -> str:
        return "warm"

    def continuation(self, key: CacheEngineKey, limit: int) -> list[CacheEngineKey]:
        return []

    def now(self) -> float:
        return 0.0


def test_example_policy_loads_through_its_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(EXAMPLE, source)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    pip += ["--no-build-isolation", "--no-index", "--target", str(target)]
    quiet = {"PIP_ROOT_USER_ACTION": "ignore", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([*pip, str(source)], check=True, env={**os.environ, **quiet})
    monkeypatch.syspath_prepend(str(target))
    assert "pin_prefix" in installed_policies()

    policy = load_policy("pin_prefix", View(), {"chunks": "2"})

    assert type(policy).__name__ == "PinPrefixPolicy"
    keys = [CacheEngineKey("m", 1, 0, i, torch.bfloat16) for i in range(4)]
    (plan,) = policy.on_lookup(keys, 4)
    assert plan.keys == tuple(keys[:2]) and plan.target == "hot"
    assert policy.on_lookup(keys, 4) == []
