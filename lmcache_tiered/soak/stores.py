"""The soak's cold stores and the outages each goes through: a redis-server
of the soak's own, or a Mooncake pool of its own on loopback (whose
processes listen on all addresses, so the soak runs it only in a network
namespace of its own: :mod:`lmcache_tiered.testing.netns`).

The soak begins a store's outages in turn, one per store fault, waits
``--outage`` seconds and ends it; the cold tier must then serve again.

May touch: the store processes it starts; a Mooncake pool's log directory.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_tiered.bench.common.stores import pool_for
from lmcache_tiered.soak.redis_server import RedisServer


@dataclass(frozen=True)
class Outage:
    """What the report calls it, how it begins and how it ends."""

    what: str
    begin: Callable[[], None]
    end: Callable[[], None]


class SoakStore(ABC):
    """A cold store the soak starts, breaks on its schedule, and stops."""

    #: its name in the report
    name: str

    @property
    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """The JSON (as a dict) ``tiered.cold.adapter`` takes for it."""

    @abstractmethod
    def outages(self) -> list[Outage]:
        """The outages it cycles through, in order."""

    @abstractmethod
    def close(self) -> None:
        """Stop it, even stopped or killed by an outage."""


class RedisStore(SoakStore):
    """A redis-server, no persistence: stopped, killed (back empty), full."""

    name = "redis-server"

    def __init__(self) -> None:
        self.server = RedisServer()

    @property
    def spec(self) -> dict[str, Any]:
        return self.server.spec

    def outages(self) -> list[Outage]:
        server = self.server
        return [
            Outage(
                "SIGSTOP",
                lambda: server.signal(signal.SIGSTOP),
                lambda: server.signal(signal.SIGCONT),
            ),
            Outage("killed, restarted empty after", server.kill, server.start),
            Outage(
                "full, writes refused",
                lambda: server.fill(True),
                lambda: server.fill(False),
            ),
        ]

    def close(self) -> None:
        self.server.signal(signal.SIGCONT)
        self.server.kill()


class MooncakeStore(SoakStore):
    """A Mooncake pool for ``stored_bytes`` (a mooncake_master and a
    mooncake_client holding the memory): each process stopped, and each
    killed and restarted on its port (what it held is gone)."""

    name = "Mooncake pool"

    def __init__(self, stored_bytes: int, log_dir: Path) -> None:
        self.pool = pool_for(stored_bytes, log_dir)

    @property
    def spec(self) -> dict[str, Any]:
        return self.pool.spec()

    def outages(self) -> list[Outage]:
        pool = self.pool
        return [
            Outage(
                "master SIGSTOP",
                lambda: pool.signal("master", signal.SIGSTOP),
                lambda: pool.signal("master", signal.SIGCONT),
            ),
            Outage(
                "memory process killed, restarted empty after",
                lambda: pool.kill("memory"),
                pool.start_memory,
            ),
            Outage(
                "master killed, restarted after",
                lambda: pool.kill("master"),
                pool.start_master,
            ),
            Outage(
                "memory process SIGSTOP",
                lambda: pool.signal("memory", signal.SIGSTOP),
                lambda: pool.signal("memory", signal.SIGCONT),
            ),
        ]

    def close(self) -> None:
        for which in ("master", "memory"):
            self.pool.signal(which, signal.SIGCONT)
        self.pool.stop()
