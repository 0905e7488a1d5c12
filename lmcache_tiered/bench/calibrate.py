"""Measure a real server's prefill and decode rates, for a bench profile.

One request at a time, each of fresh tokens (no prefix anywhere), at a few
prompt lengths: its TTFT is the prefill of ``n`` tokens (plus the server's
fixed cost per request), the gaps between its streamed tokens are decode
steps of a batch of one. A least-squares fit of

    ttft(n) = fixed_s + per_token_s * n + per_pair_s * n^2 / 2

gives the linear and the attention cost the bench's profile models
(:meth:`lmcache_tiered.bench.profiles.ModelProfile.prefill_s`: a causal
prefill of ``n`` tokens has ``n^2 / 2`` query-key pairs).

May touch: the server at ``url``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lmcache_tiered.bench import http_replay
from lmcache_tiered.bench.trace import BLOCK_TOKENS, Request, TokenBlocks

#: prompt lengths measured (tokens), each ``REPEATS`` times
LENGTHS = (512, 1024, 2048, 4096, 6144, 8192)
REPEATS = 3
#: tokens generated per request: the decode steps measured
DECODE_TOKENS = 33


def _fresh(index: int, tokens: int) -> Request:
    """A request whose blocks no other request has (ids from 10**6 up)."""
    first = 10**6 + index * 64
    blocks = tuple(range(first, first + -(-tokens // BLOCK_TOKENS)))
    return Request(0.0, tokens, DECODE_TOKENS, blocks)


def measure(url: str, model: str, lengths: Sequence[int] = LENGTHS) -> dict[str, Any]:
    """Per length the median TTFT and decode step; the fit of the three costs."""
    blocks = TokenBlocks(seed=3)
    rows = []
    index = 0
    for tokens in lengths:
        ttfts, steps = [], []
        for _ in range(REPEATS):
            index += 1
            (served,) = http_replay.replay(url, model, [_fresh(index, tokens)], blocks)
            ttfts.append(served.first_token - served.sent)
            steps.append(
                (served.finished - served.first_token) / (served.output_tokens - 1)
            )
        rows.append(
            {
                "prompt_tokens": tokens,
                "ttft_s": float(np.median(ttfts)),
                "decode_step_s": float(np.median(steps)),
            }
        )
    n = np.array([r["prompt_tokens"] for r in rows], dtype=float)
    ttft = np.array([r["ttft_s"] for r in rows])
    design = np.stack([np.ones_like(n), n, n * n / 2.0], axis=1)
    (fixed, per_token, per_pair), *_ = np.linalg.lstsq(design, ttft, rcond=None)
    fitted = design @ np.array([fixed, per_token, per_pair])
    return {
        "rows": rows,
        "fixed_s": float(fixed),
        "per_token_s": float(per_token),
        "per_pair_s": float(per_pair),
        "fit_worst_error": float(np.max(np.abs(fitted / ttft - 1.0))),
        "decode_step_s": float(np.median([r["decode_step_s"] for r in rows])),
    }


def describe(rates: dict[str, Any]) -> str:
    lines = ["prompt tokens   TTFT   decode step"]
    for row in rates["rows"]:
        lines.append(
            f"{row['prompt_tokens']:>13,}  {row['ttft_s']:.3f}s  "
            f"{1000 * row['decode_step_s']:.1f} ms"
        )
    lines.append(
        f"fit: ttft = {rates['fixed_s']:.3f} s"
        f" + {1e6 * rates['per_token_s']:.1f} us x n"
        f" + {1e9 * rates['per_pair_s']:.2f} ns x n^2/2 (worst error "
        f"{100 * rates['fit_worst_error']:.1f} %); decode step "
        f"{1000 * rates['decode_step_s']:.1f} ms"
    )
    return "\n".join(lines)
