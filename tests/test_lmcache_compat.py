"""lmcache_tiered._lmcache and the harness's lmcache_tiered.testing.lmcache:
LMCache's moved and private names, on the installed release (CI runs this
file on 0.5.6 and on 0.5.7rc2)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_tiered import _lmcache
from lmcache_tiered.testing import lmcache as harness


def test_moved_names_come_from_the_installed_layout() -> None:
    """0.5.7 moved the in-process engine under lmcache.inprocess.v1."""
    release = importlib.metadata.version("lmcache")[:5].split(".")
    new = tuple(int(p) for p in release) >= (0, 5, 7)
    engine = "lmcache.inprocess.v1" if new else "lmcache.v1"
    codec = (
        "lmcache.v1.distributed.l2_adapters.raw_block"
        if new
        else "lmcache.v1.storage_backend.raw_block"
    )
    assert harness.LMCacheEngine.__module__ == f"{engine}.cache_engine"
    assert harness.GPUConnectorInterface.__module__.startswith(f"{engine}.")
    assert _lmcache.ChunkedTokenDatabase.__module__ == f"{engine}.token_database"
    assert _lmcache.object_key_to_string.__module__ == f"{codec}.key_codec"
    assert isinstance(harness.engine_instances(), dict)
    for module in (_lmcache, harness):
        with pytest.raises(AttributeError, match="no attribute 'LMCacheEngin'"):
            module.LMCacheEngin  # noqa: B018


def test_an_unknown_layout_names_the_release_and_our_range() -> None:
    with pytest.raises(ImportError) as info:
        _lmcache.first_module(("lmcache.v9.cache_engine", "lmcache.v8.cache_engine"))
    text = str(info.value)
    installed = importlib.metadata.version("lmcache")
    assert f"lmcache.v9.cache_engine not found in lmcache {installed}" in text
    assert "install a supported release (lmcache" in text and "<0.5.8" in text


def test_a_module_that_exists_but_misses_a_dependency_is_not_a_layout_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a missing module *at the path tried* moves on to the next path; a
    dependency it lacks is raised as it is, not hidden by the fallback."""
    package = tmp_path / "fake_lmcache_layout"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        _lmcache.first_module(("fake_lmcache_layout.engine", "lmcache.v1.x"))
    assert info.value.name == "no_such_dependency_xyz"


def test_the_mp_adapter_never_loads_the_in_process_engine() -> None:
    """lmcache server imports our adapter: neither the deprecated engine nor
    its token database (transformers) may come with it."""
    code = (
        "import sys, lmcache_tiered.mp;"
        "print(sorted(m for m in sys.modules if m.endswith("
        "('.cache_engine', '.token_database'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


def adapter_logs(tmp_path: Path, level: str, host_configured: bool = False) -> str:
    """What a fresh interpreter that builds an adapter and logs INFO ('said
    42') and DEBUG ('detail') on our logger prints (its stderr)."""
    host = "logging.basicConfig(level=logging.INFO, format='host: %(message)s')\n"
    code = (
        "import logging, sys\n"
        + (host if host_configured else "")
        + "from lmcache_tiered.mp import TieredL2Adapter\n"
        f"a = TieredL2Adapter({{'warm.paths': [{str(tmp_path)!r}], "
        "'warm.capacity_gb': 0.01, 'slot_mb': 1})\n"
        "logging.getLogger('lmcache_tiered.cache.admission').info('said %d', 42)\n"
        "logging.getLogger('lmcache_tiered.cache.admission').debug('detail')\n"
        "a.close()\n"
    )
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "INFO", "LMCACHE_TIERED_LOG_LEVEL": level}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    return out.stderr


@pytest.mark.parametrize("host_configured", [False, True])
def test_our_log_lines_reach_lmcache_servers_log(
    tmp_path: Path, host_configured: bool
) -> None:
    """In ``lmcache server`` nothing configures the root logger and LMCache's
    loggers do not propagate: the adapter gives ours LMCache's handler, so
    an INFO line (what read-time admission did) is printed, in LMCache's
    format; LMCACHE_TIERED_LOG_LEVEL sets ours alone. Where the host
    configured logging, ours is left to it."""
    stderr = adapter_logs(tmp_path, "debug", host_configured)
    (line,) = [x for x in stderr.splitlines() if "said 42" in x]
    if host_configured:
        assert line == "host: said 42"
        assert "detail" not in stderr
    else:
        assert "LMCache INFO" in line
        assert "detail" in stderr  # ours at DEBUG, LMCache's left at INFO


def test_a_bad_log_level_is_named_not_fatal(tmp_path: Path) -> None:
    stderr = adapter_logs(tmp_path, "verbose")
    assert "LMCACHE_TIERED_LOG_LEVEL=VERBOSE is not a log level" in stderr
    assert "said 42" in stderr and "detail" not in stderr
