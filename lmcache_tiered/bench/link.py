"""A remote storage link modelled on a local disk: bandwidth and latency in
production units, paid after each real read and write of a tier.

May touch: the ``Tier`` instances it is given (their I/O entry points) and
the clock (it sleeps); nothing else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
    after the real I/O, for the bytes it moved.

    Wraps the instance's I/O entry points (demand reads into MemoryObjs,
    payload reads for copies between tiers, payload writes, which ``write``
    goes through) until Tier has a hook for it.
    """

    def over_link(
        io: Callable[..., list[Any]], moved: Callable[[Any, list[Any]], int]
    ) -> Callable[..., list[Any]]:
        def paid(*args: Any, **kwargs: Any) -> list[Any]:
            results = io(*args, **kwargs)
            nbytes = moved(args[0], results)
            if nbytes:
                time.sleep(link.delay_s(nbytes, clock))
            return results

        return paid

    def read_bytes(_: Any, objs: list[Any]) -> int:
        return sum(o.get_size() for o in objs if o is not None)

    def payload_bytes(_: Any, payloads: list[Any]) -> int:
        return sum(len(p.view) for p in payloads if p is not None)

    def written_bytes(payloads: Sequence[Any], stored: list[bool]) -> int:
        return sum(len(p.view) for p, ok in zip(payloads, stored, strict=True) if ok)

    # instance attributes shadow the methods (B010: setattr is what mypy allows)
    setattr(tier, "read", over_link(tier.read, read_bytes))  # noqa: B010
    setattr(tier, "read_payloads", over_link(tier.read_payloads, payload_bytes))  # noqa: B010
    setattr(tier, "write_payloads", over_link(tier.write_payloads, written_bytes))  # noqa: B010
