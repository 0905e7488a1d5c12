"""Prove io_uring in a child process before the serving process touches it.

A process can die in ways no ``except`` catches: SIGILL from native code built
for a newer CPU (the PyPI ``liburing`` wheels carry AVX-512), SIGSYS from a
seccomp policy that kills on io_uring system calls. So the ring's self-test
(:func:`lmcache_tiered.io.ring.self_test`) first runs in a short-lived child,
with nothing but the standard library; only a child that exits cleanly lets
the engine use io_uring in this process. The verdict is cached per process
(one child, tens of milliseconds, per process lifetime).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from lmcache_tiered.io import ring

#: What the child runs: the ring module as a script, isolated (-I) and without
#: site-packages (-S), so nothing but CPython, libc and the kernel is tested.
PROBE_COMMAND: tuple[str, ...] = (sys.executable, "-I", "-S", ring.__file__)
#: A child that takes longer has hung in the kernel (or the host is swapping).
PROBE_TIMEOUT_S = 20.0

#: Why a signal kills the child, and what to do, per signal.
_SIGNAL_CAUSES = {
    signal.SIGILL: (
        "an instruction this CPU lacks (native code built for a newer CPU, "
        "e.g. AVX-512 on AMD EPYC Rome/Milan or many Intel parts)"
    ),
    signal.SIGSYS: (
        "a seccomp policy that kills processes calling io_uring; allow "
        "io_uring_setup/io_uring_enter/io_uring_register in the container's "
        "seccomp profile"
    ),
    signal.SIGSEGV: "a memory fault in the io_uring self-test (please report it)",
    signal.SIGBUS: "a memory fault in the io_uring self-test (please report it)",
}

#: one probe child at a time
_run_lock = threading.Lock()
#: guards the verdict and the pending thread (never held across the probe)
_state_lock = threading.Lock()
_verdict: tuple[bool, str] | None = None
#: the thread running the probe for :func:`verdict_ready`, if any
_pending: threading.Thread | None = None


def run_probe(command: Sequence[str] | None = None) -> tuple[bool, str]:
    """Run ``command`` (default :data:`PROBE_COMMAND`) as the probe child:
    ``(works, reason)``; never raises.

    ``reason`` is the child's own summary when it works, else one sentence
    that names the cause (and, where the cause has one, its fix).
    """
    try:
        child = subprocess.run(
            list(command or PROBE_COMMAND),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return False, f"the io_uring probe process hung for {PROBE_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return False, f"cannot start the io_uring probe process ({exc})"
    output = (child.stdout.strip() or child.stderr.strip()).splitlines()
    last = output[-1] if output else ""
    if child.returncode == 0:
        return True, last or "io_uring works"
    if child.returncode < 0:
        number = -child.returncode
        try:
            killer = signal.Signals(number)
        except ValueError:
            name, cause = f"signal {number}", "a fatal signal"
        else:
            name, cause = killer.name, _SIGNAL_CAUSES.get(killer, "a fatal signal")
        return False, (
            f"the io_uring probe process was killed by {name}: {cause}; "
            "io_uring would have killed this process the same way"
        )
    return False, last or f"the io_uring probe process exited with {child.returncode}"


def uring_verdict() -> tuple[bool, str]:
    """:func:`run_probe` with the real self-test, once per process."""
    global _verdict
    with _run_lock:
        if _verdict is None:
            verdict = run_probe()
            with _state_lock:
                _verdict = verdict
        return _verdict


def verdict_ready(timeout: float) -> bool:
    """Whether :func:`uring_verdict` has answered within ``timeout`` seconds
    (it runs on a thread of its own, so a hung child holds back no caller
    that does not ask for the verdict itself)."""
    global _pending
    with _state_lock:
        if _verdict is not None:
            return True
        if _pending is None or not _pending.is_alive():
            _pending = threading.Thread(
                target=uring_verdict, name="lmcache-tiered-probe-child", daemon=True
            )
            _pending.start()
        pending = _pending
    pending.join(timeout)
    return not pending.is_alive()


def forget_verdict() -> None:
    """Drop the cached verdict (tests; a host whose policy changed)."""
    global _verdict
    with _run_lock, _state_lock:
        _verdict = None
