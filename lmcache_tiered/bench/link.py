"""A remote storage link modelled on a local disk: bandwidth and latency in
production units, paid after each real read and write of a tier.

May touch: the ``after_io`` hook of the ``Tier`` instances it is given and
the clock (it sleeps); nothing else.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from lmcache_tiered.tier import Tier


@dataclass(frozen=True, slots=True)
class LinkModel:
    """A remote cold tier emulated on a local disk: bandwidth and latency in
    production units, added after each real read and write of the cold tier."""

    gbps: float
    latency_s: float

    @staticmethod
    def parse(text: str) -> LinkModel:
        """``GBPS`` or ``GBPS,LATENCY_MS`` (e.g. ``2.5,0.5``)."""
        gbps_text, _, latency_text = text.partition(",")
        try:
            gbps, latency_ms = float(gbps_text), float(latency_text or 0)
        except ValueError:
            gbps = latency_ms = math.nan
        if not (0 < gbps < math.inf and 0 <= latency_ms < math.inf):
            raise ValueError(
                f"cold link {text!r}: expected GBPS[,LATENCY_MS], GBPS > 0"
            )
        return LinkModel(gbps, latency_ms / 1000.0)

    def delay_s(self, nbytes: int, clock: float) -> float:
        """Wall seconds to add to a read of ``nbytes`` (bench) bytes.

        Production moves ``nbytes * clock`` bytes in ``latency + bytes / bw``;
        the bench clock runs ``clock`` times faster.
        """
        return self.latency_s / clock + nbytes / (self.gbps * 1e9)

    def __str__(self) -> str:
        return f"{self.gbps:g} GB/s + {self.latency_s * 1000:g} ms per read"


def emulate_link(tier: Tier, link: LinkModel, clock: float) -> None:
    """Make ``tier`` remote: every read and write of it pays the link model
    after the real I/O, for the payload bytes it moved (:attr:`Tier.after_io`)."""

    def pay(nbytes: int) -> None:
        if nbytes:
            time.sleep(link.delay_s(nbytes, clock))

    tier.after_io = pay
