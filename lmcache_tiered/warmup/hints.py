"""Arrival hints over loopback HTTP: the earliest warm-up signal.

A router or the serving front-end (see :mod:`lmcache_tiered.integration.vllm_plugin`)
POSTs a request's prompt token ids when the request arrives, before vLLM's
scheduler looks it up; the ``hinted`` policy then promotes its cached prefix
while it waits. Hints are best effort: the client never raises and never
waits long, and the server answers at once (the callback only plans).

Protocol: ``POST /hint`` with JSON ``{"token_ids": [1, 2, ...], "deadline_s":
1.5}``; ``deadline_s`` (optional) is seconds from now until the request is
expected to be scheduled. 204 on success, 400 with a reason on a bad body.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import urllib.request
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

logger = logging.getLogger("lmcache_tiered")

PATH = "/hint"
#: a 1M-token prompt is about 7 MB of JSON
MAX_BODY_BYTES = 64 << 20


class HintCallback(Protocol):
    """Receives one hint (on a server thread: keep it short, never raise)."""

    def __call__(self, token_ids: list[int], *, deadline_s: float | None) -> Any: ...


class HintServer:
    """Threaded HTTP endpoint on ``host:port`` (0: any free port) that passes
    each valid hint to ``on_hint``; serves from a daemon thread until close()."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, on_hint: HintCallback
    ) -> None:
        handler = type("_Handler", (_HintHandler,), {"on_hint": staticmethod(on_hint)})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(0.1,),  # how often it checks for close(): close waits that long
            name="lmcache-tiered-hints",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """Where to POST hints, e.g. ``http://127.0.0.1:41234/hint``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{PATH}"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _HintHandler(BaseHTTPRequestHandler):
    on_hint: HintCallback

    def do_POST(self) -> None:
        if self.path != PATH:
            self._reply(HTTPStatus.NOT_FOUND, f"POST hints to {PATH}")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
            return
        if not 0 <= length <= MAX_BODY_BYTES:
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "hint body too large")
            return
        try:
            token_ids, deadline_s = _parse(self.rfile.read(length))
        except ValueError as exc:
            self._reply(HTTPStatus.BAD_REQUEST, str(exc))
            return
        try:
            self.on_hint(token_ids, deadline_s=deadline_s)
        except Exception:
            logger.exception("lmcache_tiered: hint callback failed")
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, "hint callback failed")
            return
        self._reply(HTTPStatus.NO_CONTENT, "")

    def _reply(self, status: HTTPStatus, message: str) -> None:
        body = message.encode()
        try:
            self.send_response(status)
            if body:
                self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError) as exc:
            # a sender that does not wait for the reply (a hint is fire and
            # forget) is normal: the hint itself was taken
            self.close_connection = True
            logger.debug("lmcache_tiered: hint sender left before the reply: %s", exc)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("lmcache_tiered hint server: " + format, *args)


def _parse(body: bytes) -> tuple[list[int], float | None]:
    """The hint in ``body``, or ValueError saying what is wrong with it."""
    try:
        hint = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"body is not JSON: {exc}") from None
    if not isinstance(hint, dict):
        raise ValueError('expected a JSON object {"token_ids": [...]}')
    token_ids = hint.get("token_ids")
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


def send_hint(
    url: str,
    token_ids: Sequence[int],
    deadline_s: float | None = None,
    timeout: float = 0.5,
) -> bool:
    """POST one hint to ``url``; True if it was accepted. Never raises on a
    network or server error (logs at DEBUG): a lost hint only loses warm-up.
    Never through a proxy, never redirected: the body is a user's prompt."""
    hint: dict[str, Any] = {"token_ids": list(token_ids)}
    if deadline_s is not None:
        hint["deadline_s"] = deadline_s
    body = json.dumps(hint, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json"}
    try:
        request = urllib.request.Request(url, body, headers, method="POST")
        with _DIRECT.open(request, timeout=timeout) as response:
            return 200 <= response.status < 300
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, bad URL
        logger.debug("lmcache_tiered: hint to %s not delivered: %s", url, exc)
        return False
