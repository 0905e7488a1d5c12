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
parallel), after the road's *lead* (the median wait from a lookup to its
read's start when nothing was queued ahead: LMCache's server schedules a
load after the lookup; in-process the read follows at once); the recompute
estimate is the prefix's tokens at
``tiered.recompute_tokens_per_s``. The answer is the longest prefix whose
delivery is no later than its recompute. A chunk left out stays stored; vLLM
recomputes it this time. With no rate set the rule is off, and a tier not yet
measured is taken to deliver at once.

What is queued on a tier includes what earlier lookups admitted and no read
has begun yet (a *promise*, kept until a read takes its last chunk, the
lookup lets go of that chunk, or PROMISE_TTL_S): LMCache's multi-process server
looks up every waiting
request before it loads any, and each of those lookups must see the reads
the ones before it let in. A tier whose rate is older than RATE_TTL_S (the
rule stopped sending it reads) is judged at that old rate, except for one
lookup, whose first chunk on that tier is let through to measure it again: a
link that cleared is found, a burst of lookups is not all sent to a link that
did not, and the probe costs one chunk's read, not a whole prefix's.

How well it guesses is measured too: each admitted prefix's estimate is
compared with the time from its lookup to the end of the demand read that
took it (:class:`lmcache_tiered.metrics.AdmissionStats`: within
:data:`GOOD_ESTIMATE`, or over, or under; each one at DEBUG in the log). A
prefix on a tier no read has measured yet has no estimate to check.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lmcache_tiered.keys import StoreKey, key_digest
from lmcache_tiered.metrics import AdmissionStats
from lmcache_tiered.warmup.base import TierName

#: weight of a new measurement in a tier's read rate (an EWMA)
RATE_WEIGHT = 0.2
#: an estimate within this share of the measured read time counts as good
GOOD_ESTIMATE = 0.25
#: admitted prefixes (promises) kept until their read, at most (the oldest
#: are released first)
PROMISES_KEPT = 4096
logger = logging.getLogger("lmcache_tiered")

#: seconds between the log lines that say what the rule did
LOG_EVERY_S = 60.0
#: LMCache's default chunk size, tokens (``chunk_size``)
DEFAULT_CHUNK_TOKENS = 256
#: seconds a tier's measured rate is current without a new read: past it, one
#: lookup is let through to measure the tier again (a tier the rule stopped
#: reading from, too slow then, is not judged by that congestion for ever)
RATE_TTL_S = 10.0
#: seconds an admitted prefix counts as queued on its tiers if no read takes
#: any of its chunks (vLLM's GPU cache served them, or the request went away)
PROMISE_TTL_S = 10.0
#: recent leads (a lookup to its read's start, nothing queued ahead) whose
#: median is added to every estimate
LEAD_SAMPLES = 64


@dataclass
class _Tier:
    """One tier's measured demand-read rate and the bytes queued on it."""

    bytes_per_s: float | None = None
    #: bytes of the demand reads running on it
    queued_bytes: int = 0
    #: bytes admitted by lookups and not yet read (see _Promise)
    promised_bytes: int = 0
    measured_at: float = 0.0
    #: when a lookup was last let through to measure a stale rate
    probed_at: float = -RATE_TTL_S

    def current_rate(self, now: float) -> float | None:
        """The measured rate if a read measured it within RATE_TTL_S."""
        if self.bytes_per_s is None or now - self.measured_at > RATE_TTL_S:
            return None
        return self.bytes_per_s

    def probe(self, now: float) -> bool:
        """Whether a lookup now is the one let through to measure a stale
        rate again (its first chunk on the tier is judged as if the tier
        delivered it at once)."""
        if self.current_rate(now) is not None or now - self.probed_at <= RATE_TTL_S:
            return False
        self.probed_at = now
        return True


@dataclass
class Promise:
    """An admitted prefix: its delivery estimate from ``made_at`` (None
    where a tier of it was never measured) and its bytes per tier, queued
    until a read takes its last chunk, its lookup lets go of it, or
    ``expires``."""

    estimate_s: float | None
    made_at: float
    shares: dict[TierName, int]
    expires: float
    #: whether reads were queued ahead of it on its tiers at the lookup
    behind_reads: bool
    #: seconds from the lookup to the start of the read that took it
    waited_s: float = 0.0


class ReadAdmission:
    """The rule over a cache's tiers: :meth:`admit` at lookup time;
    :meth:`read_begins` and :meth:`read_done` around each demand read, and
    :meth:`reading` around each tier's share of it."""

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
        #: admitted prefixes not yet read, oldest first, by their last key's
        #: digest (a prompt's own end: a shared system prompt is its head)
        self._promises: OrderedDict[bytes, Promise] = OrderedDict()
        #: lookup-to-read waits of prefixes with nothing queued ahead: the
        #: road's own lead (LMCache's server schedules a load after the
        #: lookup; in-process the read follows at once)
        self._leads: deque[float] = deque(maxlen=LEAD_SAMPLES)
        self._lock = threading.Lock()
        self._logged_at = time.monotonic()
        self._logged = AdmissionStats()

    def tokens(self, payload_bytes: int) -> float:
        """Tokens of a chunk of ``payload_bytes`` (a full chunk holds
        ``chunk_tokens``; the last chunk of a prompt fewer)."""
        return self.chunk_tokens * payload_bytes / self.full_chunk_bytes

    def _tier_state(
        self, names: set[TierName], now: float
    ) -> dict[TierName, tuple[int, float, bool]]:
        """(bytes queued, rate, probed) of each of the measured tiers among
        ``names``; a tier missing here was never measured and delivers at
        once; a probed one is estimated, and its first chunk holds nothing
        back (call under the lock)."""
        self._expire(now)
        state = {}
        for name in names:
            tier = self._tiers.get(name)
            if tier is not None and tier.bytes_per_s:
                queued = tier.queued_bytes + tier.promised_bytes
                state[name] = (queued, tier.bytes_per_s, tier.probe(now))
        return state

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
        now = time.monotonic()
        with self._lock:
            state = self._tier_state({tier for tier, _ in chunks}, now)
            lead = statistics.median(self._leads) if self._leads else 0.0
        behind_reads = any(queued for queued, _, _ in state.values())
        seconds = {
            name: lead + queued / speed for name, (queued, speed, _) in state.items()
        }
        probing = {name for name, (_, _, probed) in state.items() if probed}
        admitted, tokens, delivery = 0, 0.0, 0.0
        expected: float | None = 0.0
        estimate: float | None = None
        for k, (tier, nbytes) in enumerate(chunks, start=1):
            tokens += self.tokens(nbytes)
            if tier not in state:
                expected = None  # delivers at once, as far as the rule knows
            else:
                seconds[tier] += nbytes / state[tier][1]
                if expected is not None:
                    expected = max(expected, seconds[tier])
                if tier in probing:
                    probing.discard(tier)  # one chunk measures it: free
                else:
                    delivery = max(delivery, seconds[tier])
            if delivery <= tokens / rate:
                admitted, estimate = k, expected
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
                promise = Promise(estimate, now, {}, now + PROMISE_TTL_S, behind_reads)
                self._promise(keys[:admitted], chunks[:admitted], promise)
        self._log_now_and_then()
        return admitted

    def _promise(
        self,
        keys: Sequence[StoreKey],
        chunks: Sequence[tuple[TierName, int]],
        promise: Promise,
    ) -> None:
        """Count an admitted prefix as queued on its tiers until read (call
        under the lock); a prefix admitted again replaces its promise."""
        last = key_digest(keys[-1])
        self._release(last)
        for tier, nbytes in chunks:
            promise.shares[tier] = promise.shares.get(tier, 0) + nbytes
            self._tiers.setdefault(tier, _Tier()).promised_bytes += nbytes
        self._promises[last] = promise
        while len(self._promises) > PROMISES_KEPT:
            self._release(next(iter(self._promises)))

    def _release(self, last: bytes) -> Promise | None:
        """Take the promise that ends with ``last`` off its tiers' queues
        (call under the lock)."""
        promise = self._promises.pop(last, None)
        if promise is not None:
            for tier, nbytes in promise.shares.items():
                self._tiers[tier].promised_bytes -= nbytes
        return promise

    def _expire(self, now: float) -> None:
        """Release the promises no read took in time (call under the lock)."""
        while self._promises:
            last, promise = next(iter(self._promises.items()))
            if promise.expires > now:
                return
            self._release(last)

    def read_begins(self, keys: Sequence[StoreKey]) -> list[Promise]:
        """A demand read of ``keys`` begins: the promises whose last chunk it
        reads leave the queues (the read's own bytes are counted by
        :meth:`reading`); they are for :meth:`read_done`. The wait of one
        with nothing queued ahead is the road's lead."""
        now = time.monotonic()
        with self._lock:
            taken = [p for k in keys if (p := self._release(key_digest(k)))]
            for promise in taken:
                promise.waited_s = now - promise.made_at
                if not promise.behind_reads:
                    self._leads.append(promise.waited_s)
        return taken

    def unpinned(self, key: StoreKey) -> None:
        """A lookup let go of ``key``: a promise ending with it that no read
        took (vLLM's GPU prefix cache served those chunks) is no longer
        queued."""
        if self.recompute_tokens_per_s is None:
            return
        with self._lock:
            self._release(key_digest(key))

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
            "estimates within 25 %% of the read: %d of %d (%d over, %d under)",
            stats.prefixes_shortened - last.prefixes_shortened,
            stats.lookups_judged - last.lookups_judged,
            LOG_EVERY_S,
            stats.chunks_recomputed - last.chunks_recomputed,
            stats.tokens_recomputed - last.tokens_recomputed,
            stats.estimates_within - last.estimates_within,
            stats.estimates_checked - last.estimates_checked,
            stats.estimates_over - last.estimates_over,
            stats.estimates_under - last.estimates_under,
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
                    old = state.current_rate(began)
                    state.bytes_per_s = (
                        rate if old is None else old + RATE_WEIGHT * (rate - old)
                    )
                    state.measured_at = began + took

    def read_done(self, promises: Sequence[Promise]) -> None:
        """The demand read that took ``promises`` (:meth:`read_begins`) is
        done: each one's estimate is held against the time from its lookup
        to now, the delivery it estimated."""
        now = time.monotonic()
        for promise in promises:
            estimate = promise.estimate_s
            if estimate is None:
                continue
            took = now - promise.made_at
            with self._lock:
                self.stats.estimates_checked += 1
                if estimate - took > GOOD_ESTIMATE * took:
                    self.stats.estimates_over += 1
                elif took - estimate > GOOD_ESTIMATE * took:
                    self.stats.estimates_under += 1
                else:
                    self.stats.estimates_within += 1
            logger.debug(
                "lmcache_tiered: read-time admission estimated %.3f s, the "
                "delivery took %.3f s (its read began after %.3f s%s)",
                estimate,
                took,
                promise.waited_s,
                ", behind others" if promise.behind_reads else "",
            )
