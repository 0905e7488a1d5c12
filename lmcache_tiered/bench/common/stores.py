"""The benchmarks' cold stores: what a store is called in their reports, and
the one a benchmark starts itself, ``mooncake``, a Mooncake pool of its own
on loopback (``bench --cold-adapter mooncake``, ``diskbench --mp --store
mooncake``), stopped by PID when the run ends.

Mooncake's processes, and the client in every process that uses the pool,
listen on all addresses whatever their flags say, so the benchmark runs only
in a network namespace of its own with nothing but loopback up
(:mod:`lmcache_tiered.testing.netns`): a command started outside one runs
itself again inside one (:func:`rerun_isolated`, which needs root), or
refuses, saying why. Every connection of the run is then to 127.0.0.1: a
store elsewhere cannot be reached from there.

May touch: the pool's processes and a temporary log directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmcache_tiered.storage.mooncake import close_pools
from lmcache_tiered.testing import netns
from lmcache_tiered.testing.mooncake import MooncakePool

#: The pool's memory beyond what the run stores (the tier's probe objects,
#: Mooncake's own allocation slack).
SPARE_BYTES = 64 << 20
#: The master's lease on an object after a read: Mooncake's default. A read
#: that outlasts it fails (lease_expired_before_data_transfer_completed); a
#: batch of 16 x 4 MiB outlasted 500 ms on this 2-vCPU VM under load.
LEASE_MS = 10_000
#: Set in the environment of a command run again in a namespace.
RERUN_ENV = "LMCACHE_TIERED_ISOLATED_RERUN"


def store_kind(spec: Mapping[str, Any]) -> str:
    """A store's name in a report: a plugin's class (our Mooncake connector
    is LMCache's ``native_plugin`` type), else LMCache's adapter type."""
    return str(spec.get("class_name") or spec["type"])


def rerun_isolated(command_line: Sequence[str], option: str) -> int:
    """Run ``lmcache-tiered`` on ``command_line`` again in a namespace of its
    own and wait: its exit status. ValueError naming ``option`` and the way
    out where no namespace can be made here."""
    if os.environ.get(RERUN_ENV) == "1":  # never a rerun of a rerun
        raise ValueError(
            f"{option}: this run is already in a network namespace of its own, "
            f"yet sees more than loopback ({socket.if_nameindex()})"
        )
    why = netns.refused()
    if why is not None:
        raise ValueError(
            f"{option} starts a Mooncake pool, whose processes listen on all "
            "addresses, so the run goes in a network namespace of its own with "
            f"only loopback up, and {why}: run it as root, or start a pool "
            "yourself and give its JSON (docs/cold-tier.md)"
        )
    argv = [sys.executable, "-m", "lmcache_tiered.cli", *command_line]
    env = os.environ | {RERUN_ENV: "1"}
    with subprocess.Popen(netns.command(argv), env=env) as child:
        try:
            return child.wait()
        except KeyboardInterrupt:  # it got the signal too: let it stop its pool
            return child.wait()


def pool_for(stored_bytes: int, log_dir: Path) -> MooncakePool:
    """A pool on loopback sized for ``stored_bytes`` and SPARE_BYTES more,
    with Mooncake's default lease. Only in a namespace of its own."""
    megabytes = -(-(stored_bytes + SPARE_BYTES) // (1 << 20))
    return MooncakePool(log_dir, lease_ms=LEASE_MS, memory=f"{megabytes}MB")


@contextmanager
def mooncake_pool(stored_bytes: int) -> Iterator[dict[str, Any]]:
    """A pool on loopback for ``stored_bytes`` and more, for the duration:
    the connector's JSON (as a dict). Only in a namespace of its own."""
    log_dir = Path(tempfile.mkdtemp(prefix="lmcache-tiered-mooncake-"))
    pool = pool_for(stored_bytes, log_dir)
    try:
        yield pool.spec()
    finally:
        close_pools()  # this process's clients before the pool they use
        pool.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
