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
#: Each layer's rank: a module may import its own layer and those of lower
#: rank. The core (config .. integration) comes first; the tools above it,
#: bench's three products over what they share, the command line on top.
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
    # the module paths users write in their configurations
    "backend": 6,
    "mp": 6,
    "__init__": 6,
    "testing": 6,
    "ops": 7,
    "bench.common": 7,
    "bench.disk": 8,
    "bench.model": 8,
    "bench.serve": 9,
    "soak": 9,
    "cli": 10,
}
#: bench's own package module, which only says what the products are
LAYERS["bench.__init__"] = LAYERS["bench"] = 7


def layer(module: str) -> str:
    """The layer of ``lmcache_tiered.<module>`` (dotted, without the prefix):
    its longest prefix in :data:`LAYERS`."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if (name := ".".join(parts[:end])) in LAYERS:
            return name
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def rank(module: str) -> int:
    return LAYERS[layer(module)]


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


def modules() -> dict[str, set[str]]:
    """Every module of the package and ours it imports."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        found[module.removesuffix(".__init__") or "__init__"] = imported(path)
    return found


def test_no_module_imports_a_layer_above_its_own() -> None:
    """Nor a layer of the same rank but another name (bench's disk and
    model products stay apart)."""
    upward = []
    for module, targets in modules().items():
        for target in sorted(targets):
            same = layer(target) == layer(module)
            if rank(target) > rank(module) or (
                rank(target) == rank(module) and not same
            ):
                upward.append(f"{module} imports {target}")
    assert not upward, upward
    # the check sees imports at all (it would pass on a parse that found none)
    assert "storage.layout" in imported(PACKAGE / "storage" / "tier.py")
    assert layer("bench.serve.serve_bench") == "bench.serve"


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of ours ``path`` imports: ``from lmcache_tiered.io import
    ring`` imports ``io.ring``, ``from lmcache_tiered.io import ALIGN`` the
    package ``io``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module.removeprefix("lmcache_tiered").lstrip(".")
            if not node.module.startswith("lmcache_tiered"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}".lstrip(".")
                found.add(sub if sub in known else base or "__init__")
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("lmcache_tiered.")
                for a in node.names
                if a.name.startswith("lmcache_tiered.")
            }
    return found


def test_no_module_imports_itself_through_others() -> None:
    """No circle of imports, lazy and type-only ones included: a module's
    imports can be read before it, bottom up."""
    paths = {
        (
            ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(
                ".__init__"
            )
        ): path
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    known = set(paths)
    edges = {
        m: {t for t in imported_modules(path, known) if t in known and t != m}
        for m, path in paths.items()
    }
    circles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, circles
    # the check sees imports of modules through their package at all
    assert "bench.serve.servers" in edges["bench.serve.serve_bench"]
    assert "io.ring" in edges["io.uring"]


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


def test_no_module_is_over_600_lines() -> None:
    """One job per module: past ~600 lines a module holds more than one."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert long == {}
