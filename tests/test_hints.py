"""The loopback hint endpoint and its client, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import wait_until

from lmcache_tiered.warmup import hints
from lmcache_tiered.warmup.hints import HintServer, send_hint


class Recorder:
    """An on_hint callback that keeps what it gets."""

    def __init__(self) -> None:
        self.hints: list[tuple[list[int], float | None]] = []

    def __call__(self, token_ids: list[int], *, deadline_s: float | None) -> None:
        self.hints.append((token_ids, deadline_s))


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def server(recorder: Recorder) -> Iterator[HintServer]:
    hint_server = HintServer(on_hint=recorder)
    yield hint_server
    hint_server.close()


def post(url: str, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_hint_reaches_callback(server: HintServer, recorder: Recorder) -> None:
    assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/hint")
    assert send_hint(server.url, [1, 2, 3], deadline_s=1.5)
    assert send_hint(server.url, range(4))
    assert recorder.hints == [([1, 2, 3], 1.5), ([0, 1, 2, 3], None)]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"token_ids": "1 2"}', "token_ids"),
        (b'{"token_ids": [1, -2]}', "token_ids"),
        (b'{"token_ids": [1, true]}', "token_ids"),
        (b'{"token_ids": [1], "deadline_s": -1}', "deadline_s"),
        (b'{"token_ids": [1], "deadline_s": "soon"}', "deadline_s"),
    ],
)
def test_bad_body_is_400_with_reason(
    server: HintServer, recorder: Recorder, body: bytes, reason: str
) -> None:
    status, message = post(server.url, body)
    assert status == 400 and reason in message
    assert recorder.hints == []


def test_wrong_path_is_404(server: HintServer) -> None:
    status, _ = post(server.url.replace("/hint", "/other"), b'{"token_ids": [1]}')
    assert status == 404
    assert not send_hint(server.url.replace("/hint", "/other"), [1])


def test_failing_callback_is_500_and_server_survives(recorder: Recorder) -> None:
    def broken(token_ids: list[int], *, deadline_s: float | None) -> None:
        raise RuntimeError("boom")

    hint_server = HintServer(on_hint=broken)
    try:
        assert post(hint_server.url, b'{"token_ids": [1]}')[0] == 500
        assert not send_hint(hint_server.url, [1])
    finally:
        hint_server.close()


def test_sender_that_hangs_up_before_the_reply_is_no_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A sender that closes (with a reset) before the 204: the hint is taken,
    nothing is printed (socketserver prints a traceback for an exception
    out of a handler), and the server goes on serving."""
    hints: list[list[int]] = []
    gone = threading.Event()

    def after_hang_up(token_ids: list[int], *, deadline_s: float | None) -> None:
        hints.append(token_ids)
        gone.wait(5)

    hint_server = HintServer(on_hint=after_hang_up)
    try:
        host, port = hint_server.url.split("/")[2].split(":")
        body = b'{"token_ids": [7, 8]}'
        with socket.create_connection((host, int(port))) as client:
            client.sendall(
                b"POST /hint HTTP/1.1\r\nHost: x\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            while not hints:
                time.sleep(0.01)
            # close with a reset (linger 0): the reply then finds no reader
            client.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        time.sleep(0.1)
        gone.set()
        assert send_hint(hint_server.url, [9])
    finally:
        hint_server.close()
    assert hints == [[7, 8], [9]]
    assert "Traceback" not in capsys.readouterr().err


def test_client_never_raises() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}/hint"
    assert not send_hint(dead, [1, 2], timeout=0.2)
    assert not send_hint("not a url", [1])


def test_close_releases_port(recorder: Recorder) -> None:
    first = HintServer(on_hint=recorder)
    port = int(first.url.rsplit(":", 1)[1].split("/")[0])
    first.close()
    second = HintServer(port=port, on_hint=recorder)
    try:
        assert send_hint(second.url, [5])
    finally:
        second.close()
    assert recorder.hints == [([5], None)]


def test_hints_never_go_through_a_proxy(
    server: HintServer, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hint carries a prompt's token ids: with ``http_proxy`` set (and
    ``no_proxy=localhost``, which urllib does not apply to 127.0.0.1) it must
    still go straight to the endpoint, never to the proxy."""
    seen: list[bytes] = []
    sent = threading.Event()
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen(8)
        proxy.settimeout(0.05)

        def record() -> None:
            while not sent.is_set():
                try:
                    conn, _ = proxy.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(1)
                    seen.append(conn.recv(65536))
                    conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")

        listener = threading.Thread(target=record)
        listener.start()
        proxy_url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
            monkeypatch.setenv(name, proxy_url)
        monkeypatch.setenv("no_proxy", "localhost")
        monkeypatch.delenv("NO_PROXY", raising=False)
        landed = send_hint(server.url, [11, 12], timeout=2)
        sent.set()
        listener.join()
    assert seen == []
    assert landed
    assert recorder.hints == [([11, 12], None)]


def _raw_request(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send a raw request; the first reply bytes (b"" if closed unanswered)."""
    host, port = url.split("/")[2].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        try:
            client.sendall(head + body)
            return client.recv(4096)
        except OSError:
            return b""


def test_idle_connections_and_oversized_bodies_leave_room_for_hints(
    recorder: Recorder,
) -> None:
    """Any local process can connect: 2,000 idle connections (as many as
    the descriptor limit allows) and a few slow or oversized requests must
    neither take a thread each nor keep a hint out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2000 + 1000
    limit = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, limit), hard))
    server = HintServer(on_hint=recorder)
    idle: list[socket.socket] = []
    threads = threading.active_count()
    try:
        host, port = server.url.split("/")[2].split(":")
        count = min(2000, limit - len(os.listdir("/proc/self/fd")) - 400)
        for i in range(count):
            client = socket.create_connection((host, int(port)), timeout=10)
            if i % 100 == 0:  # slow senders: half a request head
                client.sendall(b"POST /hint HTTP/1.1\r\nContent-Le")
            idle.append(client)
        assert count >= 1000
        assert threading.active_count() <= threads  # no thread per connection
        # at most MAX_CONNECTIONS on its side, once it accepted them all
        wait_until(lambda: len(os.listdir("/proc/self/fd")) - count < 256 + 400)
        huge = b"POST /hint HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n"
        assert _raw_request(server.url, huge).startswith(b"HTTP/1.1 413")
        too_many = ("[" + ",".join(["1"] * ((1 << 20) + 1)) + "]").encode()
        body = b'{"token_ids": ' + too_many + b"}"
        head = f"POST /hint HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n"
        assert _raw_request(server.url, head.encode(), body).startswith(b"HTTP/1.1 413")
        for i in range(5):
            assert send_hint(server.url, [i, i + 1], timeout=5)
        assert recorder.hints == [([i, i + 1], None) for i in range(5)]
    finally:
        for client in idle:
            client.close()
        server.close()


def test_the_worker_takes_a_bounded_queue_and_counts_drops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The callback (hashing a prompt's tokens) runs on one worker thread
    from a bounded queue: while it is stuck, one hint waits and the next is
    dropped (503, counted); the request threads never run it."""
    monkeypatch.setattr(hints, "REPLY_WAIT_S", 0.05)
    release = threading.Event()
    ran_on: list[str] = []

    def slow(token_ids: list[int], *, deadline_s: float | None) -> None:
        ran_on.append(threading.current_thread().name)
        release.wait(10)

    server = HintServer(on_hint=slow, max_pending=1)
    try:
        assert send_hint(server.url, [1], timeout=5)  # running: 202
        wait_until(lambda: len(ran_on) == 1)
        assert send_hint(server.url, [2], timeout=5)  # queued: 202
        assert not send_hint(server.url, [3], timeout=5)  # dropped: 503
        assert server.dropped == 1
        release.set()
        wait_until(lambda: len(ran_on) == 2)
        assert set(ran_on) == {"lmcache-tiered-hint-worker"}
    finally:
        release.set()
        server.close()


def test_a_shared_token_keeps_other_senders_out(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With LMCACHE_TIERED_HINT_TOKEN set on both sides, a hint without the
    token is refused (401) and never reaches the callback."""
    monkeypatch.setenv(hints.ENV_TOKEN, "s3cret")
    server = HintServer(on_hint=recorder)
    try:
        assert send_hint(server.url, [1, 2])
        assert not send_hint(server.url, [3], token="guess")
        status, message = post(server.url, b'{"token_ids": [4]}')
        assert status == 401 and hints.ENV_TOKEN in message
        monkeypatch.delenv(hints.ENV_TOKEN)
        assert not send_hint(server.url, [5])
        assert send_hint(server.url, [6], token="s3cret")
    finally:
        server.close()
    assert recorder.hints == [([1, 2], None), ([6], None)]


def test_the_server_starts_from_a_thread_running_an_event_loop(
    recorder: Recorder,
) -> None:
    """LMCache or vLLM may build the backend on a thread whose event loop is
    running: the server's own loop must not need that thread."""

    async def build() -> HintServer:
        return HintServer(on_hint=recorder)

    server = asyncio.run(build())
    try:
        assert send_hint(server.url, [3, 1])
    finally:
        server.close()
    assert recorder.hints == [([3, 1], None)]


def test_a_request_must_arrive_whole_in_time(recorder: Recorder) -> None:
    """A connection that sends nothing, half a head or half a body within
    the read timeout is closed unanswered; the server serves on."""
    server = HintServer(on_hint=recorder, timeout_s=0.3)
    head = b"POST /hint HTTP/1.1\r\nHost: x\r\n"
    try:
        for sent in (b"", head, head + b"Content-Length: 9\r\n\r\n{"):
            start = time.monotonic()
            assert _raw_request(server.url, sent) == b""
            assert time.monotonic() - start < 3  # closed by the server
        assert send_hint(server.url, [1])
    finally:
        server.close()
    assert recorder.hints == [([1], None)]


def test_a_newcomer_closes_the_idle_connection_or_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every connection open, a newcomer closes the longest idle one;
    while they are all sending requests, it is refused (503, counted)."""
    monkeypatch.setattr(hints, "REPLY_WAIT_S", 10.0)
    release = threading.Event()
    got: list[list[int]] = []

    def held(token_ids: list[int], *, deadline_s: float | None) -> None:
        got.append(token_ids)
        release.wait(10)

    server = HintServer(on_hint=held, max_connections=1)
    try:
        host, port = server.url.split("/")[2].split(":")
        body = b'{"token_ids": [1]}'
        with socket.create_connection((host, int(port)), timeout=10) as busy:
            busy.sendall(
                b"POST /hint HTTP/1.1\r\nHost: x\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_until(lambda: got == [[1]])  # its request waits for the callback
            assert _raw_request(server.url, b"").startswith(b"HTTP/1.1 503")
            assert server.dropped == 1
            release.set()
            assert busy.recv(4096).startswith(b"HTTP/1.1 204")  # now idle
            assert send_hint(server.url, [2], timeout=5)
            assert busy.recv(4096) == b""  # closed for the newcomer
        assert server.evicted == 1
    finally:
        release.set()
        server.close()
    assert got == [[1], [2]]
