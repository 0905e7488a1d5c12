"""Measure, on one real GPU, the rates the bench's GPU profiles model.

The bench has no GPU: :mod:`lmcache_tiered.bench.model.profiles` turns a model's
FLOPs and bytes into seconds with a GPU's datasheet peaks and an efficiency
(the share of the peak a real kernel reaches). This script measures those
efficiencies on the GPU it runs on, one term of the profile's formulas at a
time, so that a profile's speeds are readings, not guesses:

* ``link``: pinned host <-> GPU copies (LMCache's loads and saves), GB/s;
* ``linear``: one tensor-parallel rank's matrix products for ``n`` prefill
  tokens (Llama-3.1-8B in bf16; Qwen3-Coder-480B's rank in FP8: attention
  projections and its 160 experts with 8 per token, split 8 ways), as a
  share of the peak the profile charges them at;
* ``attention``: the flash attention of ``n`` new tokens over ``c`` cached
  ones, with each profile's heads per rank, as a share of the bf16 peak;
* ``decode``: the bytes per second a small-batch product reads weights at,
  as a share of HBM bandwidth;
* ``llama_forward``: a whole random-weight Llama-3.1-8B forward
  (transformers, ``sdpa`` attention), against the profile's formula.

Kernels are timed inside a CUDA graph (no launch gaps: a serving engine
captures graphs or fuses), so each figure is the GPU's own time. Run it
where a CUDA GPU and torch are, without LMCache::

    python -m lmcache_tiered.bench.model.gpu_rates --json gpu-rates.json

Not measured here, so still assumed by the profiles: the tensor-parallel
all-reduces (one GPU) and vLLM's per-step overhead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from lmcache_tiered.bench.model.profiles import (
    H200_BF16_FLOPS,
    H200_FP8_FLOPS,
    H200_HBM_BYTES_PER_S,
    PROFILES,
    ModelProfile,
)

#: the profile whose whole forward ``llama_forward`` times
LLAMA = PROFILES["llama-3.1-8b-tp1"]
#: prefill sizes measured: (new tokens, cached tokens)
PREFILL_CASES = ((2048, 0), (8192, 0), (2048, 16384), (2048, 65536))


def gpu_seconds(work: Callable[[], object], repeats: int = 10) -> float:
    """Median GPU seconds of ``work``, captured once in a CUDA graph."""
    for _ in range(2):
        work()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def link_rates() -> dict[str, float]:
    """Pinned host <-> GPU copy rates in GB/s, in 8 MiB pieces (about one
    LMCache chunk of a rank) and one 1 GiB copy."""
    rates: dict[str, float] = {}
    for label, piece, count in (("8MiB", 8 << 20, 64), ("1GiB", 1 << 30, 1)):
        host = torch.empty(piece * count, dtype=torch.uint8).pin_memory()
        device = torch.empty_like(host, device="cuda")
        for direction in ("h2d", "d2h"):
            src, dst = (host, device) if direction == "h2d" else (device, host)
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                began = time.perf_counter()
                for i in range(count):
                    part = slice(i * piece, (i + 1) * piece)
                    dst[part].copy_(src[part], non_blocking=True)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - began)
            rates[f"{direction}_{label}_gbps"] = piece * count / best / 1e9
    return rates


def fp8_product(m: int, k: int, n: int) -> Callable[[], object]:
    """An FP8 product ``(m x k) @ (k x n)`` with per-tensor scales, bf16 out
    (vLLM's FP8 linear layers on Hopper)."""
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)


def bf16_product(m: int, k: int, n: int) -> Callable[[], object]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return lambda: a @ b


def chained(works: list[Callable[[], object]]) -> Callable[[], object]:
    return lambda: [work() for work in works]


def llama8b_linear(n: int) -> tuple[Callable[[], object], float]:
    """One layer's products of Llama-3.1-8B (bf16, TP1) for ``n`` tokens,
    and their FLOPs."""
    shapes = ((4096, 6144), (4096, 4096), (4096, 2 * 14336), (14336, 4096))
    works = [bf16_product(n, k, out) for k, out in shapes]
    return chained(works), sum(2.0 * n * k * out for k, out in shapes)


def grouped_experts(
    per_expert: int, k: int, n: int, experts: int
) -> Callable[[], object] | None:
    """Every expert's FP8 product in one grouped kernel (a fused MoE layer
    does the same), or None where this torch has none."""
    grouped = getattr(torch, "_scaled_grouped_mm", None)
    if grouped is None:
        return None
    a = torch.randn(per_expert * experts, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(experts, n, k, device="cuda").to(torch.float8_e4m3fn)
    b = b.transpose(-2, -1)
    scale_a = torch.ones(per_expert * experts, device="cuda")
    scale_b = torch.ones(experts, n, device="cuda")
    ends = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32)
    offs = ends * per_expert

    def work() -> object:
        return grouped(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)

    try:
        work()
    except RuntimeError:
        return None
    return work


def qwen_rank_linear(
    n: int, group: bool = True
) -> tuple[Callable[[], object], float, str]:
    """One layer's products of one TP8 rank of Qwen3-Coder-480B (FP8) for
    ``n`` tokens: q/k/v and o for its 12 query heads and 1 KV head, and
    every expert's share (intermediate 2560 / 8) for the tokens routed to it
    (8 of 160 per token, spread evenly); their FLOPs, and how the experts
    ran (one grouped kernel, or one product each)."""
    per_expert = max(16, round(n * 8 / 160 / 16) * 16)
    dense = [(n, 6144, 14 * 128), (n, 12 * 128, 6144)]
    experts = [(per_expert, 6144, 2 * 320), (per_expert, 320, 6144)]
    works = [fp8_product(m, k, out) for m, k, out in dense]
    grouped = [
        grouped_experts(per_expert, k, out, 160) if group else None
        for _, k, out in experts
    ]
    if all(work is not None for work in grouped):
        works += [work for work in grouped if work is not None]
        how = "grouped"
    else:
        works += [fp8_product(m, k, out) for m, k, out in experts * 160]
        how = "one product per expert"
    flops = sum(2.0 * m * k * out for m, k, out in dense + experts * 160)
    return chained(works), flops, how


def attention(
    q_heads: int, kv_heads: int, new: int, cached: int
) -> tuple[Callable[[], object], float]:
    """Flash attention of ``new`` queries over ``cached + new`` keys (causal
    where nothing is cached), and its FLOPs by the profile's pair count."""
    q = torch.randn(1, q_heads, new, 128, device="cuda", dtype=torch.bfloat16)
    # each KV head repeated for its query heads: the FLOPs are the same, and
    # every attention kernel takes it
    shape = (1, kv_heads, cached + new, 128)
    k = torch.randn(shape, device="cuda", dtype=q.dtype)
    k = k.repeat_interleave(q_heads // kv_heads, dim=1)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = [
        torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
        torch.nn.attention.SDPBackend.FLASH_ATTENTION,
        torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
    ]

    def work() -> object:
        with torch.nn.attention.sdpa_kernel(backends):
            return sdpa(q, k, v, is_causal=cached == 0)

    pairs = new * cached + (new * new / 2 if cached == 0 else new * new)
    return work, 4.0 * q_heads * 128 * pairs


def decode_read_rate() -> float:
    """Bytes per second a batch of 16 reads bf16 weights at (Llama-8B's MLP
    and attention matrices, one layer after another)."""
    shapes = ((4096, 6144), (4096, 4096), (4096, 2 * 14336), (14336, 4096)) * 8
    works = [bf16_product(16, k, n) for k, n in shapes]
    seconds = gpu_seconds(chained(works))
    return sum(2.0 * k * n for k, n in shapes) / seconds


def llama_forward(cases: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    """Whole random-weight Llama-3.1-8B prefills (transformers, sdpa), timed
    with CUDA events (not a graph: its cache grows), c = 0 only: with a cache
    transformers passes a mask and leaves flash attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    results = []
    for new, cached in cases:
        if cached:
            continue
        ids = torch.randint(0, 128256, (1, new), device="cuda")
        times = []
        with torch.inference_mode():
            for _ in range(5):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                model(ids, use_cache=False, logits_to_keep=1)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        seconds = sorted(times)[2]
        # the share of the peaks at which the profile's formula takes as long
        assert isinstance(LLAMA, ModelProfile)
        at_peak = dataclasses.replace(
            LLAMA, linear_efficiency=1.0, attention_efficiency=1.0
        ).prefill_s(new, 0)
        results.append(
            {
                "new": new,
                "seconds": seconds,
                "formula_efficiency": at_peak / seconds,
                "attention": str(model.config._attn_implementation),
            }
        )
    del model
    torch.cuda.empty_cache()
    return results


def measure() -> dict[str, Any]:
    name = torch.cuda.get_device_name()
    out: dict[str, Any] = {
        "gpu": name,
        "torch": torch.__version__,
        "host": platform.node(),
        "link": link_rates(),
        "peaks": {"bf16": H200_BF16_FLOPS, "fp8": H200_FP8_FLOPS},
    }
    rows = []
    for new, cached in PREFILL_CASES:
        row: dict[str, Any] = {"new": new, "cached": cached}
        if cached == 0:
            work, flops = llama8b_linear(new)
            row["llama_linear_eff"] = flops / gpu_seconds(work) / H200_BF16_FLOPS
            work, flops, how = qwen_rank_linear(new)
            row["qwen_linear_eff"] = flops / gpu_seconds(work) / H200_FP8_FLOPS
            out["qwen_experts_ran"] = how
            if how == "grouped":
                work, flops, _ = qwen_rank_linear(new, group=False)
                eff = flops / gpu_seconds(work) / H200_FP8_FLOPS
                row["qwen_linear_eff_one_product_per_expert"] = eff
        for label, q_heads, kv_heads in (("llama", 32, 8), ("qwen", 12, 1)):
            work, flops = attention(q_heads, kv_heads, new, cached)
            eff = flops / gpu_seconds(work) / H200_BF16_FLOPS
            row[f"{label}_attention_eff"] = eff
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["prefill"] = rows
    out["decode_read_bytes_per_s"] = decode_read_rate()
    out["decode_mbu"] = out["decode_read_bytes_per_s"] / H200_HBM_BYTES_PER_S
    out["llama_forward"] = llama_forward(PREFILL_CASES)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_rates: no CUDA GPU here; run it on the GPU to model")
    result = measure()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
