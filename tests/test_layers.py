"""The package's folders are its layers (lmcache_tiered/__init__.py): no
module imports a layer above its own, and the two module paths users put in
their configurations keep naming the faces."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lmcache_tiered"
#: Each layer's rank: a module may import its own rank and those below.
LAYERS = {
    "config": 0,
    "keys": 0,
    "metrics": 0,
    "_lmcache": 0,
    "io": 1,
    "storage": 2,
    "warmup": 3,
    "cache": 4,
    "integration": 5,
}
#: Everything else (bench, ops, soak, cli, testing, the stable paths) is a tool.
TOOLS = 6


def rank(module: str) -> int:
    """The layer of ``lmcache_tiered.<module>`` (dotted, without the prefix)."""
    return LAYERS.get(module.split(".")[0], TOOLS)


def imported(path: Path) -> set[str]:
    """Our modules ``path`` imports anywhere in it (lazy and type-only too),
    without the ``lmcache_tiered.`` prefix."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            if node.module == "lmcache_tiered":
                names = [f"lmcache_tiered.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {
            name.removeprefix("lmcache_tiered.")
            for name in names
            if name.startswith("lmcache_tiered.")
        }
    return found


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for target in sorted(imported(path)):
            if rank(target) > rank(module):
                upward.append(f"{module} imports {target}")
    assert not upward, upward
    # the check sees imports at all (it would pass on a parse that found none)
    assert "storage.layout" in imported(PACKAGE / "storage" / "tier.py")


@pytest.mark.parametrize(
    ("public", "home", "names"),
    [
        (
            "lmcache_tiered.backend",
            "lmcache_tiered.integration.backend",
            ["TieredBackend"],
        ),
        (
            "lmcache_tiered.mp",
            "lmcache_tiered.integration.mp",
            ["TieredL2Adapter", "TieredL2AdapterConfig"],
        ),
    ],
)
def test_the_module_paths_users_configure_name_the_faces(
    public: str, home: str, names: list[str]
) -> None:
    """``storage_plugin.tiered.module_path: lmcache_tiered.backend`` and
    ``"module_path": "lmcache_tiered.mp"`` (LMCache also looks up the
    adapter's ``...Config`` class there) keep working after the regrouping."""
    for name in names:
        assert getattr(importlib.import_module(public), name) is getattr(
            importlib.import_module(home), name
        )


def test_the_entry_points_load() -> None:
    """The vLLM plugin and the built-in warm-up policies, as installed."""
    points = importlib.metadata.entry_points()
    [hints] = [
        p
        for p in points.select(group="vllm.general_plugins")
        if p.name == "lmcache_tiered_hints"
    ]
    assert callable(hints.load())
    policies = {
        p.name: p.load() for p in points.select(group="lmcache_tiered.warmup_policies")
    }
    assert {"none", "lookahead", "session", "frequency", "hinted"} <= set(policies)
