"""The bench's machinery on tiny workloads: deterministic counts, not speed."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from lmcache_tiered import cli, testing
from lmcache_tiered.bench.common import plot, report, rules, trace
from lmcache_tiered.bench.common.trace import BLOCK_TOKENS, Request
from lmcache_tiered.bench.disk import diskbench
from lmcache_tiered.bench.model import command, presets, rounds, scenario, variants
from lmcache_tiered.bench.model.baseline import (
    ALL_HOT,
    NO_EXTERNAL_CACHE,
    GpuPrefixCache,
)
from lmcache_tiered.bench.model.devices import Device, DeviceSpec, model_tier
from lmcache_tiered.bench.model.gpu_copies import GpuCopies
from lmcache_tiered.bench.model.profiles import PROFILES, bench_shape, get_profile
from lmcache_tiered.cli import bench as cli_bench
from lmcache_tiered.integration.backend import TieredBackend

CHUNK = scenario.CHUNK_TOKENS
#: 128 KV bytes per token: 32 KiB chunks; no GPU prefix cache unless a test
#: asks for one (so every reuse goes through LMCache)
SMALL = ["--profile", "llama-3.1-8b-tp1", "--kv-scale", "1024", "--gpu-kv-gb", "0"]


def write_trace(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mooncake(ts_ms: int, tokens: int, blocks: list[int], out: int = 2) -> dict:
    return {
        "timestamp": ts_ms,
        "input_length": tokens,
        "output_length": out,
        "hash_ids": blocks,
    }


# ----------------------------------------------------------------- workloads


def test_mooncake_loader_sorts_limits_and_names_bad_lines(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [mooncake(300, 600, [0, 1]), mooncake(100, 512, [0]), mooncake(200, 10, [5])],
    )
    requests = trace.load_mooncake(path)
    assert [r.arrival_s for r in requests] == [0.1, 0.2, 0.3]
    assert requests[2].hash_ids == (0, 1)
    assert len(trace.load_mooncake(path, limit=2)) == 2
    bad = write_trace(tmp_path / "bad.jsonl", [mooncake(0, 1025, [0, 1])])
    with pytest.raises(trace.TraceError, match=r"bad.jsonl:1: 2 hash_ids cover"):
        trace.load_mooncake(bad)
    (tmp_path / "junk.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(trace.TraceError, match="junk.jsonl:1: not a Mooncake"):
        trace.load_mooncake(tmp_path / "junk.jsonl")


def test_scale_times_scales_arrivals_and_think_times() -> None:
    requests = [Request(2.0, 10, 1, (0,)), Request(2.0, 20, 1, (0,), 0, 4.0)]
    scaled = trace.scale_times(requests, 0.5)
    assert [(r.arrival_s, r.think_s) for r in scaled] == [(1.0, 0.0), (1.0, 2.0)]


def test_multi_turn_extends_each_session_and_shares_system_prompts() -> None:
    requests = trace.generate("multi-turn", seed=3)
    assert requests == trace.generate("multi-turn", seed=3)
    blocks = trace.TokenBlocks(seed=3)
    follow_ups = [r for r in requests if r.after is not None]
    assert follow_ups
    for request in follow_ups:
        previous = requests[request.after]  # type: ignore[index]
        assert request.input_length > previous.input_length
        assert request.think_s > 0
        # the previous prompt is a prefix of this one, token for token
        assert torch.equal(
            blocks.tokens(request)[: previous.input_length], blocks.tokens(previous)
        )
    firsts = [r for r in requests if r.after is None]
    system = trace.WORKLOADS["multi-turn"].system_prompt_blocks
    heads = {r.hash_ids[:system] for r in firsts}
    assert len(heads) <= trace.WORKLOADS["multi-turn"].system_prompts < len(firsts)


def test_random_access_reuses_documents_in_no_order() -> None:
    requests = trace.generate("random")
    assert all(r.after is None for r in requests)
    documents = {r.hash_ids[: r.input_length // BLOCK_TOKENS] for r in requests}
    assert len(documents) <= trace.WORKLOADS["random"].sessions < len(requests)


def test_short_workload_has_tiny_contexts() -> None:
    assert max(r.input_length for r in trace.generate("short")) < 2048


def test_unique_tokens_counts_shared_blocks_once() -> None:
    requests = [Request(0, 600, 1, (0, 1)), Request(0, 1024, 1, (0, 1))]
    assert trace.unique_tokens(requests) == 1024


# ------------------------------------------------------------------ profiles


def test_reference_profile_kv_bytes_and_scale() -> None:
    qwen = get_profile("qwen3-coder-480b-fp8-tp8")
    # 2 (K, V) x 62 layers x 1 KV head per rank (8 / TP8) x 128 x 2 bytes
    assert qwen.kv_bytes_per_token == 31_744
    shape = bench_shape(qwen)
    assert (shape.head_size, shape.kv_scale, shape.bytes_per_token) == (496, 16, 1984)
    assert shape.chunk_bytes(CHUNK) % 4096 == 0
    assert 30e9 < qwen.active_params < 40e9  # "A35B"
    assert qwen.prefill_s(2000, 0) > qwen.prefill_s(1000, 0) > 0
    assert qwen.prefill_s(1000, 50_000) > qwen.prefill_s(1000, 0)
    # one sequence touches experts_per_token experts
    one = qwen.decode_step_s(1, 0) - qwen.step_overhead_s
    weights = qwen.dense_params + qwen.experts_per_token * qwen.expert_params
    assert one == pytest.approx(weights / (qwen.tp * qwen.hbm_bytes_per_s * qwen.mbu))
    with pytest.raises(ValueError, match="Did you mean qwen3-coder-480b-fp8-tp8"):
        get_profile("qwen3-coder-480b-fp8")
    assert set(PROFILES) >= {"qwen3-coder-480b-fp8-tp8", "llama-3.1-8b-tp1"}


def test_llama_profile_prefills_as_fast_as_the_h200_measured() -> None:
    """The Llama profile's prefill is the whole forward gpu_rates timed on an
    H200 (59-61 ms at 2,048 tokens, 255-256 ms at 8,192; docs/bench.md)."""
    llama = get_profile("llama-3.1-8b-tp1")
    assert llama.prefill_s(2048, 0) == pytest.approx(0.060, rel=0.05)
    assert llama.prefill_s(8192, 0) == pytest.approx(0.2555, rel=0.05)


def test_gpu_rates_names_what_it_needs_on_a_machine_without_a_gpu() -> None:
    child = subprocess.run(
        [sys.executable, "-m", "lmcache_tiered.bench.model.gpu_rates"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert child.returncode == 1
    assert "no CUDA GPU here" in child.stderr


def test_device_spec_parses_and_names_bad_text() -> None:
    spec = DeviceSpec.parse("2.5,0.5")
    assert (spec.gbps, spec.latency_s) == (2.5, 0.0005)
    assert str(spec) == "2.5 GB/s + 0.5 ms"
    for text in ("fast", "0", "1,2,3", "1,-1"):
        with pytest.raises(ValueError, match="GBPS"):
            DeviceSpec.parse(text)


def test_device_charges_production_bytes_once_and_shares_its_bandwidth() -> None:
    """10 MB of bench bytes at scale 10 are 100 MB in production: 0.1 s at
    1 GB/s, plus the 10 ms latency once (not scaled); a second transfer
    issued at the same time waits for the first's bandwidth, not its
    latency; real I/O slower than the model is counted, not slept."""
    device = Device(DeviceSpec(1.0, 0.01), scale=10)
    began = time.monotonic()
    threads = [
        threading.Thread(target=device.transfer, args=(10**7, began)) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    took = time.monotonic() - began
    assert 0.21 <= took < 0.3
    assert device.modelled_s == pytest.approx(2 * 0.11)
    assert device.overrun_s < 0.02
    slow = Device(DeviceSpec(1.0, 0.01), scale=10)
    late = time.monotonic()
    slow.transfer(10**6, began=late - 1.0)  # its real I/O took 1 s
    assert time.monotonic() - late < 0.05
    assert slow.overrun_s > 0.9
    assert variants.overrun_share([slow]) > 0.9
    assert variants.overrun_share([device, slow]) < variants.overrun_share([slow])


def test_device_model_holds_reads_and_writes_of_a_tier(
    tier_factory: Any, allocator: Any
) -> None:
    """Demand reads, tier-to-tier payload reads and writes all go through the
    device; misses move no bytes and pay nothing."""
    tier = tier_factory()
    obj = allocator.allocate(
        torch.Size([2, 2, 64, 128]), torch.bfloat16, MemoryFormat.KV_2LTD
    )  # 64 KiB
    stored, missing = (
        CacheEngineKey("m", 1, 0, i, torch.bfloat16, None) for i in (5, 6)
    )
    # 64 KiB x 2 (scale) over 0.002 GB/s: 65.5 ms, plus 10 ms of latency
    model_tier(tier, Device(DeviceSpec(0.002, 0.010), scale=2))

    def timed(io: Any) -> float:
        began = time.perf_counter()
        io()
        return time.perf_counter() - began

    assert timed(lambda: tier.write([(stored, obj)])) >= 0.0755
    assert tier.header(stored) is not None

    def allocate(header: Any) -> Any:
        return allocator.allocate(header.shape, header.dtype, header.fmt)

    assert timed(lambda: tier.read([stored], allocate)) >= 0.0755
    assert timed(lambda: tier.read_payloads([stored])) >= 0.0755
    assert timed(lambda: tier.read_payloads([missing])) < 0.05


# -------------------------------------------------------------------- replay


def bench_argv(tmp_path: Path, trace_path: Path) -> list[str]:
    """``bench`` on a tiny trace with tiny chunks, tiers under ``tmp_path``."""
    for disk in ("warm", "cold"):
        (tmp_path / disk).mkdir(exist_ok=True)
    return [
        "bench",
        "--trace",
        str(trace_path),
        *SMALL,
        "--warm",
        str(tmp_path / "warm"),
        "--cold",
        str(tmp_path / "cold"),
        "--concurrency",
        "2",
        # in this process, where a test can watch: --jobs 2 has a test of its own
        "--jobs",
        "1",
    ]


def bench_args(tmp_path: Path, trace_path: Path, *extra: str) -> argparse.Namespace:
    argv = bench_argv(tmp_path, trace_path)
    return cli.parse_args([*argv, "--plot", str(tmp_path / "bench.png"), *extra])


def session_trace(tmp_path: Path) -> Path:
    """A: 3 full chunks + 100 tokens; B, 1 s later: A's prompt + 600 tokens;
    C: unrelated. (A is stored by then: its 0.1 GB of production KV take
    0.1 s on the warm drive.)"""
    return write_trace(
        tmp_path / "session.jsonl",
        [
            mooncake(0, 3 * CHUNK + 100, [7, 8]),
            mooncake(1000, 3 * CHUNK + 700, [7, 8, 9]),
            mooncake(1200, 300, [20]),
        ],
    )


def run(args: argparse.Namespace, name: str) -> report.RunResult:
    requests = scenario.load_requests(args)
    setup = scenario.make_setup(args, requests)
    workload = scenario.Workload.build(requests, setup.shape, args.seed)
    return variants.run_variant(name, setup, workload, name)


@pytest.mark.parametrize("variant", ["none", variants.LOCAL_DISK])
@pytest.mark.parametrize("hot_gb", ["0.05", "0"])
def test_served_chunks_per_tier(tmp_path: Path, variant: str, hot_gb: str) -> None:
    """B reuses A's 3 full chunks: from the CPU tier when there is one, else
    from disk (the plugin's warm tier, or the stock disk backend)."""
    args = bench_args(tmp_path, session_trace(tmp_path), "--hot-gb", hot_gb)
    result = run(args, variant)
    a, b, c = result.records
    assert [r.prompt_chunks for r in (a, b, c)] == [4, 6, 2]
    assert a.served == {} and c.served == {}
    assert b.served == b.found == ({"hot": 3} if hot_gb != "0" else {"warm": 3})
    assert all(r.arrival <= r.scheduled <= r.loaded <= r.first_token for r in (a, b))
    summary = report.summarize(result)
    assert summary["requests"] == 3
    tier = "hot" if hot_gb != "0" else "warm"
    assert summary["hit_rate"][tier] == pytest.approx(3 / 12)
    chunk = result.chunk_bytes
    assert chunk == CHUNK * 128
    if tier == "hot":
        assert summary["bytes_read"]["hot"] == 3 * chunk
    else:
        assert summary["bytes_read"]["warm"] == 3 * chunk
        if variant == "none":  # the plugin counts its own reads
            assert result.backend_metrics["tiers"]["warm"]["hits"] == 3


#: the in-process road, and lmcache server's with our plugin and the stock disk
LOADING_ROADS = [
    ("none", "sync"),
    ("none", "prefetch"),
    (variants.LOCAL_DISK, "prefetch"),
]


@pytest.mark.parametrize(("variant", "loading"), LOADING_ROADS)
def test_prefetched_loads_leave_the_engine_loop_to_other_requests(
    tmp_path: Path, variant: str, loading: str
) -> None:
    """B loads A's 3 chunks from a warm drive of 0.1 GB/s (1 s for their
    production bytes, written by then); C arrives 0.2 s after B. Loaded in
    the engine loop (``sync``, LMCache in-process) C waits for B's load;
    prefetched off it (``lmcache server``'s road) C is served while B loads,
    and B waits for its load without holding up anyone."""
    trace_path = write_trace(
        tmp_path / "slow.jsonl",
        [
            mooncake(0, 3 * CHUNK + 100, [7, 8]),
            mooncake(3000, 3 * CHUNK + 700, [7, 8, 9]),
            mooncake(3200, 300, [20]),
        ],
    )
    args = bench_args(
        tmp_path,
        trace_path,
        *("--hot-gb", "0", "--warm-drive", "0.1,0", "--loading", loading),
    )
    _, b, c = run(args, variant).records
    assert b.served == {"warm": 3}
    assert b.loaded - b.scheduled >= 0.9  # the drive's time for 3 chunks
    if loading == "sync":
        assert c.first_token >= b.loaded
    else:
        assert c.first_token < b.loaded - 0.5


def test_a_variants_process_stops_and_cleans_up_when_the_bench_is_killed(
    tmp_path: Path,
) -> None:
    """A bench killed with SIGKILL (or SIGTERM) cannot stop its variants'
    processes; each stops itself once its parent is gone, through its
    ``finally`` blocks (here: a marker file), even while its main thread
    waits on a lock, as the replay's does, and even if it inherited SIGINT
    ignored (a shell starts a job run with ``&`` so)."""
    script = tmp_path / "bench_parent.py"
    script.write_text(
        "import multiprocessing, signal, sys, threading, time\n"
        "def variant(marker):\n"
        "    from lmcache_tiered.bench.model.variants import stop_with_parent\n"
        "    stop_with_parent()\n"
        "    try:\n"
        "        print('ready', flush=True)\n"
        "        threading.Event().wait(60)\n"
        "    finally:\n"
        "        open(marker, 'w').write('done')\n"
        "if __name__ == '__main__':\n"
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as for a job run with &\n"
        "    context = multiprocessing.get_context('spawn')\n"
        "    context.Process(target=variant, args=(sys.argv[1],)).start()\n"
        "    time.sleep(120)\n"
    )
    marker = tmp_path / "cleaned"
    bench = subprocess.Popen(
        [sys.executable, str(script), str(marker)], stdout=subprocess.PIPE
    )
    try:
        assert bench.stdout is not None
        assert bench.stdout.readline() == b"ready\n"
        bench.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text():
                break
            time.sleep(0.05)
    finally:
        bench.kill()
        bench.wait()
    assert marker.read_text() == "done"


def test_arrival_hints_reach_the_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every arrival is hinted with its prompt, over the loopback endpoint."""
    hinted: list[list[int]] = []

    def record(self: TieredBackend, token_ids: Any = None, **kwargs: Any) -> None:
        hinted.append(list(token_ids))

    monkeypatch.setattr(TieredBackend, "hint", record)
    args = bench_args(tmp_path, session_trace(tmp_path))
    requests = scenario.load_requests(args)
    run(args, "none")
    blocks = trace.TokenBlocks(args.seed)
    assert sorted(hinted) == sorted(blocks.tokens(r).tolist() for r in requests)


def test_baseline_gets_local_capacity_only_when_cold_is_remote(
    tmp_path: Path,
) -> None:
    trace_path = session_trace(tmp_path)
    for extra, remote in ((("--cold-link", "none"), False), ((), True)):
        args = bench_args(
            tmp_path, trace_path, "--warm-gb", "1", "--cold-gb", "3", *extra
        )
        setup = scenario.make_setup(args, scenario.load_requests(args))
        assert setup.baseline_disk_gb == (1.0 if remote else 4.0)
        config = variants.engine_config(
            variants.LOCAL_DISK, setup, variants.VariantDirs([], [], [])
        )
        assert config.max_local_disk_size == setup.baseline_disk_gb
    # no cold tier at all: the stock backend gets what the plugin keeps, warm's
    args = bench_args(
        tmp_path, trace_path, "--warm-gb", "1", "--cold-gb", "3", "--cold", "none"
    )
    assert (
        scenario.make_setup(args, scenario.load_requests(args)).baseline_disk_gb == 1.0
    )


def test_baseline_disk_gives_the_stock_backend_its_own_directories(
    tmp_path: Path,
) -> None:
    """``--baseline-disk`` (e.g. one drive of a rig) is where LocalDiskBackend
    stores; the plugin's variants keep ``--warm``; the fresh dirs go after."""
    drives = [tmp_path / f"d{i}" for i in range(3)]
    for drive in drives:
        drive.mkdir()
    warm = ",".join(str(d) for d in drives)
    args = bench_args(
        tmp_path,
        session_trace(tmp_path),
        "--warm",
        warm,
        "--baseline-disk",
        str(drives[0]),
    )
    setup = scenario.make_setup(args, scenario.load_requests(args))
    assert setup.baseline_paths == (str(drives[0]),)
    stock = variants.VariantDirs.create(setup, variants.LOCAL_DISK)
    plugin = variants.VariantDirs.create(setup, "none")
    try:
        config = variants.engine_config(variants.LOCAL_DISK, setup, stock)
        assert config.local_disk == stock.baseline[0]
        assert Path(stock.baseline[0]).parent == drives[0]
        assert plugin.baseline == [] and len(plugin.warm) == 3
    finally:
        stock.remove()
        plugin.remove()
    assert sorted(p.name for d in drives for p in d.iterdir()) == []
    default_args = bench_args(tmp_path, session_trace(tmp_path), "--warm", warm)
    default = scenario.make_setup(default_args, scenario.load_requests(default_args))
    assert default.baseline_paths == default.warm_paths


def test_the_default_cpu_tier_holds_at_least_what_hbm_holds(tmp_path: Path) -> None:
    """A GPU host's DRAM per rank is at least its HBM: LMCache's CPU tier
    defaults to a quarter of the distinct KV, raised to what vLLM's HBM
    cache holds, never past the distinct KV itself."""
    gib = 1 << 30
    trace_path = write_trace(
        tmp_path / "big.jsonl",
        [
            mooncake(i * 100, 64 * CHUNK, list(range(32 * i, 32 * i + 32)))
            for i in range(8)
        ],
    )

    def setup(*extra: str) -> scenario.Setup:
        args = bench_args(tmp_path, trace_path, *extra)
        return scenario.make_setup(args, scenario.load_requests(args))

    small_hbm = setup("--gpu-kv-gb", "0")
    unique = 8 * 64 * CHUNK * small_hbm.shape.bytes_per_token
    assert small_hbm.hot_gb * gib == pytest.approx(
        max(unique / 4, small_hbm.staging_gb * gib)
    )
    hbm_tokens = 3 * 64 * CHUNK  # three of the eight prompts
    hbm_gb = hbm_tokens * small_hbm.profile.kv_bytes_per_token / 1e9
    some = setup("--gpu-kv-gb", f"{hbm_gb:.9f}")
    assert some.gpu_kv_tokens == pytest.approx(hbm_tokens, abs=1)
    assert some.hot_gb * gib == pytest.approx(
        max(hbm_tokens * some.shape.bytes_per_token, some.staging_gb * gib), rel=1e-3
    )
    assert setup("--gpu-kv-gb", "1e6").hot_gb * gib == pytest.approx(
        max(unique, small_hbm.staging_gb * gib)
    )
    assert setup("--gpu-kv-gb", "1e6", "--hot-gb", "0.5").hot_gb == 0.5


def test_stock_backend_reads_and_writes_through_its_modelled_drive(
    tmp_path: Path,
) -> None:
    """LocalDiskBackend's chunk files go through a drive of the warm kind, as
    the plugin's tiers do: the comparison is on the same modelled hardware."""
    args = bench_args(tmp_path, session_trace(tmp_path), "--hot-gb", "0")
    setup = scenario.make_setup(args, scenario.load_requests(args))
    dirs = variants.VariantDirs.create(setup, variants.LOCAL_DISK)
    built = variants.build_variant(variants.LOCAL_DISK, setup, dirs)
    try:
        drive = built.devices["disk"]
        assert drive.spec == setup.warm_drive and drive.count == 1
        tokens = torch.arange(2 * CHUNK)
        kv = torch.zeros(1, 2, 2 * CHUNK, 1, setup.shape.head_size).bfloat16()
        built.engine.store(tokens, kvcaches=kv)
        testing.wait_for_puts(built.engine, tokens)
        assert drive.transfers == 2 and drive.bytes == 2 * setup.chunk_bytes
        testing.retrieve_tokens(built.engine, tokens, kv=kv)
        assert drive.transfers == 4
        # production bytes at the drive's rate, the latency once a command
        production = 4 * setup.chunk_bytes * setup.shape.kv_scale
        assert drive.modelled_s == pytest.approx(
            production / (drive.spec.gbps * 1e9) + 4 * drive.spec.latency_s
        )
    finally:
        testing.destroy_engine(built.engine)
        dirs.remove()


@pytest.mark.parametrize("variant", ["none", variants.LOCAL_DISK])
def test_restart_starts_with_every_prompt_on_the_drives_and_none_in_memory(
    tmp_path: Path, variant: str
) -> None:
    """--restart: every distinct prompt is on the drives before the replay and
    LMCache's CPU tier is empty, so A and C, which no cache could serve
    without it, load all their whole chunks from the drive; the drive's
    figures count the replay only, not the fill."""
    args = bench_args(
        tmp_path, session_trace(tmp_path), "--hot-gb", "0.05", "--restart"
    )
    result = run(args, variant)
    a, b, c = result.records
    assert a.served == {"warm": 3} and c.served == {"warm": 1}
    assert sum(b.served.values()) == 5  # A's 3 chunks and its own 2
    assert result.backend_metrics["restart_fill"]["prompts"] == 3
    drive = result.backend_metrics["devices"][
        "disk" if variant == variants.LOCAL_DISK else "warm"
    ]
    from_drive = sum(r.served.get("warm", 0) for r in (a, b, c))
    assert drive["bench_bytes"] == from_drive * result.chunk_bytes


@pytest.mark.parametrize("restart", [False, True])
def test_the_bound_after_a_restart_starts_with_every_prompt_in_hbm(
    tmp_path: Path, restart: bool
) -> None:
    """The all-hot bound is vLLM with unbounded HBM: after --restart it holds
    every prompt the others hold on their drives, or it would be no bound."""
    args = bench_args(
        tmp_path, session_trace(tmp_path), *(["--restart"] if restart else [])
    )
    a, b, c = run(args, ALL_HOT).records
    if restart:  # B's own 2 chunks too, and A's and C's whole chunks
        assert b.served == {"gpu": 5}
        assert a.served.get("gpu", 0) > 0 and c.served.get("gpu", 0) > 0
    else:  # only A's prefix, held since A ran
        assert b.served == {"gpu": 3}
        assert a.served == {} and c.served == {}


@pytest.mark.parametrize(("variant", "loading"), LOADING_ROADS)
def test_prefetch_reads_the_chunks_vllm_holds_too(
    tmp_path: Path, variant: str, loading: str
) -> None:
    """After a restart, B's first 3 chunks (A's) are in vLLM's prefix cache
    and on the drive. In-process (``sync``) LMCache loads only B's 2 chunks
    past them. ``lmcache server`` (``prefetch``) reads all 5 its lookup
    found, as its prefetch does, and from the drive: its default prefetch
    policy kept none of A's chunks in its CPU tier after A read them (the
    in-process engine writes them back). Only 2 go into the KV cache."""
    args = bench_args(
        tmp_path,
        session_trace(tmp_path),
        *("--restart", "--hot-gb", "0.05", "--gpu-kv-gb", "80"),
        *("--loading", loading),
    )
    result = run(args, variant)
    a, b, c = result.records
    assert a.served == {"warm": 3} and c.served == {"warm": 1}
    assert b.served == {"gpu": 3, "warm": 2}
    drive = result.backend_metrics["devices"][
        "disk" if variant == variants.LOCAL_DISK else "warm"
    ]
    read = 3 + (5 if loading == "prefetch" else 2) + 1
    assert drive["bench_bytes"] == read * result.chunk_bytes
    # the report counts them too, for the stock backend from the records
    assert report.summarize(result)["bytes_read"]["warm"] == drive["bench_bytes"]
    assert b.read == ({"warm": 5} if loading == "prefetch" else {"warm": 2})


@pytest.mark.parametrize("loading", ["sync", "prefetch"])
def test_lmcache_server_answers_vllm_only_once_its_prefetch_is_done(
    tmp_path: Path, loading: str
) -> None:
    """After a restart, B repeats A's prompt once A is done: vLLM's prefix
    cache holds all of it. In-process LMCache has nothing to load; ``lmcache
    server`` still prefetches the 3 chunks its lookup found (from the drive:
    it kept none of A's in memory) and answers vLLM's lookup only then, so B
    waits the drive's time for them (1 s at 0.1 GB/s)."""
    trace_path = write_trace(
        tmp_path / "repeat.jsonl",
        [mooncake(0, 3 * CHUNK + 100, [7, 8]), mooncake(3000, 3 * CHUNK + 100, [7, 8])],
    )
    args = bench_args(
        tmp_path,
        trace_path,
        *("--restart", "--hot-gb", "0.05", "--gpu-kv-gb", "80"),
        *("--warm-drive", "0.1,0", "--loading", loading),
    )
    _, b = run(args, "none").records
    assert b.served == {"gpu": 3}
    if loading == "prefetch":
        assert b.loaded - b.scheduled >= 0.9
    else:
        assert b.loaded - b.scheduled < 0.1


@pytest.mark.parametrize(
    ("variant", "loading"),
    [("none", "sync"), ("none", "prefetch"), ("hinted", "prefetch")],
)
def test_a_hint_warms_l1_while_the_request_waits_for_a_slot(
    tmp_path: Path, variant: str, loading: str
) -> None:
    """One slot, held by A's long decode; B arrives meanwhile with 3 chunks
    on a drive of 0.1 GB/s (1 s). vLLM looks B up only once the slot frees
    (its scheduler's waiting loop stops at max_num_seqs), so both roads read
    them after A: in-process LMCache in the engine loop, ``lmcache server``
    in its prefetch. With arrival hints on the server's road (``hinted``:
    the plugin's warm prefetch) they are read into L1 while B waits, and B
    starts as soon as the slot frees."""
    trace_path = write_trace(
        tmp_path / "queued.jsonl",
        # A: no whole chunk, so nothing to load: it takes the slot at once
        [mooncake(0, 200, [20], out=400), mooncake(100, 3 * CHUNK + 100, [7, 8])],
    )
    args = bench_args(
        tmp_path,
        trace_path,
        *("--restart", "--hot-gb", "0.05", "--concurrency", "1"),
        *("--warm-drive", "0.1,0", "--loading", loading),
    )
    a, b = run(args, variant).records
    assert a.finished > b.arrival + 1.5  # the slot frees after B's read could end
    if variant == "hinted":
        assert b.served == {"hot": 3}  # L1: the warm prefetch read them
        assert b.first_token - a.finished < 0.5
    else:
        assert b.served == {"warm": 3}
        assert b.first_token - a.finished >= 0.9


def test_stock_prefetches_take_turns_on_the_drive(tmp_path: Path) -> None:
    """After a restart A and B arrive together, 4 chunks each on the stock
    backend's drive. On the server's road the stock baseline is LMCache's
    ``fs`` L2 adapter, each load task one read at a time: A's and B's reads
    take turns, so A's prefetch ends with B's (7 of B's 8 chunk times), not
    after its own 4 (first come, first done: half of B's wait)."""
    trace_path = write_trace(
        tmp_path / "together.jsonl",
        [
            mooncake(0, 4 * CHUNK + 100, [7, 8, 9]),
            mooncake(0, 4 * CHUNK + 100, [4, 5, 6]),
        ],
    )
    args = bench_args(
        tmp_path,
        trace_path,
        *("--restart", "--hot-gb", "0.05", "--warm-drive", "0.1,0"),
        *("--loading", "prefetch"),
    )
    a, b = sorted(run(args, variants.LOCAL_DISK).records, key=lambda r: r.loaded)
    assert a.served == b.served == {"warm": 4}
    assert (a.loaded - a.arrival) / (b.loaded - b.arrival) > 0.75


def test_follow_up_turn_waits_for_the_previous_one(tmp_path: Path) -> None:
    """A closed-loop turn arrives its think time after the previous finished."""
    requests = [
        Request(0.0, 300, 40, (1,)),
        Request(0.0, 400, 2, (1,), after=0, think_s=0.3),
    ]
    args = bench_args(tmp_path, session_trace(tmp_path))
    setup = scenario.make_setup(args, requests)
    workload = scenario.Workload.build(requests, setup.shape, 0)
    first, second = variants.run_variant("none", setup, workload, "x").records
    assert second.arrival >= first.finished + 0.3


def test_cli_writes_json_and_reports_missing_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    args = bench_args(
        tmp_path,
        session_trace(tmp_path),
        "--policies",
        "none,no-such-policy",
        "--no-baseline",
        "--json",
        str(out),
        "--plot",
        "none",
    )
    assert args.func(args) == 1  # a policy asked for did not run
    captured = capsys.readouterr()
    assert "no warm-up policy named 'no-such-policy'" in captured.out
    assert "picture:" not in captured.out
    assert not list(tmp_path.glob("*.png"))
    document = json.loads(out.read_text())
    assert list(document["policies"]) == ["none"]
    assert "no-such-policy" in document["unavailable"]
    entry = document["policies"]["none"]
    for key in (
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "throughput_rps",
        "throughput_tps",
        "warmup_precision",
    ):
        assert isinstance(entry[key], float | None), key
    # none plans nothing
    assert entry["warmup_held_back"] is None and entry["warmup_wasted_gb"] is None
    assert set(entry["hit_rate"]) == {"gpu", "hot", "warm", "cold"}
    assert entry["ttft_p50_s"] <= entry["ttft_p90_s"] <= entry["ttft_p99_s"]
    assert document["config"]["kv_scale"] == 1024
    assert document["config"]["warm_drive"] == {"gbps": 1.31, "latency_s": 0.0001}
    # the variants' directories are gone
    assert not [*(tmp_path / "warm").iterdir(), *(tmp_path / "cold").iterdir()]


def test_default_run_writes_the_picture_and_says_what_it_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's ``lmcache-tiered bench`` with defaults (here on a tiny
    trace): the cold tier is remote, a PNG lands in the current directory,
    and one line says what was compared and how it came out."""
    monkeypatch.chdir(tmp_path)
    argv = bench_argv(tmp_path, session_trace(tmp_path))
    assert cli.main([*argv, "--policies", "none,hinted", "--json", "r.json"]) == 0
    out = capsys.readouterr().out
    picture = tmp_path / cli_bench.DEFAULT_PLOT
    assert f"picture: {picture}" in out.splitlines()
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size > 20_000  # three panels drawn, not a blank page
    [summary] = [line for line in out.splitlines() if line.startswith("summary: ")]
    assert "cold remote behind 2.8 GB/s + 0.3 ms" in summary
    assert f"against vLLM alone ({NO_EXTERNAL_CACHE})" in summary
    lines = out.splitlines()
    invalid = {line.split(":")[0] for line in lines if command.NOT_VALID in line}
    if {"none", "hinted"} <= invalid:  # both fell behind their clock (a busy machine)
        assert "Not compared: no tiered variant's run is valid" in summary
    else:  # the best valid one is compared, the others beside
        assert f"{variants.LOCAL_DISK} " in summary and "all_hot_bound " in summary
    rows = [line.split()[0] for line in lines if line[:1].isalpha()]
    assert {"none", "hinted", variants.LOCAL_DISK, "all_hot_bound"} <= set(rows)
    config = json.loads((tmp_path / "r.json").read_text())["config"]
    assert config["cold_link"] == {"gbps": 2.8, "latency_s": 0.0003}


def test_jobs_replay_variants_in_processes_of_their_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--jobs 2: the variants with an engine run two at a time, each in a
    spawned process that builds the same workload from the seed; their
    results come back whole, and they find the same hits as in this one."""
    args = bench_args(
        tmp_path,
        session_trace(tmp_path),
        "--hot-gb",
        "0",
        "--policies",
        "none,hinted",
        "--jobs",
        "2",
        "--json",
        str(tmp_path / "r.json"),
        "--plot",
        "none",
    )
    assert args.func(args) == 0
    err = capsys.readouterr().err
    for name in ("none", "hinted", variants.LOCAL_DISK):
        assert re.search(rf"\] {name} .* done in \d+s", err), err
    policies = json.loads((tmp_path / "r.json").read_text())["policies"]
    for name in ("none", "hinted", variants.LOCAL_DISK):
        # B's three chunks of A, from disk (no CPU tier)
        assert policies[name]["hit_rate"]["warm"] == pytest.approx(3 / 12), name
        assert policies[name]["requests"] == 3
    assert not [*(tmp_path / "warm").iterdir(), *(tmp_path / "cold").iterdir()]


def test_bench_refuses_an_unwritable_picture_path_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = bench_args(
        tmp_path, session_trace(tmp_path), "--plot", str(tmp_path / "no" / "x.png")
    )
    began = time.monotonic()
    assert args.func(args) == 2
    assert time.monotonic() - began < 5
    assert "--plot none for no picture" in capsys.readouterr().err


def entry(ttft: float, tps: float, valid: bool = True) -> dict[str, Any]:
    """A summary with what the summary line and the table read."""
    return {
        "ttft_p50_s": ttft,
        "throughput_tps": tps,
        "valid": valid,
        "load_p50_s": 0.5,
        "hit_rate": {"gpu": 0.2, "hot": 0.1, "warm": 0.2, "cold": 0.0},
    }


def test_summary_line_judges_the_best_valid_variant_against_vllm_alone() -> None:
    contenders = ["none", "hinted"]
    beside = [variants.LOCAL_DISK, ALL_HOT]
    won = report.summary_line(
        {
            "none": entry(3.0, 280),
            "hinted": entry(2.0, 300),
            NO_EXTERNAL_CACHE: entry(4.0, 250),
            variants.LOCAL_DISK: entry(5.0, 240),
        },
        "A vs B",
        contenders,
        NO_EXTERNAL_CACHE,
        beside,
    )
    assert won == (
        "summary: A vs B. Best tiered variant hinted: TTFT p50 2.00s vs 4.00s "
        "no_external_cache (-50%), 300 vs 250 tok/s (+20%); lmcache_local_disk "
        "5.00s (+25%), 240 tok/s: hinted serves first tokens sooner and at least "
        "as many tok/s."
    )
    lost = report.summary_line(
        {"none": entry(3.0, 280), NO_EXTERNAL_CACHE: entry(2.0, 300)},
        "A",
        contenders,
        NO_EXTERNAL_CACHE,
        beside,
    )
    assert lost is not None and "no_external_cache wins here: LMCache served" in lost
    # an invalid variant is never the best; with none valid, nothing is compared
    skipped = report.summary_line(
        {
            "none": entry(3.0, 280),
            "hinted": entry(1.0, 400, valid=False),
            NO_EXTERNAL_CACHE: entry(4.0, 250),
        },
        "A",
        contenders,
        NO_EXTERNAL_CACHE,
        beside,
    )
    assert skipped is not None and "Best tiered variant none:" in skipped
    nothing = report.summary_line(
        {"none": entry(3.0, 280, valid=False), NO_EXTERNAL_CACHE: entry(4.0, 250)},
        "A",
        contenders,
        NO_EXTERNAL_CACHE,
        beside,
    )
    assert nothing is not None and "Not compared: no tiered variant" in nothing
    assert (
        report.summary_line(
            {"none": entry(3.0, 280)}, "A", contenders, NO_EXTERNAL_CACHE, beside
        )
        is None
    )


def test_bound_share_is_the_part_of_the_bounds_gain_a_policy_captures() -> None:
    summaries = {
        "none": entry(10.0, 100),
        "hinted": entry(7.0, 110),
        "session": entry(11.0, 100),
        "lookahead": entry(1.0, 100, valid=False),
        ALL_HOT: entry(4.0, 130),
    }
    shares = report.bound_shares(
        summaries, ["hinted", "session", "lookahead"], "none", ALL_HOT
    )
    assert shares == {"hinted": pytest.approx(0.5), "session": pytest.approx(-1 / 6)}
    summaries[ALL_HOT] = entry(10.0, 100)  # the bound gains nothing: no share
    assert report.bound_shares(summaries, ["hinted"], "none", ALL_HOT) == {}


def test_validity_judges_lag_against_ttft_and_overrun_against_device_time() -> None:
    assert report.validity(0.04, 1.0, 0.0)["valid"]
    late = report.validity(0.06, 1.0, 0.0)
    assert not late["valid"] and late["lag_share"] == pytest.approx(0.06)
    assert report.validity(0.0, 1.0, 0.09)["valid"]
    assert not report.validity(0.0, 1.0, 0.11)["valid"]
    note = command.invalid_note(
        "none", {**report.validity(0.2, 1.0, 0.3), "lag_max_s": 0.2}
    )
    assert "20% of its TTFT p50" in note and "30% longer than the modelled" in note
    assert "--kv-scale" in note and "fewer --jobs" in note


def test_repeats_rotate_the_order_and_report_paired_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    run_variant = variants.run_variant

    def recorded(name: str, *args: Any) -> report.RunResult:
        order.append(name)
        return run_variant(name, *args)

    monkeypatch.setattr(variants, "run_variant", recorded)
    out = tmp_path / "r.json"
    args = bench_args(
        tmp_path,
        session_trace(tmp_path),
        "--policies",
        "none,lookahead",
        "--repeat",
        "2",
        "--json",
        str(out),
    )
    assert args.func(args) == 0
    # the variants without an engine first (they take no time), then no
    # variant always runs first (or right after the same one)
    assert order == [
        NO_EXTERNAL_CACHE,
        ALL_HOT,
        "none",
        "lookahead",
        variants.LOCAL_DISK,
        NO_EXTERNAL_CACHE,
        ALL_HOT,
        "lookahead",
        variants.LOCAL_DISK,
        "none",
    ]
    assert "change vs none, paired runs" in capsys.readouterr().out
    policies = json.loads(out.read_text())["policies"]
    for name in ("lookahead", NO_EXTERNAL_CACHE, variants.LOCAL_DISK):
        assert len(policies[name]["paired_change_vs_none"]["ttft_p50_s"]) == 2
    assert "paired_change_vs_none" not in policies["none"]


def test_policies_default_to_no_warm_up_and_hints_or_all_installed() -> None:
    assert command.chosen_policies(None) == ["none", "hinted"]
    every = command.chosen_policies("all")
    assert every[0] == "none" and {"hinted", "session", "lookahead"} <= set(every)
    assert command.chosen_policies("session, none") == ["session", "none"]


def test_a_policy_named_twice_runs_twice_as_an_a_a_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert variants.number_twins(["none", "hinted", "none", "none"]) == [
        "none",
        "hinted",
        "none#2",
        "none#3",
    ]
    given = ["none", "none#2", "none"]
    assert variants.number_twins(given) == ["none", "none#2", "none#3"]
    out = tmp_path / "aa.json"
    args = bench_args(
        tmp_path,
        session_trace(tmp_path),
        "--policies",
        "none,none",
        "--no-baseline",
        "--repeat",
        "2",
        "--json",
        str(out),
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "(none#2: none again, so its change is" in printed
    assert "summary:" not in printed  # none#2 is the noise, not a contender
    policies = json.loads(out.read_text())["policies"]
    assert list(policies) == ["none", "none#2"]
    twin = policies["none#2"]
    assert twin["requests"] == policies["none"]["requests"] > 0
    assert len(twin["paired_change_vs_none"]["ttft_p50_s"]) == 2
    assert [m["warmup"]["policy"] for m in twin["backend_metrics"]] == ["none"] * 2


def test_several_concurrencies_run_each_and_print_the_seeds_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--concurrency 1,2``: every variant at each concurrency, each
    concurrency's table, then the seed's table over both, the JSON per
    concurrency, one picture of both."""
    ran: list[tuple[int, str]] = []
    run_variant = variants.run_variant

    def recorded(name: str, setup: scenario.Setup, *args: Any) -> report.RunResult:
        ran.append((setup.concurrency, name))
        return run_variant(name, setup, *args)

    monkeypatch.setattr(variants, "run_variant", recorded)
    out, picture = tmp_path / "r.json", tmp_path / "both.png"
    argv = bench_argv(tmp_path, session_trace(tmp_path))
    at = argv.index("--concurrency") + 1
    assert argv[at] == "2"
    argv[at] = "1,2"
    extra = ["--policies", "none", "--repeat", "2", "--json", str(out)]
    assert cli.main([*argv, *extra, "--plot", str(picture)]) == 0
    # the variants in their first run's order: those without an engine
    # first in each round, then the rest rotated; the same rounds at each
    # concurrency, one after the other
    names = [NO_EXTERNAL_CACHE, ALL_HOT, "none", variants.LOCAL_DISK]
    rotated = names + [NO_EXTERNAL_CACHE, ALL_HOT, variants.LOCAL_DISK, "none"]
    assert ran == [(1, n) for n in rotated] + [(2, n) for n in rotated]
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert "concurrency 1:" in lines and "concurrency 2:" in lines
    assert printed.count("change vs none, paired runs") == 2
    sections = printed.split("\nconcurrency ")[1:]
    assert [section.split(":")[0] for section in sections] == ["1", "2"]
    for level, section in zip((1, 2), sections, strict=True):
        # the targets line, or, where this machine made the policy's run not
        # valid, the note saying why (its load made the replay lag 6 % of its
        # TTFT p50 in CI; the VM's disk ran slower than the modelled drive here)
        targets = f"{NO_EXTERNAL_CACHE}, concurrency {level}): TTFT p50" in section
        assert targets or f"none{command.NOT_VALID}" in section
    [head] = [i for i, line in enumerate(lines) if line.startswith("seed's table:")]
    assert lines.index("concurrency 2:") < head
    assert "median (lowest..highest) of 2 runs" in lines[head]
    header = lines[head + 1].split()
    assert header[:5] == ["variant", "concurrency", "TTFT", "p50", "p90"]
    assert f"vs {NO_EXTERNAL_CACHE}" in lines[head + 1]
    rows = [line.split() for line in lines[head + 3 : head + 3 + 2 * len(names)]]
    assert [(r[0], r[1]) for r in rows] == [(n, c) for n in names for c in "12"]
    document = json.loads(out.read_text())
    assert document["config"]["concurrency"] == [1, 2]
    assert list(document["by_concurrency"]) == ["1", "2"]
    for level, each in document["by_concurrency"].items():
        # each is the document a run at that one concurrency writes
        assert set(each) == {"config", "policies", "unavailable"}
        assert each["config"]["concurrency"] == int(level)
        assert list(each["policies"]) == names
    table = document["seed_table"]
    assert [(r["variant"], r["concurrency"]) for r in table] == [
        (n, c) for n in names for c in (1, 2)
    ]
    for row, cells in zip(table, rows, strict=True):
        entry = document["by_concurrency"][str(row["concurrency"])]["policies"]
        runs = entry[row["variant"]]["per_run"]["ttft_p50_s"]
        p50 = row["ttft_p50_s"]
        assert (p50["min"], p50["max"]) == (min(runs), max(runs))
        assert cells[2:4] == [
            f"{p50['median']:.2f}s",
            f"({p50['min']:.2f}..{p50['max']:.2f})",
        ]
        base = entry[NO_EXTERNAL_CACHE]["per_run"]["ttft_p50_s"]
        change = row["change_vs"][NO_EXTERNAL_CACHE]
        if row["variant"] == NO_EXTERNAL_CACHE:
            assert change is None
        else:
            paired = [v / b - 1 for v, b in zip(runs, base, strict=True)]
            assert change["ttft_p50_s"]["min"] == pytest.approx(min(paired))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size > 20_000  # two panels of bars, not a blank page


@pytest.mark.parametrize("given", ["0", "8,x", "8,,-1", "8,8"])
def test_a_bad_concurrency_list_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    argv = bench_argv(tmp_path, session_trace(tmp_path))
    argv[argv.index("--concurrency") + 1] = given
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --concurrency: {given!r}" in err
    assert "e.g. 8 or 8,16" in err or "given twice" in err


def test_seed_table_ranges_and_changes_against_both_references() -> None:
    def entry(
        ttft: list[float], tps: list[float], valid: bool = True
    ) -> dict[str, Any]:
        per_run = {"ttft_p50_s": ttft, "ttft_p90_s": ttft, "throughput_tps": tps}
        return {"runs": len(ttft), "per_run": per_run, "valid": valid}

    by_concurrency = {
        8: {
            "none": entry([20.0, 30.0], [100.0, 90.0]),
            "hinted": entry([10.0, 24.0], [120.0, 98.0]),
            NO_EXTERNAL_CACHE: entry([16.0, 20.0], [100.0, 100.0]),
        },
        16: {"hinted": entry([5.0, 7.0], [200.0, 220.0])},
    }
    references = (NO_EXTERNAL_CACHE, "none")
    rows = report.seed_rows(by_concurrency, references)
    assert [(r["variant"], r["concurrency"]) for r in rows] == [
        ("none", 8),
        ("hinted", 8),
        ("hinted", 16),
        (NO_EXTERNAL_CACHE, 8),
    ]
    hinted = rows[1]
    assert hinted["ttft_p50_s"] == {"median": 17.0, "min": 10.0, "max": 24.0}
    vs_gpu = hinted["change_vs"][NO_EXTERNAL_CACHE]["ttft_p50_s"]
    assert (vs_gpu["min"], vs_gpu["max"]) == pytest.approx((-0.375, 0.2))
    assert hinted["change_vs"]["none"]["throughput_tps"]["max"] == pytest.approx(0.2)
    assert rows[2]["change_vs"] == {NO_EXTERNAL_CACHE: None, "none": None}
    text = report.seed_table(rows, references).splitlines()
    assert text[0].split()[:2] == ["variant", "concurrency"]
    assert text[3].split() == [
        "hinted",
        "8",
        "17.00s",
        "(10.00..24.00)",
        "17.00s",
        "(10.00..24.00)",
        "109",
        "(98..120)",
        "-9%",
        "(-38..+20)",
        "+9%",
        "(-2..+20)",
        "-35%",
        "(-50..-20)",
        "+14%",
        "(+9..+20)",
    ]
    assert text[4].split()[-4:] == ["-", "-", "-", "-"]
    # one run: the value alone, no range
    one = {
        "runs": 1,
        "ttft_p50_s": 2.0,
        "ttft_p90_s": 3.0,
        "throughput_tps": 50.0,
        "valid": True,
    }
    rows = report.seed_rows({8: {"none": one}}, references)
    line = report.seed_table(rows, references).splitlines()[2]
    assert line.split() == ["none", "8", "2.00s", "3.00s", "50", "-", "-", "-", "-"]
    # a run that measured this machine is shown, but compared with nothing
    by_concurrency[8]["hinted"]["valid"] = False
    rows = report.seed_rows(by_concurrency, references)
    text = report.seed_table(rows, references).splitlines()
    assert text[3].count("not valid") == 4 and "-35%" not in text[3]


def test_percentile_interpolates() -> None:
    assert report.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert report.percentile([5.0], 99) == 5.0
    assert math.isclose(report.percentile(list(map(float, range(101))), 90), 90.0)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    record = report.RequestRecord(0.0, 0.1, 0.2, 0.5, 1.0, 300, 5, 2)
    result = report.RunResult(
        "none", [record, record], 1024, None, {}, None, None, None, 1
    )
    stock = report.RunResult("stock", [record], 1024, None, {}, None, None, None, 1)
    summaries = {"none": report.summarize(result), "stock": report.summarize(stock)}
    path = tmp_path / "bench.png"
    ttfts = {"none": report.ttfts(result) * 2, "stock": report.ttfts(stock)}
    plot.draw_run(str(path), ttfts, summaries, "A vs B", "none", "stock")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeated_runs_combine_to_medians() -> None:
    runs = [
        {
            "ttft_p50_s": t,
            "ttft_p90_s": t,
            "ttft_mean_s": t,
            "throughput_rps": 1.0,
            "throughput_tps": 1.0,
            "hit_rate": {"hot": h},
            "warmup_precision": p,
            "backend_metrics": {},
            **report.validity(lag, t, 0.0),
        }
        for t, h, p, lag in (
            (3.0, 0.1, None, 0.0),
            (1.0, 0.3, 0.5, 0.1),
            (2.0, 0.2, None, 0.0),
        )
    ]
    combined = report.combine(runs)
    assert combined["ttft_p50_s"] == 2.0
    assert combined["hit_rate"] == {"hot": 0.2}
    assert combined["warmup_precision"] == 0.5
    assert combined["runs"] == 3 and combined["backend_metrics"] == [{}, {}, {}]
    assert combined["per_run"]["ttft_p50_s"] == [3.0, 1.0, 2.0]
    assert report.combine(runs[:1])["warmup_precision"] is None
    # a variant is as valid as its worst run
    assert combined["lag_share"] == pytest.approx(0.1) and not combined["valid"]


def test_paired_changes_compare_run_i_with_run_i_of_none() -> None:
    def entry(ttft: list[float], tps: list[float]) -> dict[str, object]:
        per_run = {
            "ttft_p50_s": ttft,
            "ttft_p90_s": ttft,
            "ttft_mean_s": ttft,
            "throughput_tps": tps,
        }
        return {"per_run": per_run}

    summaries = {
        "none": entry([2.0, 4.0, 3.0], [100.0, 100.0, 50.0]),
        "hinted": entry([1.0, 3.0, 3.3], [110.0, 100.0, 60.0]),
    }
    changes = report.paired_changes(summaries)
    assert list(changes) == ["hinted"]
    assert changes["hinted"]["ttft_p50_s"] == pytest.approx([-0.5, -0.25, 0.1])
    assert changes["hinted"]["throughput_tps"] == pytest.approx([0.1, 0.0, 0.2])
    assert "-25% (-50..+10)" in report.spread_table(changes)
    # one run each: nothing to pair
    assert report.paired_changes({"none": {}, "hinted": {}}) == {}


def test_gpu_copies_are_charged_at_the_profile_link(tmp_path: Path) -> None:
    args = bench_args(tmp_path, session_trace(tmp_path))
    setup = scenario.make_setup(args, scenario.load_requests(args))
    config = testing.build_config(max_local_cpu_size_gb=0.05)
    engine, _ = testing.build_engine(
        config, num_layers=1, num_kv_heads=1, head_size=setup.shape.head_size
    )
    try:
        copies = GpuCopies(engine, setup)
        tokens = torch.arange(2 * CHUNK)
        kv = torch.zeros(1, 2, 2 * CHUNK, 1, setup.shape.head_size).bfloat16()
        engine.store(tokens, kvcaches=kv)
        testing.retrieve_tokens(engine, tokens, kv=kv)
        # the production bytes, down then up
        nbytes = 2 * 2 * CHUNK * setup.profile.kv_bytes_per_token
        assert copies.modelled_s == pytest.approx(
            nbytes / setup.profile.pcie_bytes_per_s
        )
        assert copies.measured_s > 0
    finally:
        testing.destroy_engine(engine)


# ----------------------------------------------------------------- diskbench

#: the smallest diskbench: one placement of 32 chunks of 1 MiB, one round
TINY_DISKBENCH = ["--chunk-mb", "1", "--total-gb", "0.03", "--placements", "1"]


def test_diskbench_runs_without_the_rust_extension(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMCache always ships RustRawBlockBackend's Python wrapper; without the
    Rust extension (here: a name no package provides) its column is null,
    with why, and the rest runs."""
    monkeypatch.setattr(diskbench, "RUST_EXTENSION", "lmcache_rust_raw_block_io_x")
    out = tmp_path / "d.json"
    work = tmp_path / "work"
    work.mkdir()
    argv = ["diskbench", "--workdir", str(work), *TINY_DISKBENCH, "--rounds", "1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rust_raw_block_read_gbps"] is None
    assert result["rust_raw_block_unavailable"] == diskbench.RUST_MISSING
    assert result["lmcache_local_disk_read_gbps"] > 0 and result["tiered_read_gbps"] > 0
    assert (
        f"RustRawBlockBackend n/a: {diskbench.RUST_MISSING}" in capsys.readouterr().out
    )
    assert list(work.iterdir()) == []


def test_diskbench_refuses_to_fill_a_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    argv = ["diskbench", "--workdir", str(tmp_path), "--total-gb", f"{free_gb:.0f}"]
    began = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - began < 10
    assert "GB free: lower --total-gb" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_diskbench_fails_in_seconds_when_a_contender_cannot_store(
    tmp_path: Path,
) -> None:
    """Writes that fail (here: files capped at 256 KiB by RLIMIT_FSIZE, in a
    child process) end the run after STALL_S seconds without progress, with
    the error a test write gets, instead of a long wait."""

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    argv = ["diskbench", "--workdir", str(tmp_path), *TINY_DISKBENCH]
    began = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-m", "lmcache_tiered.cli", *argv],
        preexec_fn=small_files,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - began
    assert child.returncode == 2, child.stderr[-2000:]
    message = child.stderr.splitlines()[-1]
    if diskbench.rust_unavailable() is None:
        # RustRawBlockBackend's device file is made first, and cannot be
        assert message.startswith("diskbench: rust_raw_block: cannot create")
        assert message.endswith("File too large"), message
    else:
        # (LMCache's LocalDiskBackend takes the short write for a stored
        # chunk; TieredBackend, filled next, gets EFBIG)
        assert re.match(r"diskbench: \w+ stored \d+ of 32 chunks", message), message
        assert f"none in the last {diskbench.STALL_S:g} s" in message
        assert "fails: File too large" in message
    # the stall window, plus starting Python, torch and LMCache on a busy machine
    assert elapsed < diskbench.STALL_S + 60
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------ GPU prefix cache


def test_reference_profile_gpu_kv_budget() -> None:
    """0.9 x 141 GB - 480.1e9 FP8 weights / 8 - 4 GB = 62.9 GB per rank."""
    profile = get_profile("qwen3-coder-480b-fp8-tp8")
    assert profile.total_params == pytest.approx(480.1e9, rel=1e-3)
    assert profile.gpu_kv_budget_bytes == pytest.approx(62.89e9, rel=1e-3)
    assert profile.gpu_kv_tokens == int(profile.gpu_kv_budget_bytes // 31_744)


def test_gpu_prefix_cache_hits_whole_blocks_and_evicts_lru_tail_first() -> None:
    a = Request(0.0, 2 * BLOCK_TOKENS + 40, 1, (1, 2, 3))
    a_again = Request(0.0, 3 * BLOCK_TOKENS, 1, (1, 2, 3))
    cache = GpuPrefixCache(capacity_tokens=4 * BLOCK_TOKENS)
    assert cache.hit_tokens(a) == 0
    cache.hold(0, a, a.input_length)
    # the third block holds 32 of A's 40 tokens (two whole 16-token blocks)
    assert cache.used == 2 * BLOCK_TOKENS + 32
    assert cache.hit_tokens(a_again) == 2 * BLOCK_TOKENS + 32
    # the same prompt again: all but its last token's block
    assert cache.hit_tokens(a) == 2 * BLOCK_TOKENS + 32
    cache.release(0, a)
    b = Request(0.0, 3 * BLOCK_TOKENS, 1, (7, 8, 9))
    cache.hold(1, b, b.input_length)  # 3 more blocks than fit: A's tail goes first
    assert cache.used <= cache.capacity
    assert cache.hit_tokens(a_again) == BLOCK_TOKENS
    cache.release(1, b)
    held = GpuPrefixCache(capacity_tokens=BLOCK_TOKENS)
    held.hold(2, b, b.input_length)  # running requests are never evicted
    assert held.hit_tokens(Request(0.0, 2 * BLOCK_TOKENS, 1, (7, 8))) == (
        2 * BLOCK_TOKENS - 16
    )


def test_a_prefill_takes_its_room_chunk_by_chunk() -> None:
    """vLLM allocates a prompt's blocks as it schedules each chunk: a long
    prefill evicts a finished request's blocks while it runs, not only at its
    end; a request holding a block through several calls releases it once."""
    done = Request(0.0, 2 * BLOCK_TOKENS, 1, (1, 2))
    long = Request(0.0, 4 * BLOCK_TOKENS, 1, (5, 6, 7, 8))
    cache = GpuPrefixCache(capacity_tokens=4 * BLOCK_TOKENS)
    cache.hold(0, done, done.input_length)
    cache.release(0, done)
    cache.hold(1, long, BLOCK_TOKENS)  # its first chunk: room for both
    assert cache.hit_tokens(done) == 2 * BLOCK_TOKENS - 16
    cache.hold(1, long, 3 * BLOCK_TOKENS)  # its third block pushes done's tail out
    assert cache.used == 4 * BLOCK_TOKENS
    assert cache.hit_tokens(done) == BLOCK_TOKENS
    cache.hold(1, long, 3 * BLOCK_TOKENS)  # again: held once
    cache.release(1, long)
    other = Request(0.0, 4 * BLOCK_TOKENS, 1, (11, 12, 13, 14))
    cache.hold(2, other, other.input_length)  # long's blocks were freed: evictable
    assert cache.used == 4 * BLOCK_TOKENS
    assert cache.hit_tokens(long) == 0


@pytest.mark.parametrize("variant", ["none", "no_external_cache"])
def test_gpu_prefix_cache_serves_reuse_before_lmcache(
    tmp_path: Path, variant: str
) -> None:
    """With room in HBM, B's 3 chunks of A come from the GPU, not LMCache;
    no_external_cache runs no LMCache at all and recomputes C."""
    args = bench_args(
        tmp_path, session_trace(tmp_path), "--hot-gb", "0.05", "--gpu-kv-gb", "80"
    )
    result = run(args, variant)
    a, b, c = result.records
    assert b.served == b.found == {"gpu": 3}
    assert a.served == {} and c.served == {}
    summary = report.summarize(result)
    assert summary["hit_rate"]["gpu"] == pytest.approx(3 / 12)
    assert summary["bytes_read"]["hot"] == 0
    gpu = result.backend_metrics["gpu_prefix_cache"]
    assert gpu["hit_tokens"] == 3 * CHUNK + 96  # B's whole 16-token blocks of A
    if variant == "no_external_cache":
        assert set(result.backend_metrics) == {"gpu_prefix_cache"}


def test_lmcache_loads_only_past_the_gpu_share(tmp_path: Path) -> None:
    """A GPU cache of 2 blocks keeps only part of A: B gets 1 chunk from the
    GPU (the 512 tokens aligned down to LMCache's 256) and the rest from
    LMCache's CPU tier."""
    gb = 2 * BLOCK_TOKENS * get_profile("llama-3.1-8b-tp1").kv_bytes_per_token / 1e9
    trace_path = write_trace(
        tmp_path / "t.jsonl",
        [
            mooncake(0, 4 * CHUNK + 100, [7, 8, 9]),
            # evicts A's tail block (9), then A's second (8): A's head remains
            mooncake(500, BLOCK_TOKENS, [30]),
            mooncake(1500, 4 * CHUNK + 300, [7, 8, 9]),
        ],
    )
    args = bench_args(tmp_path, trace_path, "--hot-gb", "0.05", "--gpu-kv-gb", str(gb))
    a, _, b = run(args, "none").records
    assert b.found == {"gpu": 2, "hot": 2}
    assert b.served == {"gpu": 2, "hot": 2}


# -------------------------------------------------------------- presets


def test_prefix_reuse_is_an_infinite_cache_hit_ratio() -> None:
    requests = [
        Request(0.0, 2 * BLOCK_TOKENS, 1, (1, 2)),
        Request(1.0, 2 * BLOCK_TOKENS + 100, 1, (1, 2, 3)),
    ]
    assert trace.prefix_reuse(requests) == pytest.approx(
        2 * BLOCK_TOKENS / (4 * BLOCK_TOKENS + 100)
    )
    long = trace.generate("long")
    # more distinct tokens than the reference profile's HBM budget
    assert (
        trace.unique_tokens(long)
        > get_profile("qwen3-coder-480b-fp8-tp8").gpu_kv_tokens
    )
    assert min(r.input_length for r in long) >= 64_000


def test_preset_sets_what_the_command_line_left_at_its_default(
    tmp_path: Path,
) -> None:
    args = bench_args(
        tmp_path, session_trace(tmp_path), "--preset", "seed-r2", "--cold-link", "1,1"
    )
    presets.apply(args.preset, args, args.preset_defaults, cli_bench.PRESET_PARSE)
    assert args.workload == "long"
    # given on the command line: kept
    assert args.cold_link == DeviceSpec(1.0, 0.001)
    assert args.kv_scale == 1024 and args.profile == "llama-3.1-8b-tp1"


def test_seed_preset_without_overrides_is_the_documented_point(tmp_path: Path) -> None:
    args = cli.parse_args(["bench", "--preset", "seed-r2"])
    presets.apply(args.preset, args, args.preset_defaults, cli_bench.PRESET_PARSE)
    assert (args.profile, args.workload, args.kv_scale) == (
        "qwen3-coder-480b-fp8-tp8",
        "long",
        16.0,
    )
    assert args.cold_link == DeviceSpec(5.23, 0.0001)
    assert args.warm_drive == DeviceSpec(1.31, 0.0001)


def test_fleet_and_boundary_presets_are_the_documented_points() -> None:
    """fleet: returning sessions whose KV sits mostly in a cold tier slower
    than warm; boundary: one-shot random access, little reuse."""
    args = cli.parse_args(["bench", "--preset", "fleet"])
    presets.apply(args.preset, args, args.preset_defaults, cli_bench.PRESET_PARSE)
    assert (args.workload, args.restart, args.warm_gb) == ("agent", True, 1.2)
    per_token = bench_shape(get_profile(args.profile), args.kv_scale).bytes_per_token
    distinct = trace.unique_tokens(trace.generate("agent")) * per_token
    assert args.warm_gb * 2**30 < distinct / 3  # most of it only in cold
    assert args.cold_link.gbps < cli_bench.DEFAULT_WARM_DRIVES * args.warm_drive.gbps
    args = cli.parse_args(["bench", "--preset", "boundary"])
    presets.apply(args.preset, args, args.preset_defaults, cli_bench.PRESET_PARSE)
    one_shot = trace.generate(args.workload)
    assert trace.prefix_reuse(one_shot) < 0.3
    assert all(r.after is None for r in one_shot)  # no turn follows another


def _summary(ttft: float, tps: float) -> dict[str, float]:
    return {"ttft_p50_s": ttft, "throughput_tps": tps}


def test_targets_line_judges_the_best_policy_against_the_seed() -> None:
    summaries = {
        "none": _summary(20.0, 100.0),
        "hinted": _summary(10.0, 150.0),
        "none#2": _summary(21.0, 100.0),
        NO_EXTERNAL_CACHE: _summary(15.0, 110.0),
    }
    changes = {
        "none#2": {"ttft_p50_s": [0.05, -0.05], "throughput_tps": [0.01, -0.01]},
        "hinted": {"ttft_p50_s": [-0.5, -0.4], "throughput_tps": [0.5, 0.4]},
    }
    line = presets.targets_line(summaries, changes, 8, ["none", "hinted"])
    assert line is not None
    assert "best policy hinted" in line
    assert "TTFT p50 -33% (target -26% or better: met)" in line
    assert "tok/s +36% (target +29% or better: met)" in line
    assert line.count("beyond the A/A range") == 2 and "NOT beyond" not in line
    at_16 = presets.targets_line(summaries, changes, 16, ["none", "hinted"])
    assert at_16 is not None and "(target +40% or better: NOT met)" in at_16
    assert presets.targets_line(summaries, changes, 8, []) is None
    summaries.pop(NO_EXTERNAL_CACHE)
    assert presets.targets_line(summaries, changes, 8, ["hinted"]) is None


def test_a_variant_not_valid_beside_others_is_replayed_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Variants replayed at once share the cores: one that fell behind its
    clock there is replayed once more alone, and that run is the one kept."""
    record = report.RequestRecord(0.0, 0.1, 0.2, 10.0, 11.0, 300, 5, 2)

    def run(name: str, lag_s: float) -> report.RunResult:
        return report.RunResult(
            name, [record], 1024, None, {}, None, None, None, 1, lag_max=lag_s
        )

    # none fell 2 s behind a 10 s TTFT p50 beside hinted (20 %: not valid)
    monkeypatch.setattr(
        rounds,
        "_apart",
        lambda names, *_: [run(n, 2.0 if n == "none" else 0.1) for n in names],
    )
    alone: list[str] = []

    def run_alone(name: str, setup: Any, workload: Any, label: str) -> Any:
        alone.append(label)
        return run(name, 0.05)

    monkeypatch.setattr(variants, "run_variant", run_alone)
    setup = argparse.Namespace(concurrency=8)
    runs, unavailable = rounds.run_rounds(
        ["none", "hinted"], [setup], argparse.Namespace(), repeat=1, jobs=2
    )
    assert alone == ["[1/2] none (alone)"] and not unavailable
    assert [r.lag_max for r in runs[8]["none"]] == [0.05]
    assert [r.lag_max for r in runs[8]["hinted"]] == [0.1]


def test_the_table_gives_what_warm_up_wasted_and_kept_off_the_drives() -> None:
    record = report.RequestRecord(0.0, 0.1, 0.2, 0.5, 1.0, 300, 5, 2)
    warmup = {
        "plans": 3,
        "bytes_wasted": 2_000_000_000,
        "bytes_used": 4_000_000_000,
        "bytes_used_in_place": 1_000_000_000,
    }
    hinted = report.RunResult(
        "hinted", [record], 1024, None, {"warmup": warmup}, 0.7, 0.9, 0, 1
    )
    none = report.RunResult("none", [record], 1024, None, {}, None, None, None, 1)
    summaries = {
        n: report.summarize(r) for n, r in (("none", none), ("hinted", hinted))
    }
    assert summaries["hinted"]["warmup_wasted_gb"] == 2.0
    assert summaries["hinted"]["warmup_kept_off_gb"] == 5.0
    assert summaries["none"]["warmup_kept_off_gb"] is None
    rows = report.table(summaries, "none").splitlines()
    assert "GB waste/kept off" in rows[0]
    assert "2.00/5.00" in rows[-1].split() and "-" in rows[-2].split()


def test_an_admit_variant_runs_its_policy_with_read_time_admission(
    tmp_path: Path,
) -> None:
    """NAME+admit is NAME with tiered.recompute_tokens_per_s at the run's
    prefill rate (the profile's, for the median prompt); its summary says
    what the rule did, and NAME's says nothing."""
    assert variants.policy_of("hinted+admit#2") == "hinted"
    assert variants.base_of("hinted+admit#2") == "hinted+admit"
    assert variants.admits("none+admit") and not variants.admits("none#2")
    args = bench_args(
        tmp_path, session_trace(tmp_path), "--hot-gb", "0.05", "--restart"
    )
    requests = scenario.load_requests(args)
    setup = scenario.make_setup(args, requests)
    median = sorted(r.input_length for r in requests)[1]
    assert setup.recompute_tokens_per_s == pytest.approx(
        median / setup.profile.prefill_s(median, 0)
    )
    dirs = variants.VariantDirs.create(setup, "none+admit")
    try:
        extra = variants.engine_config("none+admit", setup, dirs).extra_config
        plain = variants.engine_config("none", setup, dirs).extra_config
    finally:
        dirs.remove()
    assert extra["tiered.recompute_tokens_per_s"] == setup.recompute_tokens_per_s
    assert "tiered.recompute_tokens_per_s" not in plain
    admitted = report.summarize(run(args, "none+admit"))
    assert admitted["admission"]["lookups_judged"] >= 3  # A, B and C found chunks
    assert report.summarize(run(args, "none"))["admission"] is None
    (line,) = rules.admission_lines({"none+admit": admitted, "none": {}})
    assert line.startswith("none+admit: read-time admission shortened ")


def test_slow_cold_preset_is_fleet_behind_a_slower_link_with_the_rule() -> None:
    args = cli.parse_args(["bench", "--preset", "slow-cold"])
    presets.apply(args.preset, args, args.preset_defaults, cli_bench.PRESET_PARSE)
    assert (args.workload, args.restart, args.warm_gb) == ("agent", True, 1.2)
    assert args.cold_link == DeviceSpec(0.5, 0.0003)
    assert args.policies == "none,none+admit,none"
    fleet = cli.parse_args(["bench", "--preset", "fleet"])
    presets.apply(fleet.preset, fleet, fleet.preset_defaults, cli_bench.PRESET_PARSE)
    assert args.cold_link.gbps < fleet.cold_link.gbps
