"""serve-bench's report: each variant's figures from what the client saw,
the table, the summary line against vLLM alone, the JSON and the picture.

May touch: the ``--json`` and ``--plot`` files.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lmcache_tiered.bench.common import plot, rules, trace
from lmcache_tiered.bench.common.report import (
    delta,
    numbers_table,
    percentile,
    render,
    write_json,
)
from lmcache_tiered.bench.model.baseline import NO_EXTERNAL_CACHE
from lmcache_tiered.bench.serve import http_replay
from lmcache_tiered.bench.serve.options import LMCACHE_STOCK, TIERED, VLLM_OFFLOAD

if TYPE_CHECKING:
    from lmcache_tiered.bench.serve.setup import ServeSetup

#: A run whose client sent a request later than this share of the TTFT p50
#: measured the client, not the server: not compared.
VALID_LAG_SHARE = 0.05


def summarize(served: Sequence[http_replay.Served]) -> dict[str, Any]:
    """A variant's figures from what the client saw."""
    ttft = [s.first_token - s.due for s in served]
    lag = max(s.sent - s.due for s in served)
    start = min(s.due for s in served)
    makespan = max(s.finished for s in served) - start
    p50 = percentile(ttft, 50)
    prompt = sum(s.input_length for s in served)
    return {
        "requests": len(served),
        "ttft_p50_s": p50,
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "throughput_rps": len(served) / makespan,
        "throughput_tps": sum(s.output_tokens for s in served) / makespan,
        "makespan_s": makespan,
        "cached_share": sum(s.cached_tokens for s in served) / prompt,
        "lag_max_s": lag,
        "lag_share": lag / max(p50, 1e-9),
        "valid": lag <= VALID_LAG_SHARE * p50,
    }


def table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    base = summaries.get(NO_EXTERNAL_CACHE)
    out = numbers_table(
        "variant",
        "TTFT p50",
        "p90",
        "p99",
        "mean",
        "req/s",
        "tok/s",
        "cached",
        "send lag",
        f"dTTFT50 vs {NO_EXTERNAL_CACHE}",
        f"dtok/s vs {NO_EXTERNAL_CACHE}",
    )
    for name, s in summaries.items():
        usable = base is not None and base["valid"] and name != NO_EXTERNAL_CACHE
        if not s["valid"]:
            changes = ["not valid", "not valid"]
        elif usable:
            assert base is not None
            changes = [
                delta(s["ttft_p50_s"], base["ttft_p50_s"]),
                delta(s["throughput_tps"], base["throughput_tps"]),
            ]
        else:
            changes = ["-", "-"]
        out.add_row(
            name,
            f"{s['ttft_p50_s']:.2f}s",
            f"{s['ttft_p90_s']:.2f}s",
            f"{s['ttft_p99_s']:.2f}s",
            f"{s['ttft_mean_s']:.2f}s",
            f"{s['throughput_rps']:.2f}",
            f"{s['throughput_tps']:.1f}",
            f"{100 * s['cached_share']:.0f}%",
            f"{s['lag_max_s']:.2f}s",
            *changes,
        )
    return render(out)


def summary_line(summaries: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The best valid tiered variant against vLLM alone and the stock one."""
    base = summaries.get(NO_EXTERNAL_CACHE)
    tiered = [n for n, s in summaries.items() if n.startswith(TIERED) and s["valid"]]
    if base is None or not base["valid"] or not tiered:
        return None
    best = min(tiered, key=lambda n: summaries[n]["ttft_p50_s"])
    s = summaries[best]
    parts = [
        f"summary (real servers): {best} TTFT p50 {s['ttft_p50_s']:.2f}s vs "
        f"{base['ttft_p50_s']:.2f}s {NO_EXTERNAL_CACHE} "
        f"({delta(s['ttft_p50_s'], base['ttft_p50_s'])}), "
        f"{s['throughput_tps']:.1f} vs {base['throughput_tps']:.1f} tok/s "
        f"({delta(s['throughput_tps'], base['throughput_tps'])})"
    ]
    for other in (LMCACHE_STOCK, VLLM_OFFLOAD):
        if other in summaries:
            o = summaries[other]
            against = (
                f"; {best} at {s['ttft_p50_s'] / o['ttft_p50_s']:.2f} x its TTFT p50"
                if o["valid"]
                else " (not valid)"
            )
            parts.append(
                f"{other} {o['ttft_p50_s']:.2f}s "
                f"({delta(o['ttft_p50_s'], base['ttft_p50_s'])}), "
                f"{o['throughput_tps']:.1f} tok/s{against}"
            )
    return "; ".join(parts) + "."


def disk_served(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """TTFT p50 of every variant over the same requests: those some of whose
    chunks LMCache loaded from L2 in any variant (by its log). Where most
    requests hit LMCache's L1 or vLLM's own cache, the whole run's p50 hides
    the storage; these requests are where its speed shows. None if none."""
    indices = sorted(
        {
            i
            for s in summaries.values()
            for i in (s.get("lmcache_transfers") or {}).get("requests_from_l2", [])
        }
    )
    if not indices:
        return None
    p50 = {}
    for name, s in summaries.items():
        records = s["records"]
        ttft = [records[i]["first_token"] - records[i]["due"] for i in indices]
        p50[name] = percentile(ttft, 50)
    return {"requests": indices, "ttft_p50_s": p50}


def describe(
    setup: ServeSetup, requests: Sequence[trace.Request], args: argparse.Namespace
) -> str:
    m = setup.model
    return "\n".join(
        [
            f"workload: {args.trace or args.workload}, {len(requests)} requests, "
            f"{sum(r.input_length for r in requests):,} prompt tokens "
            f"({trace.unique_tokens(requests):,} distinct), prefix reuse "
            f"{trace.prefix_reuse(requests):.2f}",
            f"model: random-weight Llama, {m.num_hidden_layers} layers, hidden "
            f"{m.hidden_size}, MLP {m.intermediate_size}, {m.num_key_value_heads} "
            f"KV heads x {m.head_dim}, {m.torch_dtype}: "
            f"{m.kv_bytes_per_token:,} KV bytes/token",
            f"servers: vLLM max-num-seqs {setup.concurrency}, max-num-batched-"
            f"tokens {setup.token_budget}, KV cache "
            f"{setup.kv_cache_gb:g} GiB "
            f"({setup.kv_cache_tokens:,} tokens); "
            f"LMCache L1 {setup.l1_gb:g} GiB; drives: "
            + ", ".join(str(w) for w in setup.warm)
            + (
                f"; cold ({setup.cold_gb:g} GiB): "
                + ", ".join(str(c) for c in setup.cold)
                + f"; warm {setup.warm_gb:g} GiB"
                if setup.cold
                else ""
            ),
        ]
        + (
            [
                "--restart: each lmcache server variant serves every distinct "
                "prompt once, untimed, then restarts over its drives; vLLM alone "
                "and vllm_offload start empty"
            ]
            if args.restart
            else []
        )
    )


def adapter_lines(name: str, status: Any) -> list[str]:
    """What our L2 adapter in ``lmcache server``'s ``/status`` read from each
    tier and what its warm-up did (nothing without an adapter of ours)."""
    adapters = ((status or {}).get("storage_manager") or {}).get("l2_adapters")
    ours = [a for a in adapters or [] if a.get("type") == "TieredL2Adapter"]
    if not ours:
        return []
    tiers, warmup = ours[0]["tiers"], ours[0]["warmup"]
    reads = ", ".join(f"{t} {stats['hits']}" for t, stats in tiers.items())
    lines = [f"{name}: L2 chunks read: {reads}"]
    if warmup["plans"]:
        settled = warmup["warm_used"] + warmup["warm_wasted"]
        lines.append(
            f"{name}: {warmup['policy']} made {warmup['plans']} plans of "
            f"{warmup['keys_planned']} chunks; copied "
            f"{warmup['bytes_promoted_warm'] / 1e9:.2f} GB cold -> warm, of which "
            f"{warmup['warm_used']} of {settled} settled copies were read from warm"
        )
    if (rule := rules.admission(ours[0].get("admission") or {})) is not None:
        lines.append(rules.admission_line(name, rule))
    return lines


def report(
    summaries: Mapping[str, dict[str, Any]],
    setup: ServeSetup,
    requests: Sequence[trace.Request],
    args: argparse.Namespace,
    profile: dict[str, Any] | None = None,
) -> None:
    """Print the run's table and notes; write its JSON (with ``profile``,
    the server's rates this run measured, for ``bench --profile``) and
    picture."""
    if not summaries:
        print("serve-bench: no variant ran")
        return
    print()
    print(table(summaries))
    line = summary_line(summaries)
    if line:
        print(line)
    from_disk = disk_served(summaries)
    if from_disk:
        print(
            f"TTFT p50 over the {len(from_disk['requests'])} requests that loaded "
            "chunks from L2 in some variant: "
            + ", ".join(
                f"{n} {t:.2f}s" + ("" if summaries[n]["valid"] else " (not valid)")
                for n, t in from_disk["ttft_p50_s"].items()
            )
        )
    for name, s in summaries.items():
        if fill := s.get("fill"):
            print(
                f"{name}: before its restart, served {fill['prompts']} prompts "
                f"untimed and wrote them to L2 in {fill['seconds']:.0f} s; its "
                f"drives then held {fill['drive_bytes'] / 2**30:.2f} GiB"
            )
        if not s["valid"]:
            print(
                f"{name}: not valid: the client sent a request {s['lag_max_s']:.2f}s "
                "late; run on an idle machine"
            )
        for line in adapter_lines(name, s.get("lmcache_status")):
            print(line)
        moved = s.get("lmcache_transfers")
        if moved and moved["retrieve_gbps"] and moved["store_gbps"]:
            print(
                f"{name}: lmcache server copied KV into vLLM at "
                f"{moved['retrieve_gbps']:.3f} GB/s and out of it at "
                f"{moved['store_gbps']:.3f} GB/s (its own timings; bench --kv-link)"
            )
        if moved and moved["prefetches_from_l2"]:
            print(
                f"{name}: {moved['prefetches_from_l2']} of lmcache server's "
                f"{moved['prefetches']} prefetches loaded from L2, and vLLM "
                f"picked them up {moved['prefetch_ms_p50']:.0f} ms after they "
                f"were submitted at the median, {moved['prefetch_ms_max']:.0f} ms "
                "at most (its next scheduler step included)"
            )
    if args.json:
        document = {
            "command": "serve-bench",
            "config": {
                "model": setup.model.describe(),
                "workload": args.trace or args.workload,
                "requests": len(requests),
                "warm": [str(w) for w in setup.warm],
                "concurrency": setup.concurrency,
                "token_budget": setup.token_budget,
                "kv_cache_gb": setup.kv_cache_gb,
                "l1_gb": setup.l1_gb,
                "warm_gb": setup.warm_gb,
                "restart": args.restart,
            },
            "variants": summaries,
            "loaded_from_l2": from_disk,
            "profile": profile,
        }
        write_json(args.json, document)
    if args.plot != "none":
        ttft_values = {
            name: [s.first_token - s.due for s in _records(summary)]
            for name, summary in summaries.items()
        }
        plot.draw_run(
            args.plot,
            ttft_values,
            summaries,
            f"serve-bench, real servers: {describe(setup, requests, args)}",
            NO_EXTERNAL_CACHE,
            LMCACHE_STOCK,
        )
        print(f"picture: {args.plot}")


def _records(summary: Mapping[str, Any]) -> list[http_replay.Served]:
    return [http_replay.Served(**r) for r in summary["records"]]
