"""The bench's storage devices: each drive and each remote link a shared pipe
of production bandwidth plus a per-command latency, through which every real
read and write of a tier (the plugin's, and the stock ``LocalDiskBackend``'s)
is held until the modelled device would be done.

Why a device model, not a faster clock: the replay runs on the production
clock (a wall second is a production second), so every cost that does not
grow with bytes (LMCache's Python per call and per chunk, the harness's and
the plugin's threads, a syscall) is charged once, as production pays it. Only
KV bytes are scaled down, by F (``--kv-scale``), so the working set fits this
machine. A real disk moving F times fewer bytes would finish F times sooner,
so each modelled device charges the bytes production moves (F x the real
ones) at its production bandwidth. The real I/O runs first and the device
only adds what is left of the modelled time (a floor): where the real I/O
alone took longer, this machine's disk, not the model, set the time, and the
device counts it as overrun (see :attr:`Device.overrun_s`), which makes the
run invalid beyond a small share (:mod:`lmcache_tiered.bench.model.command`).

What stays scaled with the bytes, hence cheaper than in production: work of
this CPU per byte (checksums, memcpy into LMCache's buffers). Copies to and
from the GPU are modelled apart, at the profile's PCIe rate
(:class:`lmcache_tiered.bench.model.gpu_copies.GpuCopies`).

May touch: the I/O engine of the ``Tier`` instances it is given (wrapped,
through ``Tier.engine``), the read and write calls of a ``LocalDiskBackend``
it is given (through :func:`lmcache_tiered.testing.lmcache.hook_disk_backend_io`),
and the clock (it sleeps); nothing else.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from lmcache_tiered.io.base import EngineWrapper, IOEngine, IORequest
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.testing.lmcache import hook_disk_backend_io


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One drive or link in production units: GB/s and seconds per command."""

    gbps: float
    latency_s: float

    @staticmethod
    def parse(text: str) -> DeviceSpec:
        """``GBPS`` or ``GBPS,LATENCY_MS`` (e.g. ``2.5,0.5``)."""
        gbps_text, _, latency_text = text.partition(",")
        try:
            gbps, latency_ms = float(gbps_text), float(latency_text or 0)
        except ValueError:
            gbps = latency_ms = math.nan
        if not (0 < gbps < math.inf and 0 <= latency_ms < math.inf):
            raise ValueError(f"device {text!r}: expected GBPS[,LATENCY_MS], GBPS > 0")
        return DeviceSpec(gbps, latency_ms / 1000.0)

    def __str__(self) -> str:
        return f"{self.gbps:g} GB/s + {self.latency_s * 1000:g} ms"


class Device:
    """``count`` drives (or links) of ``spec`` striped together, as one FIFO
    pipe shared by every thread that moves bytes through it.

    A transfer of ``n`` bench bytes that began (real I/O issued) at ``t``
    starts on the pipe at ``max(t, end of the transfers before it)``, holds
    it for ``n * scale / bandwidth`` and completes one latency later: the
    latency of concurrent commands overlaps, the bandwidth is shared.
    """

    def __init__(self, spec: DeviceSpec, scale: float, count: int = 1) -> None:
        if count < 1:
            raise ValueError(f"a device has at least one drive, got {count}")
        self.spec = spec
        self.count = count
        #: production bytes per bench byte (the KV scale-down factor F)
        self.scale = scale
        self._bytes_per_s = spec.gbps * 1e9 * count
        self._lock = threading.Lock()
        self._free_at = 0.0
        #: transfers and their bench bytes
        self.transfers = 0
        self.bytes = 0
        #: modelled seconds of all transfers (bandwidth and latency)
        self.modelled_s = 0.0
        #: seconds the real I/O took beyond the modelled completion
        self.overrun_s = 0.0

    def reserve(self, nbytes: int, began: float) -> float:
        """Put a transfer of ``nbytes`` bench bytes whose real I/O began at
        ``began`` (``time.monotonic()``) and has landed on the pipe; the time
        it is done on the modelled device. Real I/O that landed later than
        that counts as overrun."""
        hold = nbytes * self.scale / self._bytes_per_s
        with self._lock:
            start = max(began, self._free_at)
            self._free_at = start + hold
            done = self._free_at + self.spec.latency_s
            self.transfers += 1
            self.bytes += nbytes
            self.modelled_s += hold + self.spec.latency_s
            late = time.monotonic() - done
            if late > 0:
                self.overrun_s += late
        return done

    def transfer(self, nbytes: int, began: float) -> None:
        """Hold the caller until the transfer of ``nbytes`` bench bytes whose
        real I/O began at ``began`` is done on the modelled device."""
        if nbytes > 0:
            wait = self.reserve(nbytes, began) - time.monotonic()
            if wait > 0:
                time.sleep(wait)

    def zero_counts(self) -> None:
        """Start the counts again (``--restart``: the untimed fill is not
        part of the run); a transfer in progress keeps its place on the pipe."""
        with self._lock:
            self.transfers = self.bytes = 0
            self.modelled_s = self.overrun_s = 0.0

    def metrics(self) -> dict[str, Any]:
        """What the JSON shows of the device."""
        return {
            "model": str(self.spec),
            "drives": self.count,
            "transfers": self.transfers,
            "bench_bytes": self.bytes,
            "modelled_s": self.modelled_s,
            "overrun_s": self.overrun_s,
        }

    def __str__(self) -> str:
        drives = f"{self.count} x " if self.count > 1 else ""
        return f"{drives}{self.spec}"


class DeviceEngine(EngineWrapper):
    """A tier's engine whose batches complete when the modelled device would
    be done with them: each call's real I/O first, then the rest of its
    modelled time (:meth:`Device.reserve`) on a timer, so no thread of the
    tier's or the engine's waits for the model."""

    def __init__(self, inner: IOEngine, device: Device) -> None:
        super().__init__(inner)
        self.device = device
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        threading.Thread(
            target=self._release, name="lmcache-tiered-device", daemon=True
        ).start()

    def submit_many(
        self, batches: Sequence[Sequence[IORequest]], write: bool
    ) -> list[Future[list[int]]]:
        began = time.monotonic()
        inner = self.inner.submit_many(batches, write)
        outer: list[Future[list[int]]] = [Future() for _ in inner]
        left = [len(inner)]
        lock = threading.Lock()

        def settle() -> None:
            for real, held in zip(inner, outer, strict=True):
                if (error := real.exception()) is not None:
                    held.set_exception(error)
                else:
                    held.set_result(real.result())

        def landed(_: Future[list[int]]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            moved = sum(
                n for f in inner if f.exception() is None for n in f.result() if n > 0
            )
            if moved <= 0:
                settle()
                return
            with self._wake:
                due = self.device.reserve(moved, began)
                heapq.heappush(self._due, (due, next(self._order), settle))
                self._wake.notify()

        for real in inner:
            real.add_done_callback(landed)
        return outer

    def _release(self) -> None:
        """Complete each call's futures once its modelled time has passed."""
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    wait = self._due[0][0] - time.monotonic() if self._due else None
                    self._wake.wait(wait)
                _, _, settle = heapq.heappop(self._due)
            settle()


def model_tier(tier: Tier, device: Device) -> None:
    """Every read and write of ``tier`` goes through ``device``: its engine is
    wrapped in a :class:`DeviceEngine`."""
    tier.engine = DeviceEngine(tier.engine, device)


def model_disk_backend(backend: Any, device: Device) -> None:
    """Every chunk file LMCache's ``LocalDiskBackend`` reads or writes goes
    through ``device``."""
    hook_disk_backend_io(backend, device.transfer)
