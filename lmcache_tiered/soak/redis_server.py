"""A redis-server of our own on a free loopback port, no persistence: the
soak's cold store, which it stops, kills, fills and restarts (empty), and
the store the tests run the cold tier on.

May touch: the redis-server process it starts.
"""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Any

from lmcache_tiered.testing.ports import free_port

#: Seconds a started redis-server has to answer PING.
START_S = 10.0


class RedisServer:
    """``options`` are more of redis-server's flags (a cluster node's)."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.options = options
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
            + ["--save", "", "--appendonly", "no", *self.options],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_S
        while not self._answers():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def signal(self, signum: int) -> None:
        if self.proc is not None:
            self.proc.send_signal(signum)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def command(self, *words: str) -> str:
        """Send one command (RESP); its reply's first line, as in ``+OK``."""
        request = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
        with socket.create_connection(("127.0.0.1", self.port), 5) as conn:
            conn.sendall(request.encode())
            return conn.recv(4096).decode(errors="replace").split("\r\n")[0]

    def fill(self, full: bool) -> None:
        """Make the store full (every write refused, ``OOM command not
        allowed``; reads served) or take writes again."""
        self.command("config", "set", "maxmemory-policy", "noeviction")
        reply = self.command("config", "set", "maxmemory", "1" if full else "0")
        if reply != "+OK":
            raise RuntimeError(f"redis-server refused CONFIG SET maxmemory: {reply}")

    @property
    def spec(self) -> dict[str, Any]:
        """The JSON LMCache's ``resp`` adapter takes for this server."""
        return {"type": "resp", "host": "127.0.0.1", "port": self.port}
