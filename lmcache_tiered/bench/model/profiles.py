"""Model profiles: KV bytes per token and modelled GPU time for the bench.

The bench runs real LMCache and real I/O but no GPU, so a profile supplies
what the GPU would: how many KV bytes a token costs one LMCache worker (one
tensor-parallel rank, which has its own LMCache engine and storage), and how
long prefill and decode take.

KV bytes per token and rank (``kv_bytes_per_token``)::

    2 (K and V) * num_layers * (num_kv_heads / tp) * head_dim * kv_dtype_bytes

Prefill time of ``n`` new tokens after ``c`` cached ones (:meth:`prefill_s`)::

    linear    = 2 * active_params * n                       (matmul FLOPs)
    attention = 4 * num_layers * num_q_heads * head_dim * (n * c + n * n / 2)
    time      = linear / (tp * peak_linear_flops * linear_efficiency)
              + attention / (tp * peak_attention_flops * attention_efficiency)

(QK^T and AV cost 2 * head_dim FLOPs each per head and query-key pair; a
causal prefill has ``n * c + n^2 / 2`` pairs.)

Decode step of a batch of ``b`` sequences holding ``ctx`` tokens of context
in all (:meth:`decode_step_s`): memory-bound, so it is the bytes read from
HBM over the bandwidth, plus a fixed per-step cost (kernel launches and the
tensor-parallel all-reduces)::

    experts   = num_experts * (1 - (1 - experts_per_token / num_experts) ** b)
    weights   = (dense_params + experts * expert_params) * weight_bytes
    kv        = ctx * kv_bytes_per_token * tp
    time      = (weights + kv) / (tp * hbm_bytes_per_s * mbu) + step_overhead_s

(``experts`` is the expected number of distinct experts a batch touches per
layer under uniform routing; a dense model has ``num_experts = 0`` and reads
``dense_params`` only.)

vLLM's own KV cache in HBM (:attr:`ModelProfile.gpu_kv_budget_bytes`), per
rank, as vLLM sizes it at start-up::

    budget = gpu_memory_utilization * gpu_memory_bytes
           - total_params * weight_bytes / tp        (the rank's weights)
           - activation_bytes                        (profile run, CUDA graphs)

vLLM keeps prefix blocks of finished requests there until it needs the room
(its GPU prefix cache, :mod:`lmcache_tiered.bench.model.baseline`).

Copies between LMCache's CPU buffers and the GPU (a load's upload, a save's
download) take ``bytes / pcie_bytes_per_s``: the bench charges that instead
of the time its stand-in "GPU", a CPU tensor, takes to copy.

The efficiencies (the share of a peak the kernels reach), ``mbu`` and the
PCIe rate were measured on an H200 by :mod:`lmcache_tiered.bench.model.gpu_rates`
(each profile's ``source`` gives the readings); the tensor-parallel
all-reduces and the step overhead are not measured (one GPU, no vLLM there)
and stay assumptions. They set the modelled GPU's speed, the same for every
policy and for vLLM alone.

KV scale-down (:func:`bench_shape`): a run stores ``kv_bytes_per_token / F``
bytes per token, so the working set fits a small machine. The clock is not
scaled: the bench's drives and links charge the production bytes (F times
the bytes really moved, :mod:`lmcache_tiered.bench.model.devices`), the GPU copies
are charged for production bytes at the PCIe rate, and every other cost is
real and charged once. F therefore sets what this machine stores and moves,
not the verdict; only work of this CPU per byte (checksums, memcpy) shrinks
with it.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

#: NVIDIA H200 SXM datasheet: dense (no sparsity) tensor-core peaks and HBM3e
#: (141 GB of it; nvidia-smi reports 143,771 MiB, the datasheet's figure is
#: the lower, conservative one).
H200_MEMORY_BYTES = 141e9
H200_FP8_FLOPS = 1979e12
H200_BF16_FLOPS = 989e12
H200_HBM_BYTES_PER_S = 4.8e12
#: Host link of one H200, PCIe Gen5 x16: 64 GB/s per direction on paper;
#: pinned-memory copies of 8 MiB measured 51-54 GB/s each way, 1 GiB 54-55
#: (``gpu_rates``, 2026-12-04)
PCIE5_X16_BYTES_PER_S = 53e9
#: Decode reads weights at 3.58-3.76 TB/s on an H200: 0.745-0.783 of HBM3e's
#: 4.8 TB/s (``gpu_rates``: bf16 products of a batch of 16, 2026-12-04)
H200_DECODE_MBU = 0.75

#: vLLM's default share of GPU memory it may use (``gpu_memory_utilization``).
VLLM_GPU_MEMORY_UTILIZATION = 0.9

#: Copies between LMCache's buffers and a CPU server's KV cache: memcpy of
#: 8 MiB measured 22 GB/s on one core of the 2-vCPU AMD EPYC VM (torch copy_).
CPU_COPY_BYTES_PER_S = 22e9

#: The bench engine's KV element: bf16, 2 bytes (one of K, V per element).
BENCH_ELEMENT_BYTES = 2


class Profile(Protocol):
    """What the bench asks of a model on its hardware: KV bytes, vLLM's own
    KV cache, the copy link, and the seconds of prefill and decode."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def gpu_kv_tokens(self) -> int: ...

    @property
    def pcie_bytes_per_s(self) -> float: ...

    @property
    def kv_scale(self) -> int: ...

    @property
    def request_latency_s(self) -> float:
        """Seconds a request's first token takes beyond the engine's steps
        (the server's HTTP and scheduling path), which no step waits on."""
        ...

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float: ...

    def decode_step_s(self, batch: int, context_tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One model on one GPU setup, its times derived from datasheet peaks and
    the efficiencies measured on that GPU; see the module docstring for the
    formulas."""

    name: str
    #: where the numbers come from (copied into the bench's JSON)
    source: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    tp: int
    active_params: float
    #: always-read weights (attention, norms, router, lm_head)
    dense_params: float
    #: parameters of one expert over all layers (0 for a dense model)
    expert_params: float
    num_experts: int
    experts_per_token: int
    weight_bytes: float
    peak_linear_flops: float
    peak_attention_flops: float
    hbm_bytes_per_s: float
    #: CPU <-> GPU copy bandwidth of one rank (LMCache's loads and saves)
    pcie_bytes_per_s: float
    #: shares of the peaks prefill's matrix products and attention reach
    linear_efficiency: float
    attention_efficiency: float
    mbu: float
    step_overhead_s: float
    #: all parameters (every expert), for the weights each rank holds
    total_params: float
    #: HBM of one GPU
    gpu_memory_bytes: float
    #: what vLLM's profile run and CUDA graphs take besides weights (assumed)
    activation_bytes: float
    #: default scale-down factor F: about 2 KiB of KV per token on the bench,
    #: so the default workload's working set fits this machine's memory and
    #: disk (F does not move the verdict, see the module docstring)
    kv_scale: int
    #: not modelled for a GPU server (its HTTP path is small beside prefill)
    request_latency_s: float = 0.0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token held by one tensor-parallel rank."""
        return (
            2
            * self.num_layers
            * (self.num_kv_heads // self.tp)
            * self.head_dim
            * self.kv_dtype_bytes
        )

    @property
    def gpu_kv_budget_bytes(self) -> float:
        """HBM one rank gives vLLM's KV cache (see the module docstring)."""
        weights = self.total_params * self.weight_bytes / self.tp
        budget = (
            VLLM_GPU_MEMORY_UTILIZATION * self.gpu_memory_bytes
            - weights
            - self.activation_bytes
        )
        return max(0.0, budget)

    @property
    def gpu_kv_tokens(self) -> int:
        """Tokens of KV that budget holds (vLLM's "GPU KV cache size")."""
        return int(self.gpu_kv_budget_bytes // self.kv_bytes_per_token)

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Production seconds to prefill ``new_tokens`` after ``cached_tokens``."""
        if new_tokens <= 0:
            return 0.0
        linear = 2.0 * self.active_params * new_tokens
        pairs = new_tokens * cached_tokens + new_tokens * new_tokens / 2.0
        attention = 4.0 * self.num_layers * self.num_q_heads * self.head_dim * pairs
        linear_flops = self.peak_linear_flops * self.linear_efficiency
        attention_flops = self.peak_attention_flops * self.attention_efficiency
        return linear / (self.tp * linear_flops) + attention / (
            self.tp * attention_flops
        )

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Production seconds of one decode step (one token for each of ``batch``)."""
        if batch <= 0:
            return 0.0
        experts = 0.0
        if self.num_experts:
            share = self.experts_per_token / self.num_experts
            experts = self.num_experts * (1.0 - (1.0 - share) ** batch)
        weights = (self.dense_params + experts * self.expert_params) * self.weight_bytes
        kv = context_tokens * self.kv_bytes_per_token * self.tp
        bandwidth = self.tp * self.hbm_bytes_per_s * self.mbu
        return (weights + kv) / bandwidth + self.step_overhead_s


@dataclass(frozen=True, slots=True)
class MeasuredProfile:
    """A model on a machine whose rates were measured on a real server
    (``lmcache-tiered serve-bench --calibrate``), not derived from peaks: the
    bench then models the very server serve-bench times, and the two check
    each other.

    Prefill of ``n`` tokens after ``c`` cached ones, and a decode step of
    ``b`` sequences holding ``ctx`` tokens of context::

        prefill = per_token_s * n + per_pair_s * (n * c + n * n / 2)
        step    = step_s + per_sequence_s * (b - 1) + per_context_token_s * ctx

    and ``request_latency_s``, the fit's fixed cost per request, on each TTFT.
    """

    name: str
    source: str
    kv_bytes_per_token: int
    #: vLLM's own KV cache, in tokens (on vLLM-CPU: VLLM_CPU_KVCACHE_SPACE)
    gpu_kv_tokens: int
    #: copies between LMCache's buffers and the server's KV cache
    pcie_bytes_per_s: float
    kv_scale: int
    per_token_s: float
    per_pair_s: float
    step_s: float
    per_sequence_s: float
    per_context_token_s: float
    request_latency_s: float

    @classmethod
    def from_calibration(cls, path: Path) -> MeasuredProfile:
        """The profile a ``serve-bench --calibrate --json`` file measured, or
        the one a timed ``serve-bench --json`` run measured of vLLM alone."""
        rates = _measured_rates(path)
        try:
            return cls(
                name=path.stem,
                source=f"{rates['command']} on {rates['machine']} ({path})",
                kv_bytes_per_token=int(rates["model"]["kv_bytes_per_token"]),
                gpu_kv_tokens=int(rates["kv_cache_tokens"]),
                pcie_bytes_per_s=CPU_COPY_BYTES_PER_S,
                kv_scale=1,
                per_token_s=float(rates["per_token_s"]),
                per_pair_s=float(rates["per_pair_s"]),
                step_s=float(rates["decode_step_s"]),
                per_sequence_s=float(rates["decode_per_sequence_s"]),
                per_context_token_s=float(rates["decode_per_context_token_s"]),
                request_latency_s=float(rates["fixed_s"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"--profile {path}: not a serve-bench JSON with rates ({exc!r}); "
                "make one with lmcache-tiered serve-bench --calibrate --json FILE"
            ) from None

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens``."""
        if new_tokens <= 0:
            return 0.0
        pairs = new_tokens * cached_tokens + new_tokens * new_tokens / 2.0
        return self.per_token_s * new_tokens + self.per_pair_s * pairs

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step (one token for each of ``batch``)."""
        if batch <= 0:
            return 0.0
        return (
            self.step_s
            + self.per_sequence_s * (batch - 1)
            + self.per_context_token_s * context_tokens
        )


def _measured_rates(path: Path) -> dict[str, Any]:
    """The rates in a serve-bench JSON file: a calibration's own, or the
    ``profile`` a timed run measured; a ValueError naming the file if none."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--profile {path}: cannot read it ({exc})") from None
    if not isinstance(document, dict) or "variants" not in document:
        return document if isinstance(document, dict) else {}
    if not document.get("profile"):
        raise ValueError(
            f"--profile {path}: this serve-bench run measured no rates: vLLM alone "
            "(no_external_cache) did not run, was not valid, or too few of its "
            "requests found the server idle; use a serve-bench --calibrate JSON"
        )
    profile: dict[str, Any] = document["profile"]
    return profile


_QWEN3_CODER_LAYERS = 62
_QWEN3_CODER_HIDDEN = 6144
_QWEN3_CODER_EXPERT = 3 * _QWEN3_CODER_HIDDEN * 2560 * _QWEN3_CODER_LAYERS
# attention per layer: q and o (6144 x 96*128 each), k and v (6144 x 8*128 each)
_QWEN3_CODER_ATTENTION = (
    2 * _QWEN3_CODER_HIDDEN * 96 * 128 + 2 * _QWEN3_CODER_HIDDEN * 8 * 128
) * _QWEN3_CODER_LAYERS
_QWEN3_CODER_LM_HEAD = 151936 * _QWEN3_CODER_HIDDEN
# 160 experts, attention, lm_head and the input embedding: 480.1e9
_QWEN3_CODER_TOTAL = (
    160 * _QWEN3_CODER_EXPERT + _QWEN3_CODER_ATTENTION + 2 * _QWEN3_CODER_LM_HEAD
)

_LLAMA_8B_LAYERS = 32

PROFILES: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        ModelProfile(
            name="qwen3-coder-480b-fp8-tp8",
            source=(
                "Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8 config.json: 62 layers, "
                "96 query / 8 KV heads of dim 128, 160 experts (8 per token) of "
                "intermediate size 2560, hidden 6144, vocab 151936; FP8 weights, "
                "bf16 KV cache (vLLM's kv_cache_dtype=auto). 8 x H200 SXM, TP8: "
                "1 KV head per rank = 31,744 KV bytes per token and rank. "
                "vLLM's KV budget per rank: 0.9 x 141 GB - 60.0 GB of FP8 weights "
                "(480.1e9 / 8) - 4 GB activations and CUDA graphs (assumed) = "
                "62.9 GB, 1.98M tokens. "
                "Measured on one H200 (gpu_rates, 2026-12-04): one rank's FP8 "
                "products (q/k/v/o, 160 experts of 320, 8 per token) reach 0.19 "
                "of the FP8 peak at 2,048 and 8,192 tokens a step (the faster "
                "of one grouped kernel and one product per expert); its flash "
                "attention (12 query heads, 1 KV head) 0.51-0.55 of bf16's at "
                "8,192 new or 2,048 after 16k-64k cached tokens; weights read "
                "at 0.75 of HBM; host link 53 GB/s. Assumed: all-reduces "
                "free (not measured on one GPU), 3 ms per decode step."
            ),
            num_layers=_QWEN3_CODER_LAYERS,
            num_q_heads=96,
            num_kv_heads=8,
            head_dim=128,
            kv_dtype_bytes=2,
            tp=8,
            active_params=8 * _QWEN3_CODER_EXPERT
            + _QWEN3_CODER_ATTENTION
            + _QWEN3_CODER_LM_HEAD,
            dense_params=_QWEN3_CODER_ATTENTION + _QWEN3_CODER_LM_HEAD,
            expert_params=_QWEN3_CODER_EXPERT,
            num_experts=160,
            experts_per_token=8,
            weight_bytes=1.0,
            total_params=_QWEN3_CODER_TOTAL,
            gpu_memory_bytes=H200_MEMORY_BYTES,
            activation_bytes=4e9,
            peak_linear_flops=H200_FP8_FLOPS,
            peak_attention_flops=H200_BF16_FLOPS,
            hbm_bytes_per_s=H200_HBM_BYTES_PER_S,
            pcie_bytes_per_s=PCIE5_X16_BYTES_PER_S,
            linear_efficiency=0.19,
            attention_efficiency=0.53,
            mbu=H200_DECODE_MBU,
            step_overhead_s=0.003,
            kv_scale=16,
        ),
        ModelProfile(
            name="llama-3.1-8b-tp1",
            source=(
                "meta-llama/Llama-3.1-8B-Instruct config.json: 32 layers, 32 query "
                "/ 8 KV heads of dim 128, 8.03e9 parameters, bf16 weights and KV "
                "(131,072 KV bytes per token). One H200 SXM; vLLM's KV budget "
                "0.9 x 141 GB - 16.1 GB weights - 2 GB activations (assumed). "
                "Measured on one H200 (gpu_rates, 2026-12-04): a whole "
                "random-weight Llama-3.1-8B prefill (transformers, sdpa) took "
                "59-61 ms at 2,048 tokens and 255-256 ms at 8,192: these FLOPs "
                "at 0.57-0.59 of the bf16 peak (its products alone "
                "reach 0.80-0.83, flash attention 0.38-0.70); weights read at "
                "0.75 of HBM; host link 53 GB/s. Assumed: 1 ms per step."
            ),
            num_layers=_LLAMA_8B_LAYERS,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            kv_dtype_bytes=2,
            tp=1,
            active_params=8.03e9,
            dense_params=8.03e9,
            expert_params=0.0,
            num_experts=0,
            experts_per_token=0,
            weight_bytes=2.0,
            total_params=8.03e9,
            gpu_memory_bytes=H200_MEMORY_BYTES,
            activation_bytes=2e9,
            peak_linear_flops=H200_BF16_FLOPS,
            peak_attention_flops=H200_BF16_FLOPS,
            hbm_bytes_per_s=H200_HBM_BYTES_PER_S,
            pcie_bytes_per_s=PCIE5_X16_BYTES_PER_S,
            linear_efficiency=0.58,
            attention_efficiency=0.58,
            mbu=H200_DECODE_MBU,
            step_overhead_s=0.001,
            kv_scale=64,
        ),
    )
}
DEFAULT_PROFILE = "qwen3-coder-480b-fp8-tp8"


def get_profile(name: str) -> Profile:
    """The profile called ``name``, or measured in the calibration JSON file
    ``name``; a ValueError naming the known ones if neither."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json"):
        return MeasuredProfile.from_calibration(Path(name))
    close = difflib.get_close_matches(name, PROFILES, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    raise ValueError(
        f"unknown profile {name!r}.{hint} Known: {', '.join(PROFILES)}, or a "
        "serve-bench --calibrate JSON file"
    )


@dataclass(frozen=True, slots=True)
class BenchShape:
    """The bench engine's KV layout for a profile scaled down by ``kv_scale``.

    All layers and heads are folded into one layer of one head of
    ``head_size`` elements: LMCache and the tiers only see bytes per chunk,
    and one contiguous row per token keeps the CPU "GPU" copies cheap.
    """

    head_size: int
    #: the factor actually applied (``kv_bytes_per_token / bytes_per_token``)
    kv_scale: float

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.head_size * BENCH_ELEMENT_BYTES

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return chunk_tokens * self.bytes_per_token


def bench_shape(profile: Profile, kv_scale: float | None = None) -> BenchShape:
    """The scaled-down layout; the factor is rounded so a row is whole elements."""
    scale = profile.kv_scale if kv_scale is None else kv_scale
    if scale < 1:
        raise ValueError(f"kv scale must be >= 1, got {scale}")
    per_token = profile.kv_bytes_per_token
    head_size = max(1, round(per_token / scale / (2 * BENCH_ELEMENT_BYTES)))
    return BenchShape(
        head_size=head_size,
        kv_scale=per_token / (2 * head_size * BENCH_ELEMENT_BYTES),
    )
