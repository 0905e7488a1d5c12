"""The built-in warm-up policies on scripted event sequences, and the registry.

Policies never do I/O: all they see of the cache is a CacheView (where is a
key, what follows it, what time is it). So these tests drive them with an
in-memory view and a hand-moved clock; the promoter and the tiers are tested
with a real LMCache engine elsewhere.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import pytest
import torch
from lmcache.utils import CacheEngineKey

from lmcache_tiered.config import ConfigError
from lmcache_tiered.metrics import WarmupStats
from lmcache_tiered.warmup import (
    Plan,
    WarmupPolicy,
    installed_policies,
    load_policy,
    registry,
)
from lmcache_tiered.warmup.base import TierName
from lmcache_tiered.warmup.chains import ChainIndex
from lmcache_tiered.warmup.warm_copies import WarmCopies

BUILT_INS = ["frequency", "hinted", "lookahead", "none", "session"]


class FakeView:
    """A CacheView over a dict (key -> tier) and a clock the test moves."""

    def __init__(self) -> None:
        self.tiers: dict[CacheEngineKey, TierName] = {}
        self.children: dict[CacheEngineKey, list[CacheEngineKey]] = {}
        self.clock = 1000.0

    def where(self, key: CacheEngineKey) -> TierName | None:
        return self.tiers.get(key)

    def continuation(self, key: CacheEngineKey, limit: int) -> list[CacheEngineKey]:
        return self.children.get(key, [])[:limit]

    def now(self) -> float:
        return self.clock

    def put(self, keys: Sequence[CacheEngineKey], tier: TierName) -> None:
        self.tiers.update(dict.fromkeys(keys, tier))


def make_keys(n: int, start: int = 0) -> list[CacheEngineKey]:
    return [CacheEngineKey("model", 1, 0, start + i, torch.bfloat16) for i in range(n)]


def planned(plans: Sequence[Plan]) -> dict[str, list[CacheEngineKey]]:
    """Keys per target tier, in plan order."""
    out: dict[str, list[CacheEngineKey]] = {}
    for plan in plans:
        out.setdefault(plan.target, []).extend(plan.keys)
    return out


@pytest.fixture
def view() -> FakeView:
    return FakeView()


def test_built_ins_are_installed() -> None:
    assert set(BUILT_INS) <= set(installed_policies())


def test_none_plans_nothing(view: FakeView) -> None:
    policy = load_policy("none", view, {})
    keys = make_keys(4)
    view.put(keys, "cold")
    assert policy.on_hint(keys, None) == []
    assert policy.on_lookup(keys, 4) == []
    assert policy.on_tick(view.clock + 100) == []
    assert policy.admit(keys[0])


@pytest.mark.parametrize("promote_found", [False, True])
def test_lookahead_promotes_continuation_and_found_prefix_on_request(
    view: FakeView, promote_found: bool
) -> None:
    policy = load_policy(
        "lookahead", view, {"window_s": 2.0, "promote_found": str(promote_found)}
    )
    keys = make_keys(6)
    view.put(keys[:2], "cold")
    view.put(keys[2:3], "warm")
    view.put(keys[3:4], "hot")
    following = make_keys(3, start=100)
    view.put(following, "cold")
    view.children[keys[3]] = following
    # the found prefix goes to hot only when asked (its read follows at once
    # under synchronous loading)
    expected = {"hot": keys[:3]} if promote_found else {}
    expected["warm"] = following

    plans = policy.on_lookup(keys, 4)

    assert planned(plans) == expected
    assert all(p.deadline == view.clock + 2.0 for p in plans)
    # vLLM looks a waiting request up again: nothing new inside the deadline
    assert policy.on_lookup(keys, 4) == []
    view.clock += 2.5  # the plans expired without the chunks moving
    assert planned(policy.on_lookup(keys, 4)) == expected


def test_lookahead_without_hits_plans_nothing(view: FakeView) -> None:
    policy = load_policy("lookahead", view, {})
    keys = make_keys(3)
    view.put(keys, "cold")
    assert policy.on_lookup(keys, 0) == []


def test_session_promotes_chain_before_next_turn(view: FakeView) -> None:
    policy = load_policy("session", view, {"lead_s": 1.0, "warm_lead_s": 5.0})
    t0 = view.clock
    turn1 = make_keys(3)
    assert policy.on_lookup(turn1, 0) == []
    view.put(turn1, "warm")
    assert policy.on_store(turn1) == []
    assert policy.on_tick(t0 + 5) == []  # no gap observed yet: no prediction

    view.clock = t0 + 10  # turn 2 extends the chain 10 s after turn 1 stored
    turn2 = make_keys(5)
    policy.on_lookup(turn2, 3)
    view.put(turn2[3:], "warm")
    policy.on_store(turn2[3:])  # only the new keys: the chain head is learned
    stored = view.clock  # next turn expected at stored + 10

    view.put(turn2, "cold")  # demoted while the user thinks
    assert policy.on_tick(stored + 4.9) == []
    assert planned(policy.on_tick(stored + 5.0)) == {"warm": turn2}
    view.put(turn2, "warm")
    assert policy.on_tick(stored + 8.9) == []
    plans = policy.on_tick(stored + 9.0)
    assert planned(plans) == {"hot": turn2}
    assert plans[0].deadline == pytest.approx(stored + 11.0)
    assert policy.on_tick(stored + 9.5) == []


def _turn(
    policy: WarmupPolicy, view: FakeView, chain: list[CacheEngineKey], new: int
) -> None:
    """A turn: its lookup finds the chain but its last ``new`` keys, which it stores."""
    policy.on_lookup(chain, len(chain) - new)
    view.put(chain[-new:], "warm")
    policy.on_store(chain[-new:])


def test_session_plans_from_each_conversations_own_gaps(view: FakeView) -> None:
    """An agent's tool calls come back in 2 s while people take a minute: a
    conversation with gaps of its own is planned from them, not the mix."""
    policy = load_policy("session", view, {"lead_s": 0.5, "warm_lead_s": 1.0})
    agent, person = make_keys(8), make_keys(8, start=100)
    t0 = view.clock
    _turn(policy, view, person[:2], 2)
    view.clock = t0 + 60
    _turn(policy, view, person[:4], 2)  # a person's gap: 60 s
    for turn in range(1, 4):  # the agent's: 2 s, twice
        _turn(policy, view, agent[: 2 * turn], 2)
        view.clock += 2
    view.clock -= 2  # the agent's third turn stored now
    stored = view.clock
    view.put(agent[:6], "cold")
    # its own gaps (2, 2): warm 1 s before the next call is due, hot 0.5 s
    assert policy.on_tick(stored + 0.9) == []
    assert planned(policy.on_tick(stored + 1.0)) == {"warm": agent[:6]}
    plans = policy.on_tick(stored + 1.5)
    assert planned(plans) == {"hot": agent[:6]}
    assert plans[0].deadline == pytest.approx(stored + 2.5)


def test_session_leaves_the_hot_stage_to_arrival_hints_when_they_come(
    view: FakeView,
) -> None:
    policy = load_policy("session", view, {"lead_s": 1.0, "warm_lead_s": 5.0})
    chain = make_keys(4)
    _turn(policy, view, chain[:2], 2)
    view.clock += 10
    _turn(policy, view, chain, 2)
    stored = view.clock
    view.put(chain, "cold")
    # hints come: the warm stage stays the gap's, the hot one is the hint's
    hint = policy.on_hint(make_keys(2, start=500), None)
    assert hint == []  # nothing of that request is stored
    assert planned(policy.on_tick(stored + 5.0)) == {"warm": chain}
    assert policy.on_tick(stored + 9.0) == []
    plans = policy.on_hint(chain, None)
    assert planned(plans) == {"warm": chain, "hot": chain}
    assert {p.request for p in plans} == {chain[-1]}


def test_session_tracks_bounded_number_of_sessions(view: FakeView) -> None:
    policy = load_policy("session", view, {"max_sessions": "3"})
    for i in range(10):
        chain = make_keys(2, start=10 * i)
        policy.on_lookup(chain, 0)
        policy.on_store(chain)
    assert policy.tracked_sessions == 3  # type: ignore[attr-defined]


def test_frequency_keeps_shared_prefix_warm_then_hot(view: FakeView) -> None:
    policy = load_policy("frequency", view, {"warm_after": 2, "hot_after": 4})
    system = make_keys(2)
    view.put(system, "cold")
    tails = []
    for i in range(4):
        tail = make_keys(1, start=100 + i)
        view.put(tail, "cold")
        tails += tail
        policy.on_lookup(system + tail, 3)
        plans = policy.on_tick(view.clock)
        if i == 1:  # seen twice
            assert planned(plans) == {"warm": system}
        if i == 3:  # seen four times
            assert planned(plans) == {"hot": system}
        view.clock += 2.0
    assert not set(tails) & {k for p in plans for k in p.keys}


def test_frequency_counts_one_request_once_and_decays(view: FakeView) -> None:
    policy = load_policy("frequency", view, {"half_life_s": 60.0})
    keys = make_keys(2)
    view.put(keys, "cold")
    # hint, lookup and reads of one request are one access
    policy.on_hint(keys, None)
    policy.on_lookup(keys, 2)
    policy.on_hit(keys[0], "cold")
    assert policy.on_tick(view.clock) == []
    view.clock += 5
    policy.on_lookup(keys, 2)
    assert planned(policy.on_tick(view.clock)) == {"warm": keys}
    # ten half-lives later the two accesses are forgotten
    view.clock += 600
    assert policy.on_tick(view.clock) == []


def test_frequency_admission_filter(view: FakeView) -> None:
    always = load_policy("frequency", view, {})
    assert always.admit(make_keys(1, start=7)[0])  # never seen, still admitted

    policy = load_policy("frequency", view, {"admit_after_hits": "2"})
    key = make_keys(1)[0]
    assert not policy.admit(key)
    policy.on_lookup([key], 0)
    assert not policy.admit(key)  # used once: spare the SSD
    view.clock += 3
    policy.on_lookup([key], 0)
    assert policy.admit(key)  # used twice: worth writing


def test_hinted_plans_the_cached_prefix_for_its_request(view: FakeView) -> None:
    policy = load_policy("hinted", view, {"max_wait_s": 40})
    keys = make_keys(5)
    view.put([keys[0]], "warm")
    view.put([keys[1]], "hot")
    view.put([keys[2], keys[4]], "cold")  # keys[3] is stored nowhere

    plans = policy.on_hint(keys, view.clock + 1.5)
    # the cold chunk is also copied to warm (planned after: dropped if it got
    # to hot), for the requests the pin budget cannot hold; the chunk already
    # hot is planned too (the promoter pins it there); the plans are the
    # request's (its last key)
    assert [p.target for p in plans] == ["hot", "warm"]
    assert planned(plans) == {"warm": [keys[2]], "hot": [keys[0], keys[1], keys[2]]}
    assert {plan.deadline for plan in plans} == {view.clock + 1.5}
    assert {plan.request for plan in plans} == {keys[-1]}
    # one hint per request: a second one (a retry) is planned again, and the
    # promoter keeps each key with the plan that has it
    assert planned(policy.on_hint(keys, None)) == planned(plans)

    other = make_keys(2, start=50)
    view.put(other, "cold")
    # without a deadline every hint waits as long: arrival order is kept
    assert policy.on_hint(other, None)[0].deadline == view.clock + 40
    assert policy.on_hint(make_keys(2, start=90), None) == []  # nothing stored


def _run_traffic(policy: WarmupPolicy, view: FakeView, seed: int) -> list[Plan]:
    """Requests that share nothing: every event a policy can get, in vLLM's
    order, with everything stored demoted to cold between requests."""
    rng = random.Random(seed)
    plans: list[Plan] = []
    stored: list[CacheEngineKey] = []
    for i in range(200):
        keys = make_keys(rng.randint(1, 8), start=1000 * i)
        plans += policy.on_hint(keys, None)
        plans += policy.on_lookup(keys, 0)
        view.put(keys, "warm")
        plans += policy.on_store(keys)
        stored += keys
        view.put(stored, "cold")
        for key in rng.sample(stored, min(3, len(stored))):
            plans += policy.on_evict(key, "warm")
        view.clock += rng.uniform(0.0, 20.0)
        plans += policy.on_tick(view.clock)
    return plans


@pytest.mark.parametrize("name", BUILT_INS)
def test_no_plans_without_reuse(name: str, view: FakeView) -> None:
    policy = load_policy(name, view, {})
    assert _run_traffic(policy, view, seed=7) == []


def test_concurrent_events_plan_each_key_once(view: FakeView) -> None:
    """_Planner's promise (hinted plans once per hint: the promoter merges)."""
    policy = load_policy("lookahead", view, {"promote_found": True})
    keys = make_keys(64)
    view.put(keys, "cold")
    results: list[list[Plan]] = [[] for _ in range(4)]

    def worker(out: list[Plan]) -> None:
        for _ in range(50):
            out += policy.on_lookup(keys, len(keys)) + policy.on_hint(keys, None)

    threads = [threading.Thread(target=worker, args=(r,)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_target = planned([plan for r in results for plan in r])
    assert by_target  # each key once per target tier
    for promoted in by_target.values():
        assert sorted(promoted, key=lambda k: k.chunk_hash) == keys


def test_unknown_policy_lists_installed(view: FakeView) -> None:
    with pytest.raises(ConfigError) as err:
        load_policy("lookahaed", view, {})
    message = str(err.value)
    assert "tiered.warmup.policy" in message and "'lookahaed'" in message
    for name in BUILT_INS:
        assert name in message


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        ("lookahead", {"bogus": 1}, "tiered.warmup.lookahead.bogus"),
        ("none", {"window_s": 1}, "tiered.warmup.none.window_s: .* takes none"),
        ("lookahead", {"window_s": "soon"}, "tiered.warmup.lookahead.window_s"),
        ("lookahead", {"window_s": "-1"}, "tiered.warmup.lookahead.window_s: must"),
        ("frequency", {"top_k": "2.5"}, "tiered.warmup.frequency.top_k"),
        ("session", {"early_quantile": 2}, "tiered.warmup.session.early_quantile"),
    ],
)
def test_bad_parameter_names_its_key(
    view: FakeView, name: str, params: dict[str, object], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_policy(name, view, params)


def test_parameters_from_yaml_strings_get_their_types(view: FakeView) -> None:
    policy = load_policy(
        "lookahead", view, {"window_s": "3.5", "continuation_chunks": "4"}
    )
    assert policy.window_s == 3.5  # type: ignore[attr-defined]
    assert policy.continuation_chunks == 4  # type: ignore[attr-defined]
    assert isinstance(policy.continuation_chunks, int)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kind", "raw", "value"),
    [
        (bool, "yes", True),
        (int, 3.0, 3),
        (float | None, "null", None),
        (int | None, "7", 7),
        (str, 5, "5"),
        (list, ["as", "is"], ["as", "is"]),
    ],
)
def test_parameter_conversion(kind: object, raw: object, value: object) -> None:
    assert registry._coerce("tiered.warmup.p.x", kind, raw) == value


def test_chain_runs_cut_where_a_learned_parent_is_another_key() -> None:
    """Two prompts looked up (each from its first chunk), then their new
    chunks side by side in one store: two runs. Keys never seen are one."""
    index = ChainIndex()
    first, second = make_keys(3), make_keys(2, start=10)
    index.learn(first, rooted=True)
    index.learn(second, rooted=True)
    assert index.runs(first + second) == [range(0, 3), range(3, 5)]
    assert index.runs(first[1:] + second[1:]) == [range(0, 2), range(2, 3)]
    assert index.runs(make_keys(4, start=20)) == [range(0, 4)]
    assert index.continuation(first[0], 8) == first[1:]


def test_warm_copies_count_reads_from_warm_and_settle_the_rest_as_wasted(
    view: FakeView,
) -> None:
    """A copy read while in warm is used; one evicted unread, or unread by
    its deadline, is wasted when settled; each frees its share of the
    budget. A read of a copy already evicted is not counted as used."""
    stats = WarmupStats()
    copies = WarmCopies(3 * 100, stats, view)
    read, evicted, late, gone = make_keys(4)
    view.put([read, evicted, late, gone], "warm")
    for key in (read, evicted, late):
        copies.add(key, 100, deadline=view.clock + 10)
    assert copies.full() and copies.held_bytes == 300
    view.put([evicted], "cold")
    assert copies.read([read, evicted])  # the evicted one stays for settle
    assert (stats.warm_used, stats.bytes_used_warm) == (1, 100)
    assert not copies.full()
    copies.add(gone, 100, deadline=view.clock + 10)
    del view.tiers[gone]
    view.clock += 11  # past late's deadline
    copies.settle()
    assert (stats.warm_wasted, stats.bytes_wasted_warm) == (3, 300)
    assert copies.held_bytes == 0 and stats.precision_warm == 0.25
    assert not copies.read([late])  # settled: no longer a copy
