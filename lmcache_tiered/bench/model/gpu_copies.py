"""The modelled GPU's copies: what the stand-in connector's copies took on
this machine, and what the KV link would take for their production bytes.

The GPU clock charges the link, not this machine's memcpy of scaled-down
bytes; copies made off the engine loop (a prefetch, the multi-process
server's) are tallied apart so the loop is not charged for them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from lmcache_tiered import testing
from lmcache_tiered.bench.model.scenario import Setup
from lmcache_tiered.testing.lmcache import LMCacheEngine


@dataclass(slots=True)
class CopyTime:
    """Seconds of GPU copies: as this machine took them, and as the modelled
    link would take their production bytes."""

    measured_s: float = 0.0
    modelled_s: float = 0.0


class GpuCopies(CopyTime):
    """Times the CPU connector's copies (the stand-in for GPU uploads and
    downloads) and what the KV link (the profile's PCIe, or ``--kv-link``)
    would take for the production bytes of them, so the GPU clock charges
    the link, not this machine's memcpy of scaled-down bytes."""

    def __init__(self, engine: LMCacheEngine, setup: Setup) -> None:
        self.bytes_per_token = setup.profile.kv_bytes_per_token
        self.link_bytes_per_s = setup.kv_link_bytes_per_s
        super().__init__()  # the engine loop's copies
        #: this thread's tally of copies made off the engine loop, if any
        self._off_loop = threading.local()
        connector = engine.gpu_connector
        assert isinstance(connector, testing.CPUConnector)
        connector.after_copy = self._copied

    @contextlib.contextmanager
    def off_loop(self) -> Iterator[CopyTime]:
        """Copies this thread makes inside are not the engine loop's (a
        prefetch, or the multi-process server's copies): counted in what this
        yields instead of the loop's totals."""
        tally = CopyTime()
        self._off_loop.tally = tally
        try:
            yield tally
        finally:
            self._off_loop.tally = None

    def link_s(self, tokens: int) -> float:
        """Seconds the modelled link takes for ``tokens``' production KV."""
        return tokens * self.bytes_per_token / self.link_bytes_per_s

    def _copied(self, seconds: float, tokens: int) -> None:
        tally: CopyTime = getattr(self._off_loop, "tally", None) or self
        tally.measured_s += seconds
        tally.modelled_s += self.link_s(tokens)
