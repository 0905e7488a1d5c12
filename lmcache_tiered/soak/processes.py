"""The processes a soak runs and faults: a worker (the in-process plugin),
or ``lmcache server`` with ``TieredL2Adapter`` and the client that drives it.

Both answer the soak command (:mod:`lmcache_tiered.soak.command`) the same
way: JSON lines on a queue (:data:`~lmcache_tiered.soak.driver.EVENTS`), the
RSS, open files and threads of the process under test, a SIGKILL of it, a
damage asked of the line speaker, and a timed SIGTERM.

May touch: the processes it starts, their log files.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from lmcache_tiered.soak.workload import CHUNK_TOKENS
from lmcache_tiered.testing.lmcache import lmcache_server_command
from lmcache_tiered.testing.ports import free_port

#: Seconds a started ``lmcache server`` has to answer ``/status``.
SERVER_START_S = 120.0
#: LMCache's logging in the server and the client: warnings and errors
#: only (at INFO both log every request, too much for a run of days)
QUIET = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_LOG_LEVEL": "WARNING"}
#: Seconds the client may take to leave on SIGTERM before the server is told.
CLIENT_STOP_S = 30.0


def usage(pid: int) -> tuple[int, int, int] | None:
    """(RSS bytes, open files, threads) of ``pid`` from /proc; None once it
    is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        files = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) * 1024 if "VmRSS" in fields else 0
    return rss, files, int(fields["Threads"])


class WorkerProcess:
    """A Python module run on a spec file, its JSON lines on a queue; it is
    the process under test too (the in-process soak)."""

    def __init__(
        self,
        module: str,
        spec: dict[str, Any],
        scratch: Path,
        log: IO[bytes],
        env: dict[str, str] | None = None,
    ) -> None:
        path = scratch / f"{module.rsplit('.', 1)[-1]}.json"
        path.write_text(json.dumps(spec))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(path)],
            stdout=subprocess.PIPE,
            stderr=log,
            env=None if env is None else {**os.environ, **env},
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))
        self.lines.put(None)  # its end

    def usage(self) -> tuple[int, int, int] | None:
        return usage(self.proc.pid)

    def damage(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def died(self) -> int | None:
        """Its lines end when it does: nothing to look at besides."""
        return None

    def wait(self) -> int:
        """Its exit status, once its lines ended."""
        return self.proc.wait()

    def stop(self, within: float) -> float | None:
        """SIGTERM: seconds it took to leave, None if it was killed after
        ``within``."""
        return _terminate(self.proc, within)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


class MpWorker:
    """``lmcache server`` with ``adapter`` as its L2 (the process under
    test) and the client (:mod:`lmcache_tiered.soak.mp_client`) that drives
    it and speaks the lines, started on ``spec`` once the server answers."""

    def __init__(
        self,
        adapter: dict[str, Any],
        l1_gb: float,
        spec: dict[str, Any],
        scratch: Path,
        log: IO[bytes],
    ) -> None:
        port, http_port = free_port(), free_port()
        command = lmcache_server_command(port, http_port, CHUNK_TOKENS, l1_gb, adapter)
        env = {**os.environ, **QUIET}
        self.server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env
        )
        try:
            self._wait_until_up(http_port)
        except BaseException:
            self.server.kill()
            self.server.wait()
            raise
        spec = spec | {"server": {"port": port, "http_port": http_port}}
        self.client = WorkerProcess(
            "lmcache_tiered.soak.mp_client",
            spec,
            scratch,
            log,
            env=QUIET,
        )
        self.lines = self.client.lines

    def _wait_until_up(self, http_port: int) -> None:
        deadline = time.monotonic() + SERVER_START_S
        url = f"http://127.0.0.1:{http_port}/status"
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            if self.server.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited with {self.server.returncode}"
                )
            try:
                with direct.open(url, timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"lmcache server did not answer in {SERVER_START_S:g} s"
                    ) from None
                time.sleep(0.2)

    def usage(self) -> tuple[int, int, int] | None:
        return usage(self.server.pid)

    def damage(self) -> None:
        self.client.damage()

    def kill(self) -> None:
        """SIGKILL the server; the client goes with it (a new server wants a
        new client, as vLLM's workers re-register)."""
        self.server.kill()
        self.server.wait()
        self.client.kill()

    def died(self) -> int | None:
        """The server's exit status if it ended by itself (its client then
        would only wait for its answers), else None."""
        return self.server.poll()

    def wait(self) -> int:
        """The exit status of the one that ended: the server's, else the
        client's."""
        code = self.client.wait()
        server = self.server.poll()
        return code if server is None else server

    def stop(self, within: float) -> float | None:
        """SIGTERM the client, then the server: seconds the server took to
        close, None if it was killed after ``within``."""
        _terminate(self.client.proc, CLIENT_STOP_S)
        return _terminate(self.server, within)

    @property
    def returncode(self) -> int | None:
        return self.server.returncode


def _terminate(proc: subprocess.Popen[bytes], within: float) -> float | None:
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    return time.monotonic() - asked
