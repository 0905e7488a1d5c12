"""Measure a real server's prefill and decode rates, for a bench profile.

Prefill: one request at a time, each of fresh tokens (no prefix anywhere),
at a few prompt lengths. Its TTFT is the prefill of ``n`` tokens plus the
server's fixed cost per request, fitted as

    ttft(n) = fixed_s + per_token_s * n + per_pair_s * n^2 / 2

(a causal prefill of ``n`` tokens has ``n^2 / 2`` query-key pairs: the
linear and the attention cost of
:meth:`lmcache_tiered.bench.model.profiles.ModelProfile.prefill_s`). The fit is
least squares on *relative* error with every term non-negative: TTFTs span
two orders of magnitude, and a free fit trades a negative per-token cost for
the long prompts' attention (it did: -88 us per token, 179 % off at 512).

Decode: the gaps between streamed tokens are decode steps; measured alone
(a batch of one, at each prompt length) and with ``batch`` requests
decoding together, fitted as ``step_s + per_context_token_s * ctx +
per_sequence_s * (b - 1)`` for ``b`` sequences holding ``ctx`` tokens
(:class:`lmcache_tiered.bench.model.profiles.MeasuredProfile`).

The same rates from a timed run of vLLM alone (:func:`from_run`): on this
VM the server's prefill ran up to 40 % faster or slower from one few minutes
to the next (a fresh 2,048-token prompt took 1.16-1.20 s, then 0.66-0.90 s
five minutes later; decode steps held within 3 %), so a calibration made
before a run missed it by more than bench's 15 % check allows. The requests
of the run itself that found the server idle measure its prefill in the
very minutes the run took.

May touch: the server at ``url``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmcache_tiered.bench.common.trace import BLOCK_TOKENS, Request, TokenBlocks
from lmcache_tiered.bench.serve import http_replay

#: prompt lengths measured (tokens), each ``REPEATS`` times
LENGTHS = (512, 1024, 2048, 4096, 6144, 8192)
REPEATS = 3
#: tokens generated per request: the decode steps measured
DECODE_TOKENS = 33
#: the longest request measured (tokens): the server must admit it
LONGEST = max(LENGTHS) + DECODE_TOKENS
#: prompt of each request of the batched decode measurement (tokens)
BATCH_PROMPT_TOKENS = 256
#: fewest idle requests (and lone decodes) a run's own rates are fitted from
MIN_IDLE_REQUESTS = 5
#: repeats that differ by more than this share of their median, or a fit that
#: misses a length by more, make a calibration too unsteady for bench's
#: 15 % check against a real run (a queue near saturation multiplies it)
STEADY_WITHIN = 0.15


class _FreshRequests:
    """Requests whose blocks no other request has (ids from 10**6 up)."""

    def __init__(self) -> None:
        self.next_block = 10**6

    def make(self, tokens: int, output: int, arrival: float = 0.0) -> Request:
        count = -(-tokens // BLOCK_TOKENS)
        first, self.next_block = self.next_block, self.next_block + count
        return Request(arrival, tokens, output, tuple(range(first, first + count)))


def _step_s(served: http_replay.Served) -> float:
    return (served.finished - served.first_token) / (served.output_tokens - 1)


def _fit(columns: Sequence[np.ndarray], measured: np.ndarray) -> np.ndarray:
    """Coefficients, all >= 0, of ``sum(c_i * columns[i]) ~ measured`` in
    least relative squares: the best fit over every subset of the terms whose
    free solution is non-negative (exact non-negative least squares for a
    handful of terms)."""
    design = np.stack(columns, axis=1) / measured[:, None]
    target = np.ones_like(measured)
    terms = design.shape[1]
    best, best_residual = np.zeros(terms), float(np.sum(target**2))
    for size in range(1, terms + 1):
        for subset in itertools.combinations(range(terms), size):
            cols = list(subset)
            coef, *_ = np.linalg.lstsq(design[:, cols], target, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((design[:, cols] @ coef - target) ** 2))
            if residual < best_residual:
                best = np.zeros(terms)
                best[cols] = coef
                best_residual = residual
    return best


def fit_prefill(
    prompt_tokens: Sequence[int],
    ttft_s: Sequence[float],
    cached_tokens: Sequence[int] | None = None,
) -> np.ndarray:
    """``(fixed_s, per_token_s, per_pair_s)`` of the module docstring; with
    ``cached_tokens``, ``prompt_tokens`` are the new tokens computed after
    them (``n * c + n^2 / 2`` pairs, as bench charges)."""
    n = np.asarray(prompt_tokens, dtype=float)
    c = np.zeros_like(n) if cached_tokens is None else np.asarray(cached_tokens, float)
    return _fit([np.ones_like(n), n, _pairs(n, c)], np.asarray(ttft_s, dtype=float))


def _pairs(new: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """Query-key pairs of prefilling ``new`` tokens after ``cached`` ones."""
    return new * cached + new * new / 2.0


def fit_decode(context_tokens: Sequence[int], step_s: Sequence[float]) -> np.ndarray:
    """``(step_s, per_context_token_s)`` of a batch of one."""
    ctx = np.asarray(context_tokens, dtype=float)
    return _fit([np.ones_like(ctx), ctx], np.asarray(step_s, dtype=float))


def measure(
    url: str, model: str, batch: int, lengths: Sequence[int] = LENGTHS
) -> dict[str, Any]:
    """Per length the median TTFT and decode step; the prefill fit; the
    decode step alone and at ``batch`` (at most the server's max-num-seqs:
    more would queue, not batch)."""
    blocks = TokenBlocks(seed=3)
    fresh = _FreshRequests()
    http_replay.warm_up(url, model)
    ttft_of: dict[int, list[float]] = {tokens: [] for tokens in lengths}
    step_of: dict[int, list[float]] = {tokens: [] for tokens in lengths}
    # every length once a round: a slow minute of the machine falls on all
    # lengths alike instead of bending the fit at one of them
    for _ in range(REPEATS):
        for tokens in lengths:
            request = fresh.make(tokens, DECODE_TOKENS)
            (served,) = http_replay.replay(url, model, [request], blocks)
            ttft_of[tokens].append(served.first_token - served.sent)
            step_of[tokens].append(_step_s(served))
    rows = []
    for tokens in lengths:
        ttfts, steps = ttft_of[tokens], step_of[tokens]
        median = float(np.median(ttfts))
        rows.append(
            {
                "prompt_tokens": tokens,
                "ttft_s": median,
                "ttft_spread": (max(ttfts) - min(ttfts)) / median,
                "decode_step_s": float(np.median(steps)),
            }
        )
    lengths_measured = [int(r["prompt_tokens"]) for r in rows]
    ttft = np.array([r["ttft_s"] for r in rows])
    fixed, per_token, per_pair = fit_prefill(lengths_measured, list(ttft))
    n = np.array(lengths_measured, dtype=float)
    fitted = fixed + per_token * n + per_pair * n * n / 2.0
    # a request's steps attend to its prompt and half its output, on average
    contexts = [t + DECODE_TOKENS // 2 for t in lengths_measured]
    step, per_context = fit_decode(contexts, [r["decode_step_s"] for r in rows])
    together = [
        fresh.make(BATCH_PROMPT_TOKENS, 4 * DECODE_TOKENS) for _ in range(batch)
    ]
    batched = http_replay.replay(url, model, together, blocks)
    step_batch = float(np.median([_step_s(s) for s in batched]))
    batch_context = batch * (BATCH_PROMPT_TOKENS + 2 * DECODE_TOKENS)
    alone = step + per_context * batch_context
    return {
        "rows": rows,
        **_rates(fixed, per_token, per_pair, fitted / ttft, step, per_context),
        "decode_batch": batch,
        "decode_batch_step_s": step_batch,
        "decode_per_sequence_s": max(0.0, (step_batch - alone) / max(batch - 1, 1)),
    }


def prefill_rate(url: str, model: str, tokens: int, repeats: int = REPEATS) -> float:
    """Tokens a second the server at ``url`` prefills a fresh prompt of
    ``tokens`` at, as docs/warmup.md tells a user to measure
    ``tiered.recompute_tokens_per_s``: the median of ``repeats`` requests, one
    at a time, each ``tokens / TTFT``."""
    blocks = TokenBlocks(seed=5)
    fresh = _FreshRequests()
    http_replay.warm_up(url, model)
    rates = []
    for _ in range(repeats):
        (served,) = http_replay.replay(url, model, [fresh.make(tokens, 1)], blocks)
        rates.append(tokens / (served.first_token - served.sent))
    return float(np.median(rates))


def _rates(
    fixed: float,
    per_token: float,
    per_pair: float,
    fitted_over_measured: np.ndarray,
    step: float,
    per_context: float,
) -> dict[str, Any]:
    """The fields every measurement of a server's rates gives bench's profile."""
    return {
        "fixed_s": float(fixed),
        "per_token_s": float(per_token),
        "per_pair_s": float(per_pair),
        "fit_worst_error": float(np.max(np.abs(fitted_over_measured - 1.0))),
        "decode_step_s": float(step),
        "decode_per_context_token_s": float(per_context),
    }


def _alone(
    served: Sequence[http_replay.Served],
    window: Callable[[http_replay.Served], tuple[float, float]],
) -> list[http_replay.Served]:
    """The requests no other request was in flight with during their
    ``window`` (which starts at or after their send): one sweep in send
    order, so a long trace costs no quadratic scan."""
    order = sorted(served, key=lambda s: s.sent)
    alone = []
    latest_finish = -math.inf  # of the requests sent before this one
    for i, s in enumerate(order):
        begin, end = window(s)
        next_sent = order[i + 1].sent if i + 1 < len(order) else math.inf
        if latest_finish <= begin and next_sent >= end:
            alone.append(s)
        latest_finish = max(latest_finish, s.finished)
    return alone


def idle_requests(served: Sequence[http_replay.Served]) -> list[http_replay.Served]:
    """The requests no other request overlapped from their send to their first
    token: their TTFT is the server's fixed cost and their prefill alone."""
    return _alone(served, lambda s: (s.sent, s.first_token))


def lone_decodes(served: Sequence[http_replay.Served]) -> list[http_replay.Served]:
    """The requests that made their tokens (two or more) with no other request
    in flight."""
    alone = _alone(served, lambda s: (s.first_token, s.finished))
    return [s for s in alone if s.output_tokens > 1]


def from_run(served: Sequence[http_replay.Served]) -> dict[str, Any] | None:
    """The server's rates as a timed run of vLLM alone saw them, in the shape
    :func:`measure` returns: prefill fitted on :func:`idle_requests` (their new
    tokens after the ones vLLM had cached), decode on :func:`lone_decodes`. An
    extra sequence in a decode step costs prefill's per-token cost: one more
    row in the step's matrix products (calibrations here measured 0.51-0.60
    ms, where prefill's per token was 0.26-0.54 ms). None with fewer than
    :data:`MIN_IDLE_REQUESTS` of either."""
    idle = idle_requests(served)
    alone = lone_decodes(served)
    if min(len(idle), len(alone)) < MIN_IDLE_REQUESTS:
        return None
    new = [s.input_length - s.cached_tokens for s in idle]
    cached = [s.cached_tokens for s in idle]
    ttft = np.array([s.first_token - s.sent for s in idle])
    fixed, per_token, per_pair = fit_prefill(new, list(ttft), cached)
    n, c = np.array(new, dtype=float), np.array(cached, dtype=float)
    fitted = fixed + per_token * n + per_pair * _pairs(n, c)
    # a request's steps attend to its prompt and half its output, on average
    contexts = [s.input_length + s.output_tokens // 2 for s in alone]
    step, per_context = fit_decode(contexts, [_step_s(s) for s in alone])
    return {
        "rows": [
            {"new_tokens": a, "cached_tokens": b, "ttft_s": float(t)}
            for a, b, t in zip(new, cached, ttft, strict=True)
        ],
        **_rates(fixed, per_token, per_pair, fitted / ttft, step, per_context),
        "decode_lone_requests": len(alone),
        "decode_per_sequence_s": float(per_token),
    }


def describe_run(rates: dict[str, Any]) -> str:
    """One line of :func:`from_run`'s rates."""
    return (
        f"vLLM alone's rates in this run, from its {len(rates['rows'])} requests "
        f"that found it idle: ttft = {rates['fixed_s']:.3f} s"
        f" + {1e6 * rates['per_token_s']:.1f} us x new token"
        f" + {1e9 * rates['per_pair_s']:.2f} ns x (new x cached + new^2/2) (worst "
        f"error {100 * rates['fit_worst_error']:.1f} %); decode step "
        f"{1000 * rates['decode_step_s']:.1f} ms"
        f" + {1e6 * rates['decode_per_context_token_s']:.2f} us x context token "
        f"(from {rates['decode_lone_requests']} requests that decoded alone)"
    )


def unsteady(rates: dict[str, Any]) -> str | None:
    """Why bench should not trust these rates to :data:`STEADY_WITHIN`, or
    None: repeats that disagree, or a fit that misses a length."""
    row = max(rates["rows"], key=lambda r: r["ttft_spread"])
    why = []
    if row["ttft_spread"] > STEADY_WITHIN:
        why.append(
            f"the {REPEATS} TTFTs at {row['prompt_tokens']:,} tokens differ by "
            f"{100 * row['ttft_spread']:.0f} % of their median"
        )
    if rates["fit_worst_error"] > STEADY_WITHIN:
        why.append(f"the fit misses a length by {100 * rates['fit_worst_error']:.0f} %")
    if not why:
        return None
    return (
        "NOT steady: "
        + " and ".join(why)
        + f" (more than {100 * STEADY_WITHIN:.0f} %): a bench run on this profile "
        "is no closer to this server than that, and several times further where "
        "a queue builds; calibrate right before the run you model, twice, and "
        "compare"
    )


def describe(rates: dict[str, Any]) -> str:
    lines = ["prompt tokens   TTFT   spread   decode step"]
    for row in rates["rows"]:
        lines.append(
            f"{row['prompt_tokens']:>13,}  {row['ttft_s']:.3f}s  "
            f"{100 * row['ttft_spread']:>5.1f} %  {1000 * row['decode_step_s']:.1f} ms"
        )
    lines.append(
        f"fit: ttft = {rates['fixed_s']:.3f} s"
        f" + {1e6 * rates['per_token_s']:.1f} us x n"
        f" + {1e9 * rates['per_pair_s']:.2f} ns x n^2/2 (worst error "
        f"{100 * rates['fit_worst_error']:.1f} %)"
    )
    lines.append(
        f"decode step: {1000 * rates['decode_step_s']:.1f} ms"
        f" + {1e6 * rates['decode_per_context_token_s']:.2f} us x context tokens"
        f" + {1000 * rates['decode_per_sequence_s']:.2f} ms x extra sequence "
        f"({1000 * rates['decode_batch_step_s']:.1f} ms measured with "
        f"{rates['decode_batch']} decoding)"
    )
    if warning := unsteady(rates):
        lines.append(warning)
    return "\n".join(lines)
