"""Prefix owners in ``cache_aware``: a prefix stays on the groups that hold it while no other group has room."""

from __future__ import annotations

import pytest

from bench.oracle import StaticOracle, oracle_assignment
from bench.workloads import shared_prefix
from flotilla.router.block_keys import block_keys
from flotilla.router.policies import make_policy
from flotilla.router.policies.cache_aware import CacheAwarePolicy
from flotilla.router.routing import EngineLoad, Router
from flotilla.router.sim_cluster import SimCluster
from flotilla.router.sim_engine import SimEngineConfig

BLOCK = 128
VOCAB = list(range(100, 1000))
PROMPT = [(11 * i) % 900 + 100 for i in range(4 * BLOCK + 40)]  # 5 blocks: 4 shared, the last its own
OTHER = [(13 * i) % 900 + 101 for i in range(4 * BLOCK + 40)]


def owners_of(r: Router, prompt: list[int]) -> list[str]:
    policy = r.policy
    assert isinstance(policy, CacheAwarePolicy) and policy.owners is not None
    names = r.group_names
    return [names[group] for group in policy.owners.owners(hash(tuple(prompt[:BLOCK])))]


@pytest.mark.parametrize(("seed", "kept", "without"), [(1, 0.85, 0.75), (3, 0.85, 0.75)])
def test_on_caches_short_of_the_prefixes_in_flight_owners_keep_the_oracles_hit_rate(
    seed: int, kept: float, without: float
) -> None:
    """Six 8-block prefixes, 2 groups of 32 blocks, 16 requests in flight: each group holds three prefixes and its
    running requests, not four. Judged one request at a time, the costs send some requests to the group without
    their prefix, which computes it again and evicts another; owners keep the offline oracle's placement."""
    sessions = shared_prefix(VOCAB, 6, 12, 1024, 64, 16, seed=seed)
    config = SimEngineConfig(num_blocks=32)

    def hit_rate(r: Router) -> float:
        return SimCluster(r, 2, config, precise=True).run(sessions, 16).hit_rate

    oracle = hit_rate(Router(StaticOracle(oracle_assignment(sessions, 2, BLOCK)), BLOCK))
    with_owners = hit_rate(Router(make_policy("cache_aware"), BLOCK))
    without_owners = hit_rate(Router(make_policy("cache_aware", {"keep_prefix_owners": False}), BLOCK))
    assert with_owners >= kept and with_owners >= 0.97 * oracle, (with_owners, oracle)
    assert without_owners <= without, without_owners


@pytest.mark.parametrize(
    ("b_capacity", "keep_owners", "expected"), [(10, True, "a"), (10, False, "b"), (1000, True, "b")]
)
def test_a_saturated_owner_keeps_its_prefix_only_while_no_other_group_has_room_for_it(
    b_capacity: int, keep_owners: bool, expected: str
) -> None:
    """a owns PROMPT and is saturated; b owns another prefix with a request in flight. With 10 blocks b has no room
    for PROMPT's 4 blocks beside its own 4 and the requests' private blocks: computing PROMPT there would evict b's
    prefix, so the request waits on a. With room, or without owners, the saturation filter sends it to b."""
    r = Router(make_policy("cache_aware", {"keep_prefix_owners": keep_owners}), BLOCK)
    r.add_group("a", 1000)
    r.add_group("b", b_capacity)
    first = r.route("first", PROMPT)
    assert first.group == "a"
    r.first_token(first)
    r.finished(first, [])
    assert r.route("other", OTHER).group == "b"  # stays in flight
    r.update_engine_load("a", EngineLoad(running=20, waiting=0, kv_usage=0.5))  # > 8 + 1.5 × 1
    assert r.route("again", PROMPT).group == expected


def test_an_owner_that_lost_the_prefix_is_dropped() -> None:
    r = Router(make_policy("cache_aware"), BLOCK)
    r.add_group("a", 1000)
    r.add_group("b", 1000)
    first = r.route("first", PROMPT)
    r.first_token(first)
    r.finished(first, [])
    assert owners_of(r, PROMPT) == ["a"]
    r.index.record_removed("a", block_keys(PROMPT, BLOCK))  # evicted: a neither holds, prefills nor runs it
    r.update_engine_load("a", EngineLoad(running=4, waiting=0, kv_usage=0.5))
    assert r.route("again", PROMPT).group == "b"
    assert owners_of(r, PROMPT) == ["b"]


def test_ownership_lapses_once_a_cache_worth_of_new_blocks_went_to_the_group() -> None:
    """Nobody asks for PROMPT again; the group's LRU cache has evicted it once 20 new blocks went there."""
    r = Router(make_policy("cache_aware"), BLOCK)
    r.add_group("a", 20)
    first = r.route("first", PROMPT)  # 5 new blocks and 2 private ones
    r.finished(first, [])
    for n in range(2):
        r.finished(r.route(f"unique-{n}", [200 + n] * len(PROMPT)), [])
    assert owners_of(r, PROMPT) == ["a"]  # 21 blocks went to a, 14 of them after PROMPT
    r.finished(r.route("unique-2", [300] * len(PROMPT)), [])
    assert owners_of(r, PROMPT) == []


def test_a_group_reporting_no_kv_blocks_does_not_stall_routing() -> None:
    """A leader whose engine reported no block count registers 0 blocks: every owned prefix is a cache's worth
    old at once, and one still in flight must not keep the expiry going round."""
    r = Router(make_policy("cache_aware"), BLOCK)
    r.add_group("a", 0)
    r.route("first", PROMPT)  # stays in flight
    assert r.route("second", PROMPT).group == "a"
    assert owners_of(r, PROMPT) == ["a"]


@pytest.mark.parametrize(("keep_owners", "expected"), [(True, "a"), (False, "b")])
def test_a_miss_evicts_a_prompt_requested_once_rather_than_a_reused_prefix(keep_owners: bool, expected: str) -> None:
    """Two 6-block caches holding 5 blocks each: a holds a prompt requested once, b a prefix requested twice. A
    new 5-block prompt evicts 4 cached blocks wherever it goes; only on b do they cost later hits. a is a little
    busier, so without owners (which track what was requested once) b wins."""
    r = Router(make_policy("cache_aware", {"keep_prefix_owners": keep_owners}), BLOCK)
    r.add_group("a", 6)
    r.add_group("b", 6)
    r.index.record_stored("a", block_keys(OTHER, BLOCK))
    r.index.record_stored("b", block_keys(PROMPT, BLOCK))
    for request_id in ("once", "twice", "again"):
        prompt = OTHER if request_id == "once" else PROMPT
        decision = r.route(request_id, prompt)
        assert decision.group == ("a" if prompt is OTHER else "b")
        r.first_token(decision)
        r.finished(decision, [])
    r.update_engine_load("a", EngineLoad(running=1, waiting=0, kv_usage=0.9))
    new = [(17 * i) % 900 + 103 for i in range(4 * BLOCK + 40)]
    assert r.route("new", new).group == expected
