"""A Mooncake pool of our own on loopback: a ``mooncake_master`` and a
``mooncake_client`` holding the pool's memory, each on a free port, started,
signalled and stopped by PID. The tests run the Mooncake cold tier on it, and
the benchmarks their own cold store.

Every Mooncake process (and client) listens on all addresses besides the ones
it is given, whatever its flags say: a pool starts only inside a network
namespace of its own with nothing but loopback up
(:mod:`lmcache_tiered.testing.netns`).

May touch: the processes it starts, its log directory.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from lmcache_tiered.storage.mooncake import INSTALL, adapter_spec
from lmcache_tiered.testing import netns
from lmcache_tiered.testing.ports import free_port

#: Seconds a started process has to open its port.
START_S = 15.0
#: Each process is SIGKILLed when the thread that started it ends (util-linux,
#: as unshare), so a run killed outright leaves no pool holding its memory.
DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--")
#: Why a pool is not started outside a namespace of its own.
NOT_ISOLATED = (
    "Mooncake's processes and clients listen on all addresses: a pool of our "
    "own runs only in a network namespace with nothing but loopback up"
)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


def mooncake_binary(name: str) -> str:
    """The path of a binary Mooncake's wheel ships beside its package, found
    without importing it: that loads Mooncake's library, which reads its
    settings (timeouts, log level) once, before a connector sets them."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"Mooncake is not installed: {INSTALL}")
    return str(Path(spec.origin).with_name(name))


class MooncakePool:
    """``lease_ms``: the master's lease on an object after a read (its
    default is 10 s; short ones keep tests short). ``client_ttl_s``: how long
    the master keeps a memory process that stopped answering, and its objects
    (default 10 s). ``memory``: the pool's size, held by the mooncake_client
    process. RuntimeError outside a namespace of its own."""

    def __init__(
        self,
        log_dir: Path,
        lease_ms: int = 500,
        client_ttl_s: int = 10,
        memory: str = "256MB",
    ) -> None:
        if not netns.isolated():
            raise RuntimeError(NOT_ISOLATED)
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.master_port, self.metrics_port = free_port(), free_port()
        self.memory_port = free_port()
        self.lease_ms = lease_ms
        self.client_ttl_s = client_ttl_s
        self.memory_size = memory
        self.master: subprocess.Popen[bytes] | None = None
        self.memory: subprocess.Popen[bytes] | None = None
        self.start_master()
        try:
            self.start_memory()
        except BaseException:
            self.stop()
            raise

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def spec(self, **params: Any) -> dict[str, Any]:
        """Our connector's JSON (as a dict) for this pool; ``params``: more
        of its ``adapter_params``."""
        return adapter_spec(self.master_address, "127.0.0.1", **params)

    def _start(self, argv: list[str], port: int, name: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child's)
        with log:
            proc = subprocess.Popen(
                [*DIE_WITH_PARENT, *argv], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_S
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{name} did not open port {port}; see {log.name}")
            time.sleep(0.05)
        return proc

    def start_master(self) -> None:
        """mooncake_master on loopback, no HTTP metadata server (it would
        bind 0.0.0.0 whatever its flags say)."""
        self.master = self._start(
            [mooncake_binary("mooncake_master"),
             "-rpc_address", "127.0.0.1", "-rpc_port", str(self.master_port),
             "-metrics_host", "127.0.0.1", "-metrics_port", str(self.metrics_port),
             "-enable_http_metadata_server=false", "-log_dir", str(self.log_dir),
             "-default_kv_lease_ttl", str(self.lease_ms),
             "-client_ttl", str(self.client_ttl_s)],
            self.master_port,
            "mooncake_master",
        )  # fmt: skip

    def start_memory(self) -> None:
        """The wheel's standalone client, which holds the pool's memory."""
        self.memory = self._start(
            [mooncake_binary("mooncake_client"),
             "-host", "127.0.0.1", "-port", str(self.memory_port),
             "-metadata_server", "P2PHANDSHAKE",
             "-master_server_address", self.master_address, "-protocol", "tcp",
             "-global_segment_size", self.memory_size, "-log_dir", str(self.log_dir)],
            self.memory_port,
            "mooncake_client",
        )  # fmt: skip

    def signal(self, which: str, signum: int) -> None:
        """Send ``master`` or ``memory`` a signal (SIGSTOP, SIGCONT), if up."""
        proc = getattr(self, which)
        if proc is not None:
            proc.send_signal(signum)

    def kill(self, which: str) -> None:
        """SIGKILL ``master`` or ``memory`` (by its PID) and reap it."""
        proc = getattr(self, which)
        if proc is not None:
            proc.kill()
            proc.wait()
            setattr(self, which, None)

    def stop(self) -> None:
        for which in ("memory", "master"):
            self.kill(which)
