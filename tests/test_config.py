"""The settings parser: every bad value is one clear error naming the key."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_tiered.config import (
    PREFIX,
    SETTINGS,
    ConfigError,
    TieredConfig,
    TierSettings,
    setting_key,
)


def test_defaults_and_list_of_paths(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    config = TieredConfig.from_extra_config(
        {"tiered.warm.paths": [str(a), str(b)], "other.key": 1}
    )
    assert config.warm.paths == (str(a), str(b))
    assert config.io_engine == "auto"
    assert config.queue_depth == 64
    assert config.stripe_bytes == 1 << 20
    assert config.direct_io is True
    assert config.cold is None


def test_issue_example_keys_and_comma_string(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    config = TieredConfig.from_extra_config(
        {
            "tiered.warm.paths": f"{a}, {b}",
            "tiered.warm.capacity_gb": 2,
            "tiered.io_engine": "threads",
            "tiered.queue_depth": "32",
            "tiered.stripe_kb": 256,
            "tiered.direct_io": "false",
            "tiered.file_mode": "0660",
            "tiered.warmup.policy": "none",
            "tiered.warmup.session.lead_s": "2",
            "tiered.cold.write": "through",
        }
    )
    assert config.warm.paths == (str(a), str(b))
    assert config.warm.capacity_bytes == 2 << 30
    assert (config.io_engine, config.queue_depth) == ("threads", 32)
    assert config.stripe_bytes == 256 << 10
    assert config.direct_io is False
    assert config.file_mode == 0o660
    assert config.warmup_policy == "none"
    assert config.policy_params == {"session.lead_s": "2"}
    assert config.cold_write_through is True


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "tiered.warm.paths is required"),
        ({"tiered.warm.pathz": "/x"}, "Did you mean tiered.warm.paths"),
        ({"tiered.queue_depth": "deep"}, "tiered.queue_depth: expected a number"),
        ({"tiered.queue_depth": 0}, "tiered.queue_depth: must be greater than 0"),
        ({"tiered.queue_depth": 2.5}, "tiered.queue_depth: expected a whole number"),
        ({"tiered.io_engine": "spdk"}, "tiered.io_engine: expected one of"),
        ({"tiered.direct_io": "maybe"}, "tiered.direct_io: expected true or false"),
        ({"tiered.stripe_kb": 6}, "tiered.stripe_kb: must be a multiple of 4"),
        ({"tiered.stripe_kb": 4 << 30}, "tiered.stripe_kb: must be between 4 and"),
        (
            {"tiered.stripe_kb": 2048, "tiered.slot_mb": 1},
            r"stripe_kb: 2048 KiB is larger than a chunk slot \(tiered.slot_mb: 1 "
            r"MiB\): give at most 1024",
        ),
        # a 10 TB slot is a typo, not a capacity too small for it
        ({"tiered.slot_mb": 1e7}, "tiered.slot_mb: must be between 0.00390625 and"),
        ({"tiered.warmup.tick_ms": 1e-9}, "tiered.warmup.tick_ms: must be at least 1"),
        ({"tiered.file_mode": "rw"}, "tiered.file_mode: expected octal"),
        ({"tiered.warmup.hot_fraction": 2}, "tiered.warmup.hot_fraction: must be"),
        ({"tiered.warmup.polcy": "x"}, "Did you mean tiered.warmup.policy"),
        ({"tiered.cold.write": "around"}, "tiered.cold.write: expected one of"),
    ],
)
def test_bad_values_name_the_key(
    tmp_path: Path, extra: dict[str, object], message: str
) -> None:
    settings: dict[str, object] = {"tiered.warm.paths": str(tmp_path)}
    settings.update(extra)
    if not extra:
        settings = {}
    with pytest.raises(ConfigError, match=message):
        TieredConfig.from_extra_config(settings)


def test_missing_and_unwritable_paths(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"{missing} does not exist.*mkdir -p"):
        TieredConfig.from_extra_config({"tiered.warm.paths": str(missing)})
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        TieredConfig.from_extra_config({"tiered.warm.paths": str(a_file)})


def test_unwritable_path_is_refused() -> None:
    """Checked as an unprivileged user: root ignores permission bits."""
    base = tempfile.mkdtemp()
    os.chmod(base, 0o755)
    locked = os.path.join(base, "locked")
    os.mkdir(locked, 0o555)
    code = (
        "import os\n"
        "from lmcache_tiered.config import TieredConfig, ConfigError\n"
        "if os.geteuid() == 0: os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    TieredConfig.from_extra_config({{'tiered.warm.paths': {locked!r}}})\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    finally:
        shutil.rmtree(base)
    assert f"tiered.warm.paths: {locked} is not writable" in out


@pytest.mark.parametrize("value", ["nan", "inf", float("nan")])
def test_non_finite_capacity_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match="tiered.warm.capacity_gb: expected a finite"):
        TieredConfig.from_extra_config(
            {"tiered.warm.paths": str(tmp_path), "tiered.warm.capacity_gb": value}
        )


def test_same_directory_in_two_tiers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="also a warm path"):
        TieredConfig.from_extra_config(
            {"tiered.warm.paths": str(tmp_path), "tiered.cold.paths": str(tmp_path)}
        )


@given(
    st.dictionaries(
        st.text(max_size=30),
        st.one_of(
            st.none(),
            st.integers(),
            st.text(max_size=20),
            st.booleans(),
            st.floats(allow_nan=True),
        ),
    )
)
def test_any_input_gives_a_config_or_a_config_error(extra: dict[str, object]) -> None:
    settings = {f"tiered.{k}": v for k, v in extra.items()}
    with contextlib.suppress(ConfigError):
        TieredConfig.from_extra_config(settings)


def test_a_capacity_beyond_the_file_system_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = {"tiered.warm.paths": str(tmp_path), "tiered.warm.capacity_gb": 1e12}
    with caplog.at_level("WARNING", logger="lmcache_tiered"):
        config = TieredConfig.from_extra_config(settings)
    assert config.warm.capacity_bytes == int(1e12 * 2**30)  # a warning, not a refusal
    (record,) = [r for r in caplog.records if "capacity_gb" in r.getMessage()]
    assert "tiered.warm.capacity_gb: 1e+12 GiB is more than the file systems" in (
        record.getMessage()
    )
    caplog.clear()
    settings["tiered.warm.capacity_gb"] = 0.001
    with caplog.at_level("WARNING", logger="lmcache_tiered"):
        TieredConfig.from_extra_config(settings)
    assert not [r for r in caplog.records if "capacity_gb" in r.getMessage()]


# ------------------------------------------------ each setting declared once

PACKAGE = Path(__file__).resolve().parents[1] / "lmcache_tiered"
#: the layers below the tools: none spells a setting's key in its own words
CORE = ("io", "storage", "warmup", "cache", "integration")


def _strings(path: Path) -> list[ast.Constant]:
    """The string constants of ``path`` that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        )
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_each_default_is_declared_once_in_the_settings_table() -> None:
    """TieredConfig's defaults come from SETTINGS, not from literals of its
    own: a default written in both places would drift."""
    filled = {s.field: name for name, s in SETTINGS.items() if s.field is not None}
    assert len(filled) == len([s for s in SETTINGS.values() if s.field is not None])
    composite = {"warm", "cold", "policy_params"}
    fields = {f.name: f for f in dataclasses.fields(TieredConfig)}
    assert set(fields) == set(filled) | composite
    made = TieredConfig(warm=TierSettings("warm", ("/tmp",), 1))
    for name, setting in filled.items():
        assert getattr(made, name) == SETTINGS[setting].field_default(), name
    source = PACKAGE / "config" / "tiered_config.py"
    [cls] = [
        node
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "TieredConfig"
    ]
    literal = [
        node.target.id
        for node in cls.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(node.value, ast.Constant)
        and node.value.value is not None
    ]
    assert literal == [], f"defaults spelled outside SETTINGS: {literal}"


def test_each_help_text_and_key_is_spelled_once() -> None:
    """A setting's help lives in SETTINGS only (the docs table and the
    adapter's help are made from it), and the core cites a setting's key
    through config.setting_key, never in its own words."""
    helps = {name: s.help[:40] for name, s in SETTINGS.items()}
    twice = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "config" / "settings.py":
            continue
        text = path.read_text()
        twice += [f"{path.name}: {n}" for n, h in helps.items() if h in text]
    assert twice == []
    spelled = []
    for layer in CORE:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for node in _strings(path):
                spelled += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno}: {PREFIX}{name}"
                    for name in SETTINGS
                    if f"{PREFIX}{name}" in node.value
                ]
    assert spelled == []
    assert setting_key("io_engine") == "tiered.io_engine"
    with pytest.raises(KeyError, match="no setting tiered.io_engin"):
        setting_key("io_engin")
