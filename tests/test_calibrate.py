"""A real server's measured rates as a bench profile: the calibration fit
(non-negative, relative), the profile serve-bench's JSON makes, and the
bench's serving model charging it."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_bench import bench_args, mooncake, run, write_trace

from lmcache_tiered.bench.model import scenario
from lmcache_tiered.bench.model.baseline import NO_EXTERNAL_CACHE
from lmcache_tiered.bench.model.profiles import MeasuredProfile, get_profile
from lmcache_tiered.bench.serve import (
    calibrate,
    http_replay,
    serve_bench,
    servers,
)
from lmcache_tiered.bench.serve.setup import ServeSetup, kv_cache_tokens
from lmcache_tiered.bench.serve.tiny_model import TinyLlama
from lmcache_tiered.cli import main, parse_args

LENGTHS = [512, 1024, 2048, 4096, 6144, 8192]
#: one request at a time on a 2-vCPU Intel Xeon VM (2026-12-02): the free
#: three-term fit of these came out with a negative per-token cost
INTEL_TTFT = [0.081, 0.188, 0.746, 1.444, 2.877, 5.886]


def test_prefill_fit_recovers_known_costs() -> None:
    n = np.array(LENGTHS, dtype=float)
    ttft = 0.05 + 4e-4 * n + 1.5e-6 * n * n / 2
    fixed, per_token, per_pair = calibrate.fit_prefill(LENGTHS, list(ttft))
    assert fixed == pytest.approx(0.05, rel=1e-6)
    assert per_token == pytest.approx(4e-4, rel=1e-6)
    assert per_pair == pytest.approx(1.5e-6, rel=1e-6)


def test_prefill_fit_keeps_every_cost_non_negative() -> None:
    n = np.array(LENGTHS, dtype=float)
    design = np.stack([np.ones_like(n), n, n * n / 2], axis=1)
    free, *_ = np.linalg.lstsq(design, np.array(INTEL_TTFT), rcond=None)
    assert free[1] < 0  # the fit this replaces
    coef = calibrate.fit_prefill(LENGTHS, INTEL_TTFT)
    assert (coef >= 0).all()
    fitted = design @ coef
    assert np.max(np.abs(fitted / np.array(INTEL_TTFT) - 1)) < 0.3


def test_decode_fit_is_a_step_and_a_cost_per_context_token() -> None:
    ctx = [500, 2000, 8000]
    step, per_context = calibrate.fit_decode(ctx, [0.02 + 1e-5 * c for c in ctx])
    assert step == pytest.approx(0.02) and per_context == pytest.approx(1e-5)


def serve_setup(tmp_path: Path) -> ServeSetup:
    """serve-bench's settings for 4 slots of a 1,024-token budget."""
    return ServeSetup(
        model_dir=tmp_path,
        model=TinyLlama(),
        warm=(tmp_path,),
        concurrency=4,
        token_budget=1024,
        kv_cache_gb=1.0,
        l1_gb=1.25,
        warm_gb=8.0,
        max_model_len=9000,
        logs=tmp_path,
    )


def calibration(tmp_path: Path, **changes: Any) -> Path:
    """The JSON ``serve-bench --calibrate --json`` writes (its keys)."""
    rates = {
        "command": "serve-bench --calibrate",
        "machine": "2 x test CPU",
        "model": TinyLlama().describe(),
        "kv_cache_tokens": 32768,
        "fixed_s": 0.25,
        "per_token_s": 4e-4,
        "per_pair_s": 1.5e-6,
        "decode_step_s": 0.027,
        "decode_per_context_token_s": 8e-6,
        "decode_per_sequence_s": 0.0013,
        **changes,
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(rates))
    return path


def test_a_calibration_file_is_a_profile(tmp_path: Path) -> None:
    profile = get_profile(str(calibration(tmp_path)))
    assert isinstance(profile, MeasuredProfile)
    assert profile.kv_bytes_per_token == 32768 and profile.gpu_kv_tokens == 32768
    assert profile.request_latency_s == 0.25
    assert profile.prefill_s(1000, 500) == pytest.approx(
        4e-4 * 1000 + 1.5e-6 * (1000 * 500 + 1000 * 1000 / 2)
    )
    assert profile.decode_step_s(3, 4000) == pytest.approx(0.027 + 2 * 0.0013 + 0.032)
    assert profile.decode_step_s(0, 4000) == 0.0


def test_a_broken_calibration_file_is_named_with_how_to_make_one(
    tmp_path: Path,
) -> None:
    path = calibration(tmp_path)
    path.write_text('{"per_token_s": 1}')
    with pytest.raises(ValueError, match="serve-bench --calibrate --json") as caught:
        get_profile(str(path))
    assert str(path) in str(caught.value)
    with pytest.raises(ValueError, match="or a serve-bench --calibrate JSON"):
        get_profile("no-such-profile")


def test_bench_charges_the_measured_rates_and_the_request_latency(
    tmp_path: Path,
) -> None:
    """vLLM alone (virtual time) on one lone request: its TTFT is the
    profile's prefill of the whole prompt plus the request latency."""
    trace = write_trace(tmp_path / "one.jsonl", [mooncake(0, 1500, [1, 2, 3])])
    profile_path = calibration(tmp_path)
    args = bench_args(tmp_path, trace, "--profile", str(profile_path))
    result = run(args, NO_EXTERNAL_CACHE)
    (record,) = result.records
    profile = get_profile(str(profile_path))
    expected = profile.prefill_s(1500, 0) + profile.request_latency_s
    assert record.first_token - record.arrival == pytest.approx(expected)


def test_vllm_cache_size_is_a_block_count_and_whole_gib(tmp_path: Path) -> None:
    """vLLM-CPU takes VLLM_CPU_KVCACHE_SPACE as whole GiB: a fractional size
    is set by the block count."""
    assert servers.vllm_env(0.5)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert servers.vllm_env(2)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    command = servers.vllm_command(
        tmp_path,
        "float32",
        port=8000,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        max_model_len=9000,
        kv_cache_tokens=16384,
        kv_transfer=None,
    )
    at = command.index("--num-gpu-blocks-override")
    assert command[at + 1] == str(16384 // servers.VLLM_BLOCK_TOKENS)
    assert kv_cache_tokens(0.5, TinyLlama()) == 16384


def test_a_vllm_cache_smaller_than_a_request_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve_bench, "check_environment", lambda: None)
    assert main(["serve-bench", "--limit", "2", "--kv-cache-gb", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-gb 0.1" in err and "raise it" in err


def test_the_mlp_width_sets_compute_not_kv_bytes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--mlp-size widens the model's MLP (its prefill cost per token) and
    leaves its KV bytes per token as they are, on every CPU."""
    wide = TinyLlama.for_this_cpu(4096)
    assert wide.intermediate_size == 4096
    assert wide.kv_bytes_per_token == TinyLlama.for_this_cpu().kv_bytes_per_token
    monkeypatch.setattr(serve_bench, "check_environment", lambda: None)
    assert main(["serve-bench", "--limit", "2", "--mlp-size", "0"]) == 2
    assert "--mlp-size: at least 1" in capsys.readouterr().err


def test_lmcache_servers_own_copy_timings_become_rates(tmp_path: Path) -> None:
    log = tmp_path / "lmcache.log"
    log.write_text(
        "[2026-12-02 03:49:20,892] LMCache INFO: Retrieved 1536 tokens in 0.250 "
        "seconds (engine_driven_transfer.py:514)\n"
        "noise\n"
        "[2026-12-02 03:49:21,643] LMCache INFO: Stored 512 tokens in 0.125 seconds\n"
        "[2026-12-02 03:49:22,643] LMCache INFO: Stored 512 tokens in 0.125 seconds\n"
        "[2026-12-02 03:48:50,571] LMCache INFO: Prefetch request completed "
        "(L1+L2): 6/8 retained keys (0 L1, 6 L2) in 12041.3 ms (external_request_"
        "id=cmpl-1, prefetch_request_id=28)\n"
        "[2026-12-02 03:48:56,653] LMCache INFO: Prefetch request completed "
        "(L1+L2): 6/8 retained keys (0 L1, 6 L2) in 121.3 ms (external_request_"
        "id=cmpl-trace-17-0-bc04ac7b, prefetch_request_id=29)\n"
        "[2026-12-02 03:48:57,653] LMCache INFO: Prefetch request completed "
        "(L1+L2): 8/8 retained keys (8 L1, 0 L2) in 20000.0 ms (x)\n"
    )
    moved = servers.lmcache_transfers(log, 1000)
    assert moved is not None
    assert moved["retrieved_tokens"] == 1536 and moved["stored_tokens"] == 1024
    assert moved["retrieve_gbps"] == pytest.approx(1536 * 1000 / 0.25 / 1e9)
    assert moved["store_gbps"] == pytest.approx(1024 * 1000 / 0.25 / 1e9)
    # the L1-only prefetch is counted, its time (vLLM's step) left out
    assert moved["prefetches"] == 3 and moved["prefetches_from_l2"] == 2
    assert moved["prefetch_ms_p50"] == 12041.3
    assert moved["prefetch_ms_max"] == 12041.3
    # of the trace's requests, only request 17 loaded from L2 (cmpl-1 is not
    # one of them: the warm-up request, say)
    assert moved["requests_from_l2"] == [17]
    log.write_text("nothing timed\n")
    assert servers.lmcache_transfers(log, 1000) is None
    assert servers.lmcache_transfers(tmp_path / "missing.log", 1000) is None


def test_calibrate_prints_the_bench_command_that_models_this_server(
    tmp_path: Path,
) -> None:
    """The command --calibrate prints parses, and gives bench this server's
    profile, slots, step budget and L1 on LMCache's multi-process road."""
    path = calibration(tmp_path)
    args = parse_args(
        ["serve-bench", "--calibrate", "--json", str(path), "--limit", "6",
         "--concurrency", "4", "--token-budget", "1024"]
    )  # fmt: skip
    setup = serve_setup(tmp_path)
    command = shlex.split(serve_bench.model_command(setup, args))
    assert command[0] == "lmcache-tiered"
    bench = parse_args([*command[1:], "--warm", str(tmp_path), "--kv-link", "0.17"])
    requests = scenario.load_requests(bench)
    assert len(requests) == 6
    model = scenario.make_setup(bench, requests)
    assert model.profile.gpu_kv_tokens == 32768  # vLLM's own cache, from the file
    assert model.loading == "prefetch" and model.shape.kv_scale == 1
    assert (model.concurrency, model.token_budget) == (4, 1024)
    # the L1 of 1.25 GiB runs between 80 % (eviction) and 64 % (after it) full
    assert model.hot_gb == pytest.approx(1.25 * 0.72, abs=0.005)
    assert model.cold_paths == () and bench.policies == "none"
    assert not model.restart
    # a --restart run's model restarts too
    args = parse_args(["serve-bench", "--restart", "--json", str(path)])
    command = shlex.split(serve_bench.model_command(setup, args))
    bench = parse_args([*command[1:], "--warm", str(tmp_path)])
    assert scenario.make_setup(bench, scenario.load_requests(bench)).restart


def _rates(spreads: list[float], fit_error: float) -> dict[str, Any]:
    """What calibrate.measure returns, with these repeat spreads per length."""
    return {
        "rows": [
            {"prompt_tokens": n, "ttft_s": t, "ttft_spread": s, "decode_step_s": 0.03}
            for n, t, s in zip(LENGTHS, INTEL_TTFT, spreads, strict=True)
        ],
        "fixed_s": 0.0,
        "per_token_s": 3.6e-4,
        "per_pair_s": 1.4e-7,
        "fit_worst_error": fit_error,
        "decode_step_s": 0.025,
        "decode_per_context_token_s": 3e-6,
        "decode_batch": 8,
        "decode_batch_step_s": 0.036,
        "decode_per_sequence_s": 5e-4,
    }


def test_a_calibration_says_when_it_is_too_unsteady_for_the_model_check() -> None:
    """Repeats that disagree, or a fit that misses a length, by more than
    the model check's 15 %: the calibration says so and why."""
    steady = calibrate.describe(_rates([0.02, 0.05, 0.1, 0.03, 0.04, 0.02], 0.08))
    assert "NOT steady" not in steady and "10.0 %" in steady
    noisy = calibrate.describe(_rates([0.02, 0.4, 0.1, 0.03, 0.04, 0.02], 0.08))
    assert "NOT steady: the 3 TTFTs at 1,024 tokens differ by 40 %" in noisy
    assert "fit misses" not in noisy
    misfit = calibrate.describe(_rates([0.02] * 6, 0.257))
    assert "NOT steady: the fit misses a length by 26 %" in misfit
    assert "calibrate right before the run you model" in misfit


def _served(
    sent: float, first: float, finished: float, new: int, cached: int, out: int = 17
) -> http_replay.Served:
    return http_replay.Served(sent, sent, first, finished, new + cached, out, cached)


def _timed_run() -> list[http_replay.Served]:
    """Requests of a run of vLLM alone: six that found the server idle (TTFT
    0.05 s + 3e-4 s a new token + 2e-7 s a pair; decode steps 0.02 s + 4e-6 s
    a context token, alone), and a burst of three overlapping ones whose
    waits and shared steps must not enter either fit."""
    served = []
    t = 0.0
    for new, cached in [(512, 0), (2048, 0), (300, 4096), (1500, 1024), (3000, 1024),
                        (700, 2500)]:  # fmt: skip
        ttft = 0.05 + 3e-4 * new + 2e-7 * (new * cached + new * new / 2)
        step = 0.02 + 4e-6 * (new + cached + 17 // 2)
        served.append(_served(t, t + ttft, t + ttft + 16 * step, new, cached))
        t += 100.0
    served += [_served(t, t + 9.0, t + 12.0, 2000, 0) for _ in range(3)]
    return served


def test_a_timed_run_measures_its_servers_rates_from_its_idle_requests() -> None:
    """The prefill fit takes new tokens after cached ones, as bench charges
    them; an extra decoding sequence costs a token of prefill."""
    served = _timed_run()
    assert len(calibrate.idle_requests(served)) == 6
    assert len(calibrate.lone_decodes(served)) == 6
    rates = calibrate.from_run(served)
    assert rates is not None
    assert rates["fixed_s"] == pytest.approx(0.05, rel=1e-4)
    assert rates["per_token_s"] == pytest.approx(3e-4, rel=1e-4)
    assert rates["per_pair_s"] == pytest.approx(2e-7, rel=1e-4)
    assert rates["decode_step_s"] == pytest.approx(0.02, rel=1e-4)
    assert rates["decode_per_context_token_s"] == pytest.approx(4e-6, rel=1e-4)
    assert rates["decode_per_sequence_s"] == rates["per_token_s"]
    assert rates["fit_worst_error"] < 1e-4
    assert "from its 6 requests that found it idle" in calibrate.describe_run(rates)
    assert calibrate.from_run(served[:4] + served[6:]) is None  # too few idle


def test_a_timed_runs_json_is_a_profile_when_it_measured_rates(
    tmp_path: Path,
) -> None:
    rates = calibrate.from_run(_timed_run())
    assert rates is not None
    setup = serve_setup(tmp_path)
    path = tmp_path / "run.json"
    document = {"command": "serve-bench", "variants": {}, "profile": None}
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="measured no rates") as caught:
        get_profile(str(path))
    assert str(path) in str(caught.value)
    document["profile"] = serve_bench.profile_document("a run", setup, rates)
    path.write_text(json.dumps(document))
    profile = get_profile(str(path))
    assert isinstance(profile, MeasuredProfile)
    assert profile.prefill_s(300, 4096) == pytest.approx(
        3e-4 * 300 + 2e-7 * (300 * 4096 + 300 * 300 / 2), rel=1e-4
    )
    assert profile.request_latency_s == pytest.approx(0.05, rel=1e-4)
    assert profile.source.startswith("a run on ")


def test_idle_and_lone_requests_are_found_in_one_sweep() -> None:
    """Overlaps in either direction, at equal send times too, and with a
    one-token request (never a lone decode itself) still count."""
    a = _served(0.0, 1.0, 2.0, 100, 0)
    b = _served(1.5, 3.0, 4.0, 100, 0)  # sent while a decodes: neither a's decode
    c = _served(10.0, 11.0, 12.0, 100, 0, out=1)  # nor b's prefill alone; one token
    d = _served(10.0, 11.5, 13.0, 100, 0)  # sent with c; decodes while c finishes
    e = _served(20.0, 20.5, 21.0, 100, 0)
    f = _served(20.8, 21.5, 22.0, 100, 0)  # sent after e's first token
    served = [f, e, d, c, b, a]
    assert calibrate.idle_requests(served) == [a, e]
    assert calibrate.lone_decodes(served) == [b, f]


def test_a_run_without_a_valid_vllm_alone_has_no_profile(tmp_path: Path) -> None:
    setup = serve_setup(tmp_path)
    records = [asdict(s) for s in _timed_run()]
    assert serve_bench.run_profile({}, setup) is None
    alone = {"valid": False, "records": records}
    assert serve_bench.run_profile({NO_EXTERNAL_CACHE: alone}, setup) is None
    valid = {NO_EXTERNAL_CACHE: alone | {"valid": True}}
    profile = serve_bench.run_profile(valid, setup)
    assert profile is not None and profile["per_token_s"] == pytest.approx(3e-4)
