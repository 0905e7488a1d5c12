"""Arrival hints over loopback HTTP: the earliest warm-up signal.

A router or the serving front-end (see :mod:`lmcache_tiered.integration.vllm_plugin`)
POSTs a request's prompt token ids when the request arrives, before vLLM's
scheduler looks it up; the ``hinted`` policy then promotes its cached prefix
while it waits. Hints are best effort: the client never raises and never
waits long, and the server answers at once (the callback only plans).

Protocol: ``POST /hint`` with JSON ``{"token_ids": [1, 2, ...], "deadline_s":
1.5}``; ``deadline_s`` (optional) is seconds from now until the request is
expected to be scheduled. 204 once the callback took it (202 if it is still
running after a short wait), 400 with a reason on a bad body, 401 without the
shared token (see below), 413 over :data:`MAX_TOKENS`, 503 when the server is
full (hints queued, connections, bytes in flight): the hint is dropped, counted.

The endpoint runs inside the vLLM worker and any local process can reach it, so
nothing a sender does may cost the worker more than a bounded amount: one event
loop thread serves every connection (an idle one costs a descriptor, never a
thread), at most :data:`MAX_CONNECTIONS` are open (the longest idle one is
closed for a newcomer), a request must arrive whole within :data:`READ_TIMEOUT_S`,
bodies are capped by their token count, and one worker thread runs the callback
(hashing the tokens) from a bounded queue. With ``LMCACHE_TIERED_HINT_TOKEN`` set
(in the worker's and the senders' environment), a hint without
``Authorization: Bearer <token>`` is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import json
import logging
import math
import os
import queue
import threading
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Awaitable, Sequence
from concurrent.futures import Future
from http import HTTPStatus
from http.client import HTTPException, parse_headers
from typing import Any, Protocol, TypeVar

logger = logging.getLogger("lmcache_tiered")

PATH = "/hint"
#: Environment variable holding the optional shared token (both sides).
ENV_TOKEN = "LMCACHE_TIERED_HINT_TOKEN"
#: Most token ids in one hint: the longest context served today (1M tokens);
#: a longer prompt's head still warms up if the sender cuts it to this.
MAX_TOKENS = 1 << 20
#: JSON bytes a token id may take (10 digits, a comma, a space)
_TOKEN_BYTES = 12
#: Most bytes of a request line and headers.
MAX_HEAD_BYTES = 16 << 10
#: Most connections open at once; a newcomer closes the longest idle one.
MAX_CONNECTIONS = 256
#: Seconds a connection may take to send a whole request (or sit idle).
READ_TIMEOUT_S = 5.0
#: Hints waiting for the callback; more are dropped (a late hint is worth little).
MAX_PENDING = 64
#: Bodies of at most this many maximal hints are buffered at once.
MAX_BODIES = 4
#: Seconds a request waits for its callback before it answers 202: within the
#: senders' own timeout (send_hint's default 0.5 s), so a slow callback is
#: never taken for a lost hint.
REPLY_WAIT_S = 0.25


class HintCallback(Protocol):
    """Receives one hint (on the hint worker thread: keep it short)."""

    def __call__(self, token_ids: list[int], *, deadline_s: float | None) -> Any: ...


class _Refused(Exception):
    """A request answered with ``status`` and the connection closed."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


#: token ids, deadline, and whether the callback took it (once it ran)
_Hint = tuple[list[int], float | None, "Future[bool]"]


class HintServer:
    """HTTP endpoint on ``host:port`` (0: any free port) that passes each valid
    hint to ``on_hint`` on a worker thread; serves until close().

    ``token``: the shared token senders must present (None: from
    ``LMCACHE_TIERED_HINT_TOKEN``; empty: none). The other limits are the
    module's constants (see the module's docstring).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        on_hint: HintCallback,
        token: str | None = None,
        max_tokens: int = MAX_TOKENS,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = READ_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._on_hint = on_hint
        token = os.environ.get(ENV_TOKEN, "") if token is None else token
        self._token = token.encode() if token else None
        self.max_tokens = max_tokens
        self.max_body_bytes = max_tokens * _TOKEN_BYTES + 4096
        self._max_connections = max_connections
        self._timeout_s = timeout_s
        #: hints dropped (queue full, server full), connections closed for others
        self.dropped = 0
        self.evicted = 0
        #: connection -> whether it is idle (waiting for a request), oldest first
        self._connections: OrderedDict[asyncio.StreamWriter, bool] = OrderedDict()
        self._buffered = 0
        self._hints: queue.Queue[_Hint | None] = queue.Queue(max_pending)
        self._worker = threading.Thread(
            target=self._work, name="lmcache-tiered-hint-worker", daemon=True
        )
        # the loop runs on its own thread from the start: the caller's thread
        # may be running an event loop of its own (run_until_complete refuses)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lmcache-tiered-hints", daemon=True
        )
        self._thread.start()
        listening = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(
                self._serve, host, port, limit=MAX_HEAD_BYTES, backlog=1024
            ),
            self._loop,
        )
        try:
            self._server = listening.result(READ_TIMEOUT_S)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(READ_TIMEOUT_S)
            self._loop.close()
            raise
        self._address = self._server.sockets[0].getsockname()
        self._closed = False
        self._worker.start()

    @property
    def url(self) -> str:
        """Where to POST hints, e.g. ``http://127.0.0.1:41234/hint``."""
        host, port = self._address[:2]
        return f"http://{host!s}:{port}{PATH}"

    def close(self) -> None:
        """Stop serving, release the port, let the worker finish (bounded)."""
        if self._closed:
            return
        self._closed = True
        stopped = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        with contextlib.suppress(Exception):
            stopped.result(READ_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(READ_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
        with contextlib.suppress(queue.Full):
            self._hints.put(None, timeout=REPLY_WAIT_S)
        self._worker.join(READ_TIMEOUT_S)

    async def _stop(self) -> None:
        """Close the listener and every connection; their tasks then end by
        themselves (a cancelled one is logged as an error by asyncio 3.11)."""
        self._server.close()
        for writer in list(self._connections):
            writer.transport.abort()
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        if tasks:
            await asyncio.wait(tasks, timeout=REPLY_WAIT_S + 1.0)

    # ------------------------------------------------------------ the worker

    def _work(self) -> None:
        """Run the callback for each queued hint, one at a time."""
        while (hint := self._hints.get()) is not None:
            token_ids, deadline_s, done = hint
            if not done.set_running_or_notify_cancel():
                continue
            try:
                self._on_hint(token_ids, deadline_s=deadline_s)
            except Exception:
                logger.exception("lmcache_tiered: hint callback failed")
                done.set_result(False)  # a result: nobody may wait for it
            else:
                done.set_result(True)

    # ------------------------------------------------------- the connections

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One connection: requests one after another, each within the
        read timeout; any refusal closes it."""
        if not self._admit(writer):
            await self._reply(writer, HTTPStatus.SERVICE_UNAVAILABLE, "too busy")
            writer.transport.abort()
            return
        try:
            keep = True
            while keep:
                self._connections[writer] = True
                self._connections.move_to_end(writer)
                deadline = asyncio.get_running_loop().time() + self._timeout_s
                try:
                    head = await _within(deadline, reader.readuntil(b"\r\n\r\n"))
                    self._connections[writer] = False
                    status, message, keep = await self._request(head, reader, deadline)
                except (_Refused, HTTPException, ValueError) as exc:
                    status = getattr(exc, "status", HTTPStatus.BAD_REQUEST)
                    message, keep = str(exc), False
                except asyncio.LimitOverrunError:
                    status = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
                    message, keep = "request head too large", False
                except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
                    return  # gone, idle too long, or too slow: closed
                await self._reply(writer, status, message, keep)
            await self._linger(reader, writer)
        finally:
            self._connections.pop(writer, None)
            writer.transport.abort()

    async def _linger(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Half-close, then read what the sender still sends (bounded) before
        the connection goes: closing over unread bytes resets it, and the
        sender may then lose the reply it has not read yet."""
        deadline = asyncio.get_running_loop().time() + min(1.0, self._timeout_s)
        with contextlib.suppress(asyncio.TimeoutError, OSError):
            if writer.can_write_eof():
                writer.write_eof()
            left = 1 << 20
            while left > 0 and (data := await _within(deadline, reader.read(65536))):
                left -= len(data)

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Take a newcomer: close the longest idle connection if all are
        used; False if none is idle (all are sending requests)."""
        if len(self._connections) >= self._max_connections:
            idle = next((w for w, i in self._connections.items() if i), None)
            if idle is None:
                self.dropped += 1
                return False
            self.evicted += 1
            del self._connections[idle]
            idle.transport.abort()
        self._connections[writer] = True
        return True

    async def _request(
        self, head: bytes, reader: asyncio.StreamReader, deadline: float
    ) -> tuple[HTTPStatus, str, bool]:
        """Answer one request whose head is ``head``: (status, message,
        whether the connection stays open)."""
        line, _, rest = head.partition(b"\r\n")
        method, path, version = line.decode("latin-1").split(" ", 2)
        headers = parse_headers(io.BytesIO(rest))
        keep = version == "HTTP/1.1" and (
            headers.get("Connection", "").lower() != "close"
        )
        if method != "POST" or path != PATH:
            raise _Refused(HTTPStatus.NOT_FOUND, f"POST hints to {PATH}")
        if self._token is not None and not hmac.compare_digest(
            headers.get("Authorization", "").encode(), b"Bearer " + self._token
        ):
            raise _Refused(HTTPStatus.UNAUTHORIZED, f"a valid token ({ENV_TOKEN})")
        try:
            length = int(headers.get("Content-Length", ""))
        except ValueError:
            raise _Refused(
                HTTPStatus.LENGTH_REQUIRED, "Content-Length is required"
            ) from None
        if not 0 <= length <= self.max_body_bytes:
            raise _Refused(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"hint body too large (at most {self.max_tokens} tokens)",
            )
        if self._buffered + length > MAX_BODIES * self.max_body_bytes:
            self.dropped += 1
            raise _Refused(HTTPStatus.SERVICE_UNAVAILABLE, "too many bodies in flight")
        self._buffered += length
        try:
            body = await _within(deadline, reader.readexactly(length))
        finally:
            self._buffered -= length
        token_ids, deadline_s = _parse(body, self.max_tokens)
        done: Future[bool] = Future()
        try:
            self._hints.put_nowait((token_ids, deadline_s, done))
        except queue.Full:
            self.dropped += 1
            raise _Refused(HTTPStatus.SERVICE_UNAVAILABLE, "hint queue full") from None
        # wait (never cancelling: the hint stays queued) for the callback
        await asyncio.wait([asyncio.wrap_future(done)], timeout=REPLY_WAIT_S)
        if not done.done():
            return HTTPStatus.ACCEPTED, "", keep
        if not done.result():
            return HTTPStatus.INTERNAL_SERVER_ERROR, "hint callback failed", keep
        return HTTPStatus.NO_CONTENT, "", keep

    async def _reply(
        self,
        writer: asyncio.StreamWriter,
        status: HTTPStatus,
        message: str,
        keep: bool = False,
    ) -> None:
        body = message.encode()
        head = [f"HTTP/1.1 {status.value} {status.phrase}"]
        if body:
            head.append("Content-Type: text/plain; charset=utf-8")
        head.append(f"Content-Length: {len(body)}")
        if not keep:
            head.append("Connection: close")
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            await asyncio.wait_for(writer.drain(), self._timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            # a sender that does not wait for the reply (a hint is fire and
            # forget) is normal: the hint itself was taken
            logger.debug("lmcache_tiered: hint sender left before the reply: %s", exc)


_T = TypeVar("_T")


async def _within(deadline: float, step: Awaitable[_T]) -> _T:
    """``step``'s result, or asyncio.TimeoutError at loop time ``deadline``."""
    left = deadline - asyncio.get_running_loop().time()
    return await asyncio.wait_for(step, max(left, 0.0))


def _parse(body: bytes, max_tokens: int = MAX_TOKENS) -> tuple[list[int], float | None]:
    """The hint in ``body``, or ValueError saying what is wrong with it."""
    try:
        hint = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"body is not JSON: {exc}") from None
    if not isinstance(hint, dict):
        raise ValueError('expected a JSON object {"token_ids": [...]}')
    token_ids = hint.get("token_ids")
    if isinstance(token_ids, list) and len(token_ids) > max_tokens:
        raise _Refused(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"{len(token_ids)} tokens; at most {max_tokens} in one hint",
        )
    if not isinstance(token_ids, list) or not all(
        type(t) is int and t >= 0 for t in token_ids
    ):
        raise ValueError('"token_ids" must be a list of non-negative integers')
    deadline_s = hint.get("deadline_s")
    if deadline_s is not None and (
        type(deadline_s) not in (int, float)
        or not math.isfinite(deadline_s)
        or deadline_s < 0
    ):
        raise ValueError('"deadline_s" must be a non-negative number of seconds')
    return token_ids, None if deadline_s is None else float(deadline_s)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: a hint's token ids go to the URL given only."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


#: Opens hint URLs directly: ``urlopen`` would send a prompt's token ids to
#: ``http_proxy`` (its ``no_proxy=localhost`` does not cover 127.0.0.1)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)


def post_json(
    url: str, payload: dict[str, Any], timeout: float, token: str | None = None
) -> tuple[int | None, str]:
    """POST ``payload`` as JSON to ``url``, directly (never through a proxy,
    never redirected: the body is a user's prompt); the HTTP status and the
    body's first 300 characters, or None and the error. Never raises."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        request = urllib.request.Request(url, body, headers, method="POST")
        with _DIRECT.open(request, timeout=timeout) as response:
            return response.status, response.read(300).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(300).decode(errors="replace")
    except (OSError, ValueError) as exc:  # URLError, timeouts, bad URL
        return None, str(exc)


def send_hint(
    url: str,
    token_ids: Sequence[int],
    deadline_s: float | None = None,
    timeout: float = 0.5,
    token: str | None = None,
) -> bool:
    """POST one hint to ``url``; True if it was accepted. Never raises on a
    network or server error (logs at DEBUG): a lost hint only loses warm-up.
    ``token``: the server's shared token (None: ``LMCACHE_TIERED_HINT_TOKEN``)."""
    hint: dict[str, Any] = {"token_ids": list(token_ids)}
    if deadline_s is not None:
        hint["deadline_s"] = deadline_s
    status, reply = post_json(
        url, hint, timeout, os.environ.get(ENV_TOKEN, "") if token is None else token
    )
    if status is not None and 200 <= status < 300:
        return True
    logger.debug("lmcache_tiered: hint to %s not delivered: %s %s", url, status, reply)
    return False
