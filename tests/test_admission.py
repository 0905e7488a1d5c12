"""Read-time admission (issue 49): a lookup answers only the prefix of its
hits that the tiers can deliver before recomputing it would finish."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
from test_faults import Chunks, Verdict, key, open_cache, tiered_config

from lmcache_tiered.cache import admission
from lmcache_tiered.cache.admission import ReadAdmission
from lmcache_tiered.io.base import EngineWrapper, IORequest
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.warmup.base import TierName

MB = 1 << 20


def judged(rule: ReadAdmission, tier: TierName, mbps: float) -> None:
    """Make ``tier`` measured at ``mbps`` MB/s (one read of 1 MB)."""
    with rule.reading(tier, MB):
        time.sleep(MB / (mbps * 1e6))


def test_without_a_recompute_rate_every_hit_is_answered() -> None:
    rule = ReadAdmission(None, full_chunk_bytes=MB)
    judged(rule, "cold", 1)  # however slow
    assert rule.admit([key(i) for i in range(4)], [("cold", MB)] * 4) == 4
    assert rule.stats.lookups_judged == 0


def test_a_tier_not_yet_measured_delivers_at_once() -> None:
    rule = ReadAdmission(1.0, full_chunk_bytes=MB)  # one token a second
    assert rule.admit([key(0)], [("cold", MB)]) == 1


def test_a_slow_tier_sends_the_prefix_to_recompute_a_fast_one_does_not() -> None:
    """256 tokens a chunk at 10,000 tokens/s: 25.6 ms to recompute one. A
    cold tier measured at 10 MB/s takes ~105 ms a 1 MiB chunk: recompute
    wins and no chunk is answered; warm at 1 GB/s takes ~1 ms: all are."""
    rule = ReadAdmission(10_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "cold", 10)
    judged(rule, "warm", 1000)
    keys = [key(i) for i in range(4)]
    assert rule.admit(keys, [("cold", MB)] * 4) == 0
    assert rule.admit(keys, [("warm", MB)] * 4) == 4
    # warm first, cold after: the warm head is worth reading, the cold tail
    # would make the whole prefix later than recomputing it
    assert rule.admit(keys, [("warm", MB)] * 2 + [("cold", MB)] * 2) == 2
    stats = rule.stats
    assert stats.lookups_judged == 3 and stats.prefixes_shortened == 2
    assert stats.chunks_recomputed == 4 + 2
    assert stats.tokens_recomputed == 6 * 256


def test_reads_queued_on_a_tier_delay_its_delivery() -> None:
    rule = ReadAdmission(10_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "warm", 100)  # ~10 ms a chunk: under the 25.6 ms recompute
    keys = [key(0)]
    assert rule.admit(keys, [("warm", MB)]) == 1
    with rule.reading("warm", 8 * MB):  # 8 MiB ahead: ~84 ms more
        assert rule.admit(keys, [("warm", MB)]) == 0
    assert rule.admit(keys, [("warm", MB)]) == 1


def test_what_earlier_lookups_admitted_is_queued_until_its_read_begins() -> None:
    """LMCache's server looks up every waiting request before it loads
    any: each lookup sees the prefixes admitted before it as queued, until
    a read takes their last chunk. At ~10.5 ms a chunk against 25.6 ms of
    recompute, two lone chunks fit one after the other, a third does not;
    once the first one's read begins, it does."""
    rule = ReadAdmission(10_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "warm", 100)
    assert rule.admit([key(0)], [("warm", MB)]) == 1
    assert rule.admit([key(1)], [("warm", MB)]) == 1
    assert rule.admit([key(2)], [("warm", MB)]) == 0
    (promise,) = rule.read_begins([key(0)])
    assert 0.005 < promise.estimate_s < 0.02
    assert rule.admit([key(2)], [("warm", MB)]) == 1
    rule.read_begins([key(1)])
    rule.read_begins([key(2)])
    # a promise is taken by a read of its last chunk (in-process, vLLM's GPU
    # cache holds the head and the retrieve reads the rest), not of its head
    # (a system prompt other prompts share)
    assert rule.admit([key(3), key(4)], [("warm", MB)] * 2) == 2
    assert rule.read_begins([key(3)]) == []
    assert len(rule.read_begins([key(3), key(4)])) == 1
    assert rule.read_begins([key(4)]) == []  # taken already


def test_a_promise_no_read_takes_lapses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix admitted and never read (the request went away) stops
    counting as queued after PROMISE_TTL_S."""
    monkeypatch.setattr(admission, "PROMISE_TTL_S", 0.2)
    rule = ReadAdmission(10_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "warm", 100)
    assert rule.admit([key(0), key(1)], [("warm", MB)] * 2) == 2
    assert rule.admit([key(2)], [("warm", MB)]) == 0
    time.sleep(0.25)
    assert rule.admit([key(2)], [("warm", MB)]) == 1


def test_a_promise_let_go_unread_stops_counting() -> None:
    """vLLM's GPU cache served an admitted prefix, so no read takes it:
    once the lookup lets go of its last chunk, it is no longer queued."""
    rule = ReadAdmission(10_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "warm", 100)
    assert rule.admit([key(0), key(1)], [("warm", MB)] * 2) == 2
    assert rule.admit([key(2)], [("warm", MB)]) == 0
    rule.unpinned(key(0))  # its head: still queued
    assert rule.admit([key(2)], [("warm", MB)]) == 0
    rule.unpinned(key(1))
    assert rule.admit([key(2)], [("warm", MB)]) == 1
    assert rule.read_begins([key(1)]) == []  # released with it, unchecked


def test_each_estimate_is_held_against_its_delivery() -> None:
    """From the lookup to the end of the read that took it: at 10 MB/s a
    1 MiB chunk is estimated at ~105 ms (recompute at 1,000 tokens/s is
    256 ms, so it is admitted); delivered 110 ms later it is within 25 %,
    300 ms later the estimate was under, at once it was over. A prefix on
    a tier never measured had no estimate: nothing to check."""
    rule = ReadAdmission(1_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "warm", 10)
    for n, delivery in enumerate([0.11, 0.3, 0.0]):
        assert rule.admit([key(n)], [("warm", MB)]) == 1
        promises = rule.read_begins([key(n)])
        time.sleep(delivery)
        rule.read_done(promises)
    rule.read_done(rule.read_begins([key(5)]))  # nothing admitted
    assert rule.admit([key(6)], [("warm", MB), ("cold", MB)]) == 2
    rule.read_done(rule.read_begins([key(6)]))
    stats = rule.stats
    assert (stats.estimates_checked, stats.estimates_within) == (3, 1)
    assert (stats.estimates_under, stats.estimates_over) == (1, 1)


def test_the_roads_lead_is_learnt_and_counted() -> None:
    """LMCache's server starts a load some time after its lookup: that
    lead (the median wait of prefixes with nothing queued ahead) is part of
    every estimate, and of the decision: at 10,000 tokens/s a warm chunk
    recomputes in 25.6 ms, less than a 50 ms lead. A prefix that waited
    behind other reads teaches nothing about it."""
    rule = ReadAdmission(1_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "warm", 1000)  # ~1 ms a chunk
    for n in range(3):
        assert rule.admit([key(n)], [("warm", MB)]) == 1
        time.sleep(0.05)
        rule.read_done(rule.read_begins([key(n)]))
    with rule.reading("warm", MB):
        assert rule.admit([key(3)], [("warm", MB)]) == 1
        time.sleep(0.3)
    rule.read_done(rule.read_begins([key(3)]))
    assert rule.admit([key(4)], [("warm", MB)]) == 1
    (promise,) = rule.read_begins([key(4)])
    assert promise.estimate_s == pytest.approx(0.05, abs=0.02)
    rule.recompute_tokens_per_s = 10_000.0
    assert rule.admit([key(5)], [("warm", MB)]) == 0


def test_a_tier_judged_slow_is_tried_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no read measuring it (the rule stopped sending it any), a slow
    tier's rate is current only RATE_TTL_S: then one lookup is answered, so
    a link that cleared is measured anew, while the lookups right after it
    are still judged at the old rate (a burst is not all sent to a link
    that did not clear); its estimate is still the old rate's. The probe is
    one chunk of that tier: what is in time before it, and no more."""
    monkeypatch.setattr(admission, "RATE_TTL_S", 0.2)
    rule = ReadAdmission(10_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "cold", 10)
    judged(rule, "warm", 1000)
    assert rule.admit([key(0)], [("cold", MB)]) == 0
    time.sleep(0.25)
    judged(rule, "warm", 1000)  # warm is read on; cold is stale
    chunks: list[tuple[TierName, int]] = [("warm", MB)] * 2 + [("cold", MB)] * 3
    assert rule.admit([key(i) for i in range(5)], chunks) == 3
    assert rule.admit([key(1)], [("cold", MB)]) == 0
    (promise,) = rule.read_begins([key(2)])
    assert promise.estimate_s is not None
    assert promise.estimate_s > 0.05  # ~105 ms at the old 10 MB/s, not "at once"
    time.sleep(0.25)
    assert rule.admit([key(1)], [("cold", MB)]) == 1


class SlowDrive(EngineWrapper):
    """A drive that takes ``delay_s`` more for every batch (a stand-in for a
    congested link: no real drive here is that slow on demand)."""

    delay_s = 0.0

    def submit_many(
        self, batches: Sequence[Sequence[IORequest]], write: bool
    ) -> list[Future[list[int]]]:
        if not write:
            time.sleep(self.delay_s)
        return self.inner.submit_many(batches, write)


def test_the_cache_answers_what_its_slow_tier_can_deliver(tmp_path: Path) -> None:
    """A real cache on real files: after a read of its warm tier measured it
    slow (0.2 s a batch, a stand-in delay), a lookup answers no chunk (4 x
    256 tokens at 10,000 tokens/s is 0.1 s of recompute), unpins them, and
    they stay stored and exact. Fast again, the lookup answers all, and the
    estimate is held against the read that follows."""
    chunks = Chunks()
    cache = open_cache(tiered_config([tmp_path], recompute_tokens_per_s=10_000), chunks)
    try:
        keys = [key(i) for i in range(4)]
        objs = [chunks.make(i) for i in range(4)]
        assert (
            cache.store([Payload.of(k, o) for k, o in zip(keys, objs, strict=True)])
            == [True] * 4
        )
        drive = SlowDrive(cache.warm.engine)
        cache.warm.engine = drive
        drive.delay_s = 0.2
        verdict = Verdict()
        verdict.check(range(4), cache.read(keys))  # measures warm: slow
        assert cache.prefix_hits(keys, pin=True) == 0
        assert cache.admission.stats.tokens_recomputed == 4 * 256
        assert all((e := cache.warm.index.get(k)) and e.pins == 0 for k in keys)
        # a check that pins nothing (LMCache asking before it stores) reads
        # nothing: answered whole, not judged, nothing queued
        judged_before = cache.admission.stats.lookups_judged
        assert cache.prefix_hits(keys) == 4
        assert cache.admission.stats.lookups_judged == judged_before
        drive.delay_s = 0.0
        for _ in range(20):  # the rate recovers as reads measure it
            verdict.check(range(4), cache.read(keys))
        assert cache.prefix_hits(keys, pin=True) == 4
        verdict.check(range(4), cache.read(keys))
        for k in keys:
            cache.unpin(k)
        assert verdict.wrong_bytes == 0 and verdict.misses == 0
        stats = cache.snapshot()["admission"]
        assert stats["estimates_checked"] >= 1
    finally:
        cache.close()


def test_the_log_says_what_the_rule_did(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One line at most per LOG_EVERY_S, and only while it shortens."""
    monkeypatch.setattr(admission, "LOG_EVERY_S", 0.0)
    rule = ReadAdmission(10_000.0, full_chunk_bytes=MB, chunk_tokens=256)
    judged(rule, "cold", 10)
    with caplog.at_level(logging.INFO, logger="lmcache_tiered"):
        rule.admit([key(0)], [("cold", MB)] * 2)
        rule.admit([key(0)], [("cold", MB)] * 2)
    lines = [r.getMessage() for r in caplog.records if "admission" in r.getMessage()]
    assert len(lines) == 2
    assert "shortened 1 of 1 lookups" in lines[0] and "2 chunks, 512 tokens" in lines[0]
    monkeypatch.setattr(admission, "LOG_EVERY_S", 3600.0)
    with caplog.at_level(logging.INFO, logger="lmcache_tiered"):
        rule.admit([key(0)], [("cold", MB)] * 2)
    assert len([r for r in caplog.records if "admission" in r.getMessage()]) == 2
