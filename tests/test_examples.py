"""The examples a user copies work as they are (issue 29, items 2 and 3):
``examples/lmcache.yaml`` read by LMCache's own YAML loader into a real
engine whose tiered plugin stores and serves, and ``examples/lmcache_server.sh``
run, its ``--l2-adapter`` parsed by LMCache's own server parser and the
adapter built by LMCache's factory. Only the drive paths are swapped for
temporary directories (and the CPU tier shrunk to fit a test). Every metric
the Grafana dashboard charts is one a real engine's plugin exports."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import torch
from conftest import plugin_extra_config
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from prometheus_client import generate_latest

from lmcache_tiered import testing
from lmcache_tiered.integration.mp import TieredL2Adapter

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_example_yaml_loads_the_plugin_into_a_real_engine(
    tmp_path: Path, device_dirs: list[Path]
) -> None:
    text = (EXAMPLES / "lmcache.yaml").read_text()
    example_paths = '["/mnt/nvme0/kv", "/mnt/nvme1/kv"]'
    assert example_paths in text
    text = text.replace(example_paths, json.dumps([str(d) for d in device_dirs]))
    text = text.replace("max_local_cpu_size: 5 ", "max_local_cpu_size: 0.1 ")
    config_file = tmp_path / "lmcache.yaml"
    config_file.write_text(text)
    config = LMCacheEngineConfig.from_file(str(config_file))
    assert config.extra_config["tiered.warm.capacity_gb"] == 1000
    with testing.engine_session(config) as (engine, connector):
        assert "tiered" in testing.get_backends(engine)
        tokens = testing.make_tokens(512, seed=7)
        kv = testing.make_kv(connector, 512, seed=7)
        testing.store_tokens(engine, tokens, kv)
        testing.wait_for_puts(engine, tokens)
        testing.clear_cpu_tier(engine)
        out, hit = testing.retrieve_tokens(engine, tokens, connector=connector)
        assert int(hit.sum()) == 512 and torch.equal(out, kv)
    assert all(any(d.glob("kv-w0.slab")) for d in device_dirs)


def test_the_example_server_script_builds_the_adapter(
    tmp_path: Path, device_dirs: list[Path]
) -> None:
    """The script runs ``lmcache server``; a stand-in ``lmcache`` on PATH
    records its arguments (starting the real server is tests/e2e's job)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "lmcache"
    recorder.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
    recorder.chmod(0o755)
    environment = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(
        [str(EXAMPLES / "lmcache_server.sh"), *map(str, device_dirs)],
        env=environment | {"WARM_GB": "2"},
        check=True,
    )
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:2] == ["server", "--port"]
    adapter_json = argv[argv.index("--l2-adapter") + 1]
    parsed = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[adapter_json])
    )
    adapter = create_l2_adapter(parsed.adapters[0])
    try:
        assert isinstance(adapter, TieredL2Adapter)
        assert adapter.settings.warm.paths == tuple(map(str, device_dirs))
        assert adapter.get_usage().total_capacity_bytes == 2 << 30
    finally:
        adapter.close()
    usage = subprocess.run(
        [str(EXAMPLES / "lmcache_server.sh")], env=environment, capture_output=True
    )
    assert usage.returncode == 2 and b"one directory per NVMe drive" in usage.stderr


def test_every_dashboard_metric_is_exported_by_the_plugin(
    engine_factory: Any, device_dirs: list[Path]
) -> None:
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    charted = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"lmcache_tiered_\w+", target["expr"])
    }
    assert len(charted) >= 15
    engine, connector = engine_factory(plugin_extra_config(device_dirs))
    tokens = testing.make_tokens(512, seed=3)
    testing.store_tokens(engine, tokens, testing.make_kv(connector, 512, seed=3))
    testing.wait_for_puts(engine, tokens)
    testing.retrieve_tokens(engine, tokens, connector=connector)
    exported = set(
        re.findall(r"^(lmcache_tiered_\w+?)[{ ]", generate_latest().decode(), re.M)
    )
    assert sorted(charted - exported) == []
