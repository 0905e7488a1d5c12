"""Workloads for the bench: Mooncake traces and a built-in generator.

A request is described as in Mooncake traces: an arrival time, prompt and
output lengths, and ``hash_ids``, the ids of the prompt's 512-token blocks,
chained (an equal id means an equal prefix up to and including that block).
:class:`TokenBlocks` turns each block id into fixed token ids, so requests that
share a prefix share LMCache keys, exactly as the trace says.

The generator writes requests in the same form. Its multi-turn sessions are
closed loops: a turn after the first arrives a think time after the previous
turn of its session finished (``Request.after``), as a user waits for the
answer before typing; the replay releases it then. All times here are
production seconds.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when tokens are made: the command line
    import torch  # reads WORKLOADS from here and must not wait for it

#: Tokens per Mooncake block (the unit of ``hash_ids``).
BLOCK_TOKENS = 512
#: Token ids are drawn below this (any vocabulary works for hashing).
VOCAB = 32000


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload (times in production seconds)."""

    #: arrival time from the start; for a follow-up turn, the earliest one
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    #: index of the request this one follows (same session), or None
    after: int | None = None
    #: think time between that request's finish and this one's arrival
    think_s: float = 0.0


class TraceError(ValueError):
    """A trace file is unreadable or a request is inconsistent."""


def load_mooncake(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read a Mooncake JSON-lines trace (``timestamp`` in ms), sorted by time."""
    requests: list[Request] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                request = Request(
                    arrival_s=float(record["timestamp"]) / 1000.0,
                    input_length=int(record["input_length"]),
                    output_length=int(record["output_length"]),
                    hash_ids=tuple(int(h) for h in record["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(
                    f"{path}:{number}: not a Mooncake record "
                    f"(timestamp, input_length, output_length, hash_ids): {exc}"
                ) from None
            _check(request, f"{path}:{number}")
            requests.append(request)
    if not requests:
        raise TraceError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _check(request: Request, where: str) -> None:
    if request.input_length < 1 or request.output_length < 1:
        raise TraceError(f"{where}: input and output lengths must be >= 1")
    if len(request.hash_ids) * BLOCK_TOKENS < request.input_length:
        raise TraceError(
            f"{where}: {len(request.hash_ids)} hash_ids cover fewer than the "
            f"{request.input_length} input tokens ({BLOCK_TOKENS} per block)"
        )


def scale_times(requests: Sequence[Request], factor: float) -> list[Request]:
    """Multiply arrival and think times by ``factor`` (< 1: more load)."""
    if factor <= 0:
        raise ValueError(f"time scale must be > 0, got {factor}")
    return [
        replace(r, arrival_s=r.arrival_s * factor, think_s=r.think_s * factor)
        for r in requests
    ]


# ------------------------------------------------------------------ generator


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """Shape of a generated workload (token counts, production seconds)."""

    description: str
    #: sessions (multi-turn) or documents (random access)
    sessions: int
    #: session starts (or, for random access, requests) per second, Poisson
    rate_per_s: float
    system_prompts: int
    system_prompt_blocks: int
    turns: tuple[int, int]
    #: a session's first message (random access: a document)
    first_user_tokens: tuple[int, int]
    #: each later message (random access: the question)
    user_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    think_s: float
    #: random access: requests drawn over ``sessions`` documents
    random_requests: int = 0


WORKLOADS: dict[str, WorkloadShape] = {
    "agent": WorkloadShape(
        description=(
            "coding-agent sessions: 6k-14k-token first messages over shared "
            "system prompts, 2-3 turns a session, short answers; 2.6M distinct "
            "tokens, more than vLLM's HBM cache of the reference profile"
        ),
        sessions=240,
        rate_per_s=6.0,
        system_prompts=4,
        system_prompt_blocks=8,
        turns=(2, 3),
        first_user_tokens=(6000, 14000),
        user_tokens=(200, 1000),
        output_tokens=(20, 80),
        think_s=15.0,
    ),
    "agent-cpu": WorkloadShape(
        description=(
            "agent sessions sized for a CPU server (serve-bench's default): "
            "2k-4k-token first messages over two shared system prompts, 2-3 "
            "turns a session; 150k distinct tokens, several times vLLM's own "
            "cache and LMCache's L1 at serve-bench's defaults"
        ),
        sessions=40,
        rate_per_s=0.25,
        system_prompts=2,
        system_prompt_blocks=2,
        turns=(2, 3),
        first_user_tokens=(2000, 4000),
        user_tokens=(100, 400),
        output_tokens=(16, 32),
        think_s=20.0,
    ),
    "multi-turn": WorkloadShape(
        description=(
            "multi-turn sessions: each turn extends the previous context after a "
            "think time; sessions share a few system prompts"
        ),
        sessions=32,
        rate_per_s=2.0,
        system_prompts=4,
        system_prompt_blocks=4,
        turns=(3, 6),
        first_user_tokens=(1000, 8000),
        user_tokens=(100, 1000),
        output_tokens=(50, 300),
        think_s=5.0,
    ),
    "random": WorkloadShape(
        description=(
            "random access: each request reads a document drawn uniformly from a "
            "pool, plus its own question; no sessions, no order to predict"
        ),
        sessions=40,
        rate_per_s=1.6,
        system_prompts=0,
        system_prompt_blocks=0,
        turns=(1, 1),
        first_user_tokens=(2000, 10000),
        user_tokens=(50, 300),
        output_tokens=(50, 300),
        think_s=0.0,
        random_requests=160,
    ),
    "random-cpu": WorkloadShape(
        description=(
            "random access sized for a CPU server (serve-bench --restart): "
            "100 requests, each one of 48 documents of 2k-2.5k tokens drawn "
            "uniformly plus its own question; 3.1 GiB of distinct KV at "
            "serve-bench's 32 KiB a token: three times vLLM's own cache and "
            "LMCache's L1 at serve-bench's defaults, within one 5 GB drive"
        ),
        sessions=48,
        rate_per_s=0.5,
        system_prompts=0,
        system_prompt_blocks=0,
        turns=(1, 1),
        first_user_tokens=(1600, 2500),
        user_tokens=(50, 200),
        output_tokens=(16, 32),
        think_s=0.0,
        random_requests=100,
    ),
    "one-shot": WorkloadShape(
        description=(
            "one-shot random access (the boundary preset): each request one of "
            "800 documents of 3k-9k tokens, drawn uniformly, plus its own "
            "question; little reuse, most of it beyond vLLM's HBM cache, and no "
            "order to predict"
        ),
        sessions=800,
        rate_per_s=5.0,
        system_prompts=0,
        system_prompt_blocks=0,
        turns=(1, 1),
        first_user_tokens=(3000, 9000),
        user_tokens=(32, 256),
        output_tokens=(20, 80),
        think_s=0.0,
        random_requests=400,
    ),
    "long": WorkloadShape(
        description=(
            "long-context coding sessions (the seed-r2 preset): first messages of "
            "64k-128k tokens, each turn extends the context after a think time"
        ),
        sessions=24,
        rate_per_s=0.2,
        system_prompts=2,
        system_prompt_blocks=8,
        turns=(2, 4),
        first_user_tokens=(64_000, 128_000),
        user_tokens=(1_000, 4_000),
        output_tokens=(200, 800),
        think_s=30.0,
    ),
    "short": WorkloadShape(
        description="multi-turn sessions with tiny contexts (under ~2k tokens)",
        sessions=40,
        rate_per_s=4.0,
        system_prompts=4,
        system_prompt_blocks=1,
        turns=(3, 6),
        first_user_tokens=(64, 256),
        user_tokens=(32, 128),
        output_tokens=(16, 96),
        think_s=2.0,
    ),
}


class _Blocks:
    """Hands out fresh block ids and extends token streams made of blocks."""

    def __init__(self) -> None:
        self.next_id = 0

    def new(self, count: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids

    def cover(self, stream: list[int], tokens: int) -> tuple[int, ...]:
        """Grow ``stream`` to cover ``tokens`` tokens; its blocks up to there."""
        needed = math.ceil(tokens / BLOCK_TOKENS)
        stream.extend(self.new(max(0, needed - len(stream))))
        return tuple(stream[:needed])


def generate(name: str, seed: int = 0) -> list[Request]:
    """The built-in workload ``name`` (see :data:`WORKLOADS`), deterministic."""
    try:
        workload = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}"
        ) from None
    rng = random.Random(seed)
    blocks = _Blocks()
    if workload.random_requests:
        return _random_access(workload, rng, blocks)
    return _sessions(workload, rng, blocks)


def _sessions(
    workload: WorkloadShape, rng: random.Random, blocks: _Blocks
) -> list[Request]:
    prompts = [
        blocks.new(workload.system_prompt_blocks)
        for _ in range(workload.system_prompts)
    ]
    requests: list[Request] = []
    start = 0.0
    for _ in range(workload.sessions):
        start += rng.expovariate(workload.rate_per_s)
        stream = list(rng.choice(prompts)) if prompts else []
        length = len(stream) * BLOCK_TOKENS + rng.randint(*workload.first_user_tokens)
        previous: int | None = None
        for turn in range(rng.randint(*workload.turns)):
            if turn:
                length += rng.randint(*workload.user_tokens)
            output = rng.randint(*workload.output_tokens)
            requests.append(
                Request(
                    arrival_s=start,
                    input_length=length,
                    output_length=output,
                    hash_ids=blocks.cover(stream, length),
                    after=previous,
                    think_s=rng.expovariate(1.0 / workload.think_s) if turn else 0.0,
                )
            )
            previous = len(requests) - 1
            # the next prompt holds this answer: its tokens come from the stream
            length += output
    return requests


def _random_access(
    workload: WorkloadShape, rng: random.Random, blocks: _Blocks
) -> list[Request]:
    documents = [
        blocks.new(math.ceil(rng.randint(*workload.first_user_tokens) / BLOCK_TOKENS))
        for _ in range(workload.sessions)
    ]
    requests: list[Request] = []
    arrival = 0.0
    for _ in range(workload.random_requests):
        arrival += rng.expovariate(workload.rate_per_s)
        document = rng.choice(documents)
        # the question starts in a block of its own, so documents stay shared
        stream = list(document)
        length = len(document) * BLOCK_TOKENS + rng.randint(*workload.user_tokens)
        requests.append(
            Request(
                arrival_s=arrival,
                input_length=length,
                output_length=rng.randint(*workload.output_tokens),
                hash_ids=blocks.cover(stream, length),
            )
        )
    return requests


# --------------------------------------------------------------------- tokens


class TokenBlocks:
    """Fixed token ids per block id: the same prefix gives the same LMCache keys."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._cache: dict[int, torch.Tensor] = {}

    def block(self, block_id: int) -> torch.Tensor:
        tokens = self._cache.get(block_id)
        if tokens is None:
            import torch

            generator = torch.Generator().manual_seed((self.seed << 40) ^ block_id)
            tokens = torch.randint(
                0, VOCAB, (BLOCK_TOKENS,), generator=generator, dtype=torch.long
            )
            self._cache[block_id] = tokens
        return tokens

    def tokens(self, request: Request) -> torch.Tensor:
        """The prompt's token ids (int64, ``input_length`` of them)."""
        import torch

        blocks = [self.block(b) for b in request.hash_ids]
        return torch.cat(blocks)[: request.input_length]


def distinct_prompts(requests: Sequence[Request]) -> list[int]:
    """Index of the first request of each distinct prompt, in order: what a
    restarted server's drives hold (``--restart``'s untimed pass)."""
    seen: set[tuple[tuple[int, ...], int]] = set()
    first: list[int] = []
    for index, request in enumerate(requests):
        prompt = (request.hash_ids, request.input_length)
        if prompt not in seen:
            seen.add(prompt)
            first.append(index)
    return first


def unique_tokens(requests: Iterable[Request]) -> int:
    """Prompt tokens in distinct blocks: roughly what the run will store."""
    lengths: dict[int, int] = {}
    for request in requests:
        for index, block in enumerate(request.hash_ids):
            covered = min(BLOCK_TOKENS, request.input_length - index * BLOCK_TOKENS)
            lengths[block] = max(lengths.get(block, 0), covered)
    return sum(lengths.values())


def prefix_reuse(requests: Iterable[Request]) -> float:
    """Share of prompt tokens in blocks an earlier request had: the prefix
    hit ratio of an infinite cache (Mooncake's trace: about 0.64)."""
    seen: set[int] = set()
    reused = total = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        for index, block in enumerate(request.hash_ids):
            covered = min(BLOCK_TOKENS, request.input_length - index * BLOCK_TOKENS)
            total += covered
            if block in seen:
                reused += covered
            seen.add(block)
    return reused / total if total else 0.0
