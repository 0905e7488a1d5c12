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
run invalid beyond a small share (:mod:`lmcache_tiered.bench.command`).

What stays scaled with the bytes, hence cheaper than in production: work of
this CPU per byte (checksums, memcpy into LMCache's buffers). Copies to and
from the GPU are modelled apart, at the profile's PCIe rate
(:class:`lmcache_tiered.bench.gpu_copies.GpuCopies`).

May touch: the ``after_io`` hook of the ``Tier`` instances it is given, the
read and write calls of a ``LocalDiskBackend`` it is given (through
:func:`lmcache_tiered._lmcache.hook_disk_backend_io`), and the clock (it
sleeps); nothing else.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from lmcache_tiered._lmcache import hook_disk_backend_io
from lmcache_tiered.storage.tier import Tier


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

    def transfer(self, nbytes: int, began: float) -> None:
        """Hold the caller until the transfer of ``nbytes`` bench bytes whose
        real I/O began at ``began`` (``time.monotonic()``) is done on the
        modelled device."""
        if nbytes <= 0:
            return
        hold = nbytes * self.scale / self._bytes_per_s
        with self._lock:
            start = max(began, self._free_at)
            self._free_at = start + hold
            done = self._free_at + self.spec.latency_s
            self.transfers += 1
            self.bytes += nbytes
            self.modelled_s += hold + self.spec.latency_s
        late = time.monotonic() - done
        if late < 0:
            time.sleep(-late)
        else:
            with self._lock:
                self.overrun_s += late

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


def model_tier(tier: Tier, device: Device) -> None:
    """Every read and write of ``tier`` goes through ``device``
    (:attr:`Tier.after_io`)."""
    tier.after_io = device.transfer


def model_disk_backend(backend: Any, device: Device) -> None:
    """Every chunk file LMCache's ``LocalDiskBackend`` reads or writes goes
    through ``device``."""
    hook_disk_backend_io(backend, device.transfer)
