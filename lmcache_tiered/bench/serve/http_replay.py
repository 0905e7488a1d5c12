"""Replay a workload against a real OpenAI-compatible server over HTTP.

Requests are sent on the trace's clock (wall second = trace second); a
follow-up turn is sent its think time after the turn it follows finished,
as in :mod:`lmcache_tiered.bench.model.serving`. Each is a streamed completion of
token ids (``ignore_eos``, so it makes exactly its ``output_length``
tokens); TTFT is taken at the first streamed token, from the time the
request was due, so a late send counts against the client, never for the
server (the lag is reported, see :func:`replay`).

May touch: the server at ``url``; nothing on disk.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from lmcache_tiered.bench.common.trace import Request, TokenBlocks

#: A request that has not finished in this long has hung (seconds).
REQUEST_TIMEOUT_S = 1800.0
#: The id the replay gives the trace's request ``i`` (vLLM's ``X-Request-Id``
#: header): its completion is ``cmpl-<id>``, and LMCache's log names it.
TRACE_REQUEST_ID = "trace-{}"
#: prompt tokens of :func:`warm_up`'s request
WARM_UP_TOKENS = 512
#: The longest wait the client hands the kernel at once (seconds). Linux
#: lets an epoll wait, which asyncio's sleeps are, end up to 0.1 % of its
#: timeout late (100 ms at most: ``select_estimate_accuracy`` in
#: fs/select.c): a follow-up turn slept 174 s and went out 58-80 ms late in
#: every variant of a run. Waits in slices of this length ended 1.3-1.5 ms
#: late here.
SLEEP_SLICE_S = 1.0


@dataclass(frozen=True, slots=True)
class Served:
    """One request as the client saw it (seconds since the replay began)."""

    #: when it was due (its arrival, or its think time after its predecessor)
    due: float
    #: when it was sent (``sent - due``: the client's lag)
    sent: float
    first_token: float
    finished: float
    input_length: int
    #: tokens streamed back
    output_tokens: int
    #: prompt tokens the server did not compute (its ``cached_tokens``)
    cached_tokens: int


class ReplayError(RuntimeError):
    """The server refused a request or streamed no token for it."""


async def _complete(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    request_id: str,
) -> tuple[float, int, int]:
    """Stream one completion: (first token time, tokens, cached tokens)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = 0.0
    tokens = cached = 0
    try:
        headers = {"X-Request-Id": request_id}
        async with session.post(
            f"{url}/v1/completions", json=body, headers=headers
        ) as response:
            if response.status != 200:
                text = await response.text()
                raise ReplayError(f"{url} answered {response.status}: {text[:500]}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("choices"):
                    if tokens == 0:
                        first = time.monotonic()
                    tokens += 1
                usage = event.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or cached)
    except aiohttp.ClientError as exc:
        raise ReplayError(f"{url}: {exc!r} (did the server die? see its log)") from exc
    if tokens == 0:
        raise ReplayError(f"{url} streamed no token for a {len(prompt)}-token prompt")
    return first, tokens, cached


def warm_up(url: str, model: str) -> None:
    """One request outside any measurement, of tokens no measured request
    shares: a server's first step is slower than the rest."""
    replay(
        url,
        model,
        [Request(0.0, WARM_UP_TOKENS, 4, (0,))],
        TokenBlocks(seed=1),
        request_id="warmup-{}",
    )


def replay(
    url: str,
    model: str,
    requests: Sequence[Request],
    blocks: TokenBlocks,
    on_done: Callable[[], None] = lambda: None,
    request_id: str = TRACE_REQUEST_ID,
) -> list[Served]:
    """Run ``requests`` against ``url``; every one of them, in trace order.
    Request ``i`` goes out with the id ``request_id.format(i)``."""
    return asyncio.run(_replay(url, model, requests, blocks, on_done, request_id))


async def _replay(
    url: str,
    model: str,
    requests: Sequence[Request],
    blocks: TokenBlocks,
    on_done: Callable[[], None],
    request_id: str,
) -> list[Served]:
    prompts = [blocks.tokens(r).tolist() for r in requests]
    # the prompts are hundreds of thousands of ints in lists, which a full
    # collection scans (62-68 ms for agent-cpu's here, the event loop blocked
    # meanwhile): kept out of the collector's scans while the run lasts
    gc.collect()
    gc.freeze()
    try:
        return await _send_all(url, model, requests, prompts, on_done, request_id)
    finally:
        gc.unfreeze()


async def _sleep_until(deadline: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``deadline``, in slices of at
    most :data:`SLEEP_SLICE_S` (one long wait can end late)."""
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(left, SLEEP_SLICE_S))


async def _send_all(
    url: str,
    model: str,
    requests: Sequence[Request],
    prompts: list[list[int]],
    on_done: Callable[[], None],
    request_id: str,
) -> list[Served]:
    finished = [asyncio.get_running_loop().create_future() for _ in requests]
    served: list[Served | None] = [None] * len(requests)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    # the server queues, not us; and a connection per request: one reused
    # after idling can be closed by the server (uvicorn's 5 s keep-alive) just
    # as a request goes out on it, which fails as "Server disconnected"
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.monotonic()

        async def one(index: int) -> None:
            request = requests[index]
            due = request.arrival_s
            if request.after is not None:
                done_at = await finished[request.after]
                due = max(due, done_at + request.think_s)
            await _sleep_until(start + due)
            sent = time.monotonic()
            first, tokens, cached = await _complete(
                session,
                url,
                model,
                prompts[index],
                request.output_length,
                request_id.format(index),
            )
            end = time.monotonic()
            served[index] = Served(
                due=due,
                sent=sent - start,
                first_token=first - start,
                finished=end - start,
                input_length=request.input_length,
                output_tokens=tokens,
                cached_tokens=cached,
            )
            finished[index].set_result(end - start)
            on_done()

        tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    return [s for s in served if s is not None]
