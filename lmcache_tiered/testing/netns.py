"""A network namespace of its own with only loopback up, for what runs
Mooncake on this host (the tests, a benchmark's own pool).

Every Mooncake process and client opens listeners on all addresses whatever
its flags say (the client's handshake on 0.0.0.0, its transfers on [::]).
Inside a fresh namespace (``unshare -n``, as root, then ``ip link set lo
up``) nothing but 127.0.0.1 exists, so nothing can be reached from outside or
sent out, even by mistake. A process knows it is inside one by
:func:`isolated`; one that is not reruns itself there (:func:`command`).

May touch: nothing (the commands it builds start the processes).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Sequence

#: A fresh namespace, loopback up, then the command given after it.
PREFIX = ("unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh")


def isolated() -> bool:
    """Whether this process's only network interface is loopback."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def refused() -> str | None:
    """Why a namespace cannot be made here (None: it can), asked by making one."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is missing (util-linux, iproute2)"
    probe = subprocess.run([*PREFIX, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = probe.stderr.strip()
        return f"no network namespace here (unshare -n, as root): {why}"
    return None


def command(argv: Sequence[str]) -> list[str]:
    """``argv`` run in a namespace of its own."""
    return [*PREFIX, *argv]
