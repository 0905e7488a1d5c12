"""Read-time admission: a lookup answers only the prefix of its hits that the
tiers can deliver before recomputing that prefix would finish.

A stored chunk is worth reading only while reading it is faster than the GPU
computing it again. A cold tier behind a congested link, a degraded drive, a
slow store or a queue of reads ahead can all make a hit slower than the
recompute, and vLLM then waits for it (the complaint users of every KV
offload system file most). So when LMCache asks what is stored, the hits are
judged: for each prefix of ``k`` found chunks, the delivery estimate is the
slowest tier's share of them plus the bytes already queued on that tier, at
the rate its demand reads were last measured at (the tiers read in
parallel); the recompute estimate is the prefix's tokens at
``tiered.recompute_tokens_per_s``. The answer is the longest prefix whose
delivery is no later than its recompute. A chunk left out stays stored; vLLM
recomputes it this time. With no rate set the rule is off, and a tier not yet
measured is taken to deliver at once.

How well it guesses is measured too: each admitted prefix's estimate is
compared with the time the demand read of those chunks then took
(:class:`lmcache_tiered.metrics.AdmissionStats`: within :data:`GOOD_ESTIMATE`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.metrics import AdmissionStats
from lmcache_tiered.warmup.base import TierName

#: weight of a new measurement in a tier's read rate (an EWMA)
RATE_WEIGHT = 0.2
#: an estimate within this share of the measured read time counts as good
GOOD_ESTIMATE = 0.25
#: admitted prefixes remembered until their read (older ones are forgotten)
ESTIMATES_KEPT = 4096
logger = logging.getLogger("lmcache_tiered")

#: seconds between the log lines that say what the rule did
LOG_EVERY_S = 60.0
#: LMCache's default chunk size, tokens (``chunk_size``)
DEFAULT_CHUNK_TOKENS = 256
#: seconds a tier's measured rate stands without a new read: a tier the rule
#: stopped reading from (too slow then) is tried again after it, so a link
#: that cleared is not judged by its congestion for ever
RATE_TTL_S = 10.0


@dataclass
class _Tier:
    """One tier's measured demand-read rate and the bytes queued on it."""

    bytes_per_s: float | None = None
    queued_bytes: int = 0
    measured_at: float = 0.0

    def rate(self, now: float) -> float | None:
        """The measured rate while it stands (None: deliver at once)."""
        if self.bytes_per_s is None or now - self.measured_at > RATE_TTL_S:
            return None
        return self.bytes_per_s


class ReadAdmission:
    """The rule over a cache's tiers: :meth:`admit` at lookup time,
    :meth:`reading` around each tier's share of a demand read, and
    :meth:`read_done` once a demand read returns."""

    def __init__(
        self,
        recompute_tokens_per_s: float | None,
        *,
        full_chunk_bytes: int,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        self.recompute_tokens_per_s = recompute_tokens_per_s
        self.full_chunk_bytes = full_chunk_bytes
        self.chunk_tokens = chunk_tokens
        self.stats = AdmissionStats()
        self._tiers: dict[TierName, _Tier] = {}
        self._estimates: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()
        self._logged_at = time.monotonic()
        self._logged = AdmissionStats()

    def tokens(self, payload_bytes: int) -> float:
        """Tokens of a chunk of ``payload_bytes`` (a full chunk holds
        ``chunk_tokens``; the last chunk of a prompt fewer)."""
        return self.chunk_tokens * payload_bytes / self.full_chunk_bytes

    def _tier_state(self) -> dict[TierName, tuple[int, float]]:
        """Each measured tier's (queued bytes, rate) now; a tier missing here
        delivers at once."""
        now = time.monotonic()
        with self._lock:
            return {
                name: (tier.queued_bytes, rate)
                for name, tier in self._tiers.items()
                if (rate := tier.rate(now))
            }

    def admit(
        self, keys: Sequence[StoreKey], chunks: Sequence[tuple[TierName, int]]
    ) -> int:
        """How many of the found ``chunks`` (the lookup's prefix of hits,
        ``keys`` theirs) to answer: the longest prefix delivered no later
        than it is recomputed (all of them with the rule off)."""
        rate = self.recompute_tokens_per_s
        if rate is None or not chunks:
            return len(chunks)
        # each prefix's delivery is the slowest tier's share behind its queue:
        # one pass, each tier's time growing with its share
        state = self._tier_state()
        seconds = {name: queued / speed for name, (queued, speed) in state.items()}
        admitted, estimate, tokens, delivery = 0, 0.0, 0.0, 0.0
        for k, (tier, nbytes) in enumerate(chunks, start=1):
            tokens += self.tokens(nbytes)
            if tier in state:
                seconds[tier] += nbytes / state[tier][1]
                delivery = max(delivery, seconds[tier])
            if delivery <= tokens / rate:
                admitted, estimate = k, delivery
        with self._lock:
            stats = self.stats
            stats.lookups_judged += 1
            if admitted < len(chunks):
                stats.prefixes_shortened += 1
                stats.chunks_recomputed += len(chunks) - admitted
                stats.tokens_recomputed += round(
                    sum(self.tokens(n) for _, n in chunks[admitted:])
                )
            if admitted:
                self._estimates[key_digest(keys[0])] = estimate
                while len(self._estimates) > ESTIMATES_KEPT:
                    self._estimates.popitem(last=False)
        self._log_now_and_then()
        return admitted

    def _log_now_and_then(self) -> None:
        """One INFO line per LOG_EVERY_S at most, while the rule shortens
        lookups: what it sent to recompute and how well it guessed since."""
        now = time.monotonic()
        with self._lock:
            stats, last = self.stats, self._logged
            if (
                now - self._logged_at < LOG_EVERY_S
                or stats.prefixes_shortened == last.prefixes_shortened
            ):
                return
            self._logged_at = now
            self._logged = AdmissionStats(**vars(stats))
        logger.info(
            "lmcache_tiered: read-time admission shortened %d of %d lookups in "
            "the last %.0f s (%d chunks, %d tokens left to recompute); delivery "
            "estimates within 25 %% of the read: %d of %d",
            stats.prefixes_shortened - last.prefixes_shortened,
            stats.lookups_judged - last.lookups_judged,
            LOG_EVERY_S,
            stats.chunks_recomputed - last.chunks_recomputed,
            stats.tokens_recomputed - last.tokens_recomputed,
            stats.estimates_within - last.estimates_within,
            stats.estimates_checked - last.estimates_checked,
        )

    @contextlib.contextmanager
    def reading(self, tier: TierName, nbytes: int) -> Iterator[None]:
        """Around one tier's share of a demand read of ``nbytes``: queued
        while it runs, and its rate measured from how long it took."""
        with self._lock:
            state = self._tiers.setdefault(tier, _Tier())
            state.queued_bytes += nbytes
        began = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - began
            with self._lock:
                state.queued_bytes -= nbytes
                if nbytes > 0 and took > 0:
                    rate = nbytes / took
                    old = state.rate(began)
                    state.bytes_per_s = (
                        rate if old is None else old + RATE_WEIGHT * (rate - old)
                    )
                    state.measured_at = began + took

    def read_done(self, keys: Sequence[StoreKey], took_s: float) -> None:
        """A demand read of ``keys`` took ``took_s``: held against the
        estimate of the prefix it began with, if one was admitted."""
        if not keys:
            return
        with self._lock:
            estimate = self._estimates.pop(key_digest(keys[0]), None)
            if estimate is None:
                return
            self.stats.estimates_checked += 1
            if abs(estimate - took_s) <= GOOD_ESTIMATE * max(took_s, 1e-9):
                self.stats.estimates_within += 1
