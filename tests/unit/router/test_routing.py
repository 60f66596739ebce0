"""Routing decisions: policies over the prefix index, with the simulated engine for whole workloads."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bench.workloads import hot_prefix, optimal_hit_rate, shared_prefix
from flotilla.router.block_keys import block_keys
from flotilla.router.policies import Candidates, RoutingRequest, make_policy
from flotilla.router.routing import EngineLoad, Router
from flotilla.router.settings import RoutingConfig
from flotilla.router.sim_cluster import Session, SimCluster, SimResult, Turn
from flotilla.router.sim_engine import SimEngineConfig

BLOCK = 128
VOCAB = list(range(100, 1000))
PROMPT = [(11 * i) % 900 + 100 for i in range(4 * BLOCK + 40)]


def router(policy: str = "cache_aware", groups: tuple[str, ...] = ("a", "b", "c", "d"), **params: Any) -> Router:
    """Its clock stands still: no prefill makes progress it could count (a test moving time builds its own)."""
    r = Router(make_policy(policy, params), BLOCK, clock=lambda: 0.0)
    for name in groups:
        r.add_group(name, 1000)
    return r


def serve(r: Router, prompt: list[int], request_id: str = "x") -> str:
    """Route, then let the request finish as an engine would (first token, then done)."""
    decision = r.route(request_id, prompt)
    r.first_token(decision)
    r.finished(decision, [])
    return decision.group


def record_candidates(r: Router, column: str) -> list[list[int]]:
    """The ``column`` of ``Candidates`` the policy is shown, one list per decision from now on."""
    seen: list[list[int]] = []
    choose = r.policy.choose

    def recording(request: RoutingRequest, groups: Candidates) -> int:
        seen.append(getattr(groups, column).tolist())
        return choose(request, groups)

    r.policy.choose = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("precise", [False, True], ids=["approximate", "precise"])
def test_a_repeated_prefix_goes_to_the_group_holding_it(precise: bool) -> None:
    """Sequential requests: every repeat of a prefix is a hit, so the engine hit rate is the optimum."""
    sessions = shared_prefix(VOCAB, groups=4, prompts_per_group=6, system_len=1024, question_len=64, output_len=8)
    r = Router(make_policy("cache_aware"), BLOCK)
    result = SimCluster(r, groups=4, config=SimEngineConfig(num_blocks=512), precise=precise).run(sessions, 1)
    assert result.hit_rate == pytest.approx(optimal_hit_rate(sessions, BLOCK))
    assert result.matched_blocks == result.best_matched_blocks  # always the group with the longest match


def test_without_affinity_the_same_workload_misses() -> None:
    sessions = shared_prefix(VOCAB, groups=4, prompts_per_group=6, system_len=1024, question_len=64, output_len=8)
    r = Router(make_policy("round_robin"), BLOCK)
    result = SimCluster(r, groups=4, config=SimEngineConfig(num_blocks=512), precise=True).run(sessions, 1)
    assert result.hit_rate < 0.8 * optimal_hit_rate(sessions, BLOCK)


def test_a_saturated_group_stops_receiving_affinity_traffic() -> None:
    r = router(groups=("a", "b"))
    holder = serve(r, PROMPT)
    other = "b" if holder == "a" else "a"
    assert serve(r, PROMPT, "again") == holder
    r.update_engine_load(holder, EngineLoad(running=20, waiting=0, kv_usage=0.3))  # > 8 + 1.5 × 0
    assert serve(r, PROMPT, "busy") == other


@pytest.mark.parametrize(("keep_owners", "goes_to_holder"), [(True, True), (False, False)])
def test_a_request_kept_on_its_owners_takes_a_larger_imbalance(keep_owners: bool, goes_to_holder: bool) -> None:
    """12 requests on the holder, none elsewhere: over balance_abs (8), under balance_abs_owned (16). Kept on its
    owner, the request waits there rather than computing its prefix again on the other group."""
    r = router(groups=("a", "b"), keep_prefix_owners=keep_owners)
    holder = serve(r, PROMPT)
    r.update_engine_load(holder, EngineLoad(running=12, waiting=0, kv_usage=0.3))
    assert (serve(r, PROMPT, "busy") == holder) is goes_to_holder


@pytest.mark.parametrize(("duplicate_weight", "goes_to_holder"), [(2.0, True), (1.0, False)])
def test_a_prefix_is_copied_only_when_the_holders_queue_outweighs_twice_its_prefill(
    duplicate_weight: float, goes_to_holder: bool
) -> None:
    """The holder has two 600-token prefills queued (1,272 prompt-token equivalents ahead of this request); a copy
    computes the 552-token prompt, and its 512-token prefix is charged once more per unit of duplicate_weight: 1,064
    at 1, 1,576 at 2 (the default), where the copy's prefill and the prefix it later evicts both count."""
    r = router(groups=("a", "b"), duplicate_weight=duplicate_weight)
    holder = serve(r, PROMPT)
    other_head = [(13 * i) % 900 + 101 for i in range(4 * BLOCK)]
    r.index.record_stored(holder, block_keys(other_head, BLOCK))
    for n in range(2):
        assert r.route(f"queued-{n}", other_head + [n + 1] * 600).group == holder  # no first token yet
    assert (r.route("x", PROMPT).group == holder) is goes_to_holder


@pytest.mark.parametrize(
    ("keep_sessions", "holder_running", "expected"), [(True, 0, "a"), (False, 0, "b"), (True, 20, "b")]
)
def test_a_session_stays_on_the_group_holding_its_history(
    keep_sessions: bool, holder_running: int, expected: str
) -> None:
    """Both groups hold a 4-block system prompt, a also the chat's 2-block history, and a has two 600-token prefills
    queued: about 1,340 prompt-token equivalents ahead of the next turn there, against its 296 uncached tokens and the
    512 of a duplicate on b. By the costs alone the turn moves to b (and its later turns with it); kept, it stays on
    a, unless a is saturated (20 running, over balance_abs_owned)."""
    r = router(groups=("a", "b"), keep_sessions=keep_sessions)
    system, history = PROMPT[: 4 * BLOCK], [(7 * i) % 900 + 100 for i in range(2 * BLOCK)]
    r.index.record_stored("a", block_keys(system + history, BLOCK))
    r.index.record_stored("b", block_keys(system, BLOCK))
    other_head = [(13 * i) % 900 + 101 for i in range(4 * BLOCK)]
    r.index.record_stored("a", block_keys(other_head, BLOCK))
    for n in range(2):
        assert r.route(f"queued-{n}", other_head + [n + 1] * 600).group == "a"  # no first token yet
    if holder_running:
        r.update_engine_load("a", EngineLoad(running=holder_running, waiting=0, kv_usage=0.3))
    assert r.route("next-turn", system + history + [5] * 40).group == expected


@pytest.mark.parametrize(
    ("balance_new_sessions", "chats", "expected"), [(True, True, "b"), (False, True, "a"), (True, False, "a")]
)
def test_a_new_chat_starts_on_a_lightly_loaded_group(balance_new_sessions: bool, chats: bool, expected: str) -> None:
    """a holds a 4-block system prompt and runs three of its requests; b is idle. Where those three are chats' next
    turns (a holds their histories beyond the system prompt), a new chat behind it goes to b, though a copy of the
    system prompt costs more there than a's queue: its later turns will follow it. Where they are one-off prompts
    sharing the prefix, the new request stays with the prefix."""
    r = router(groups=("a", "b"), balance_new_sessions=balance_new_sessions)
    system = PROMPT[: 4 * BLOCK]
    assert serve(r, system + [1] * 40, "first") == "a"
    r.index.record_stored("a", block_keys(system, BLOCK))
    for n in range(3):
        if chats:
            history = [(7 * i + n) % 900 + 100 for i in range(2 * BLOCK)]
            r.index.record_stored("a", block_keys(system + history, BLOCK))
            prompt = system + history + [2] * 40
        else:
            prompt = system + [n + 3] * 40
        assert r.route(f"in-flight-{n}", prompt).group == "a"
    assert r.route("new-chat", system + [9] * 40).group == expected


@pytest.mark.parametrize(("new_prefix_weight", "expected"), [(0.25, "b"), (0.0, "a")])
def test_a_new_prefix_goes_to_the_group_owning_fewer_reused_prefixes(new_prefix_weight: float, expected: str) -> None:
    """a owns a prefix requested twice (4 blocks), b owns none but runs one request more (decode_weight 16). A new
    prefix costs the same prefill on both; a's reused prefix adds 0.25 × 512 = 128 there, more than b's 16."""
    r = router(groups=("a", "b"), new_prefix_weight=new_prefix_weight)
    for request_id in ("first", "again"):
        assert serve(r, PROMPT, request_id) == "a"
        r.index.record_stored("a", block_keys(PROMPT, BLOCK))
    r.update_engine_load("b", EngineLoad(running=1, waiting=0, kv_usage=0.1))
    new_prefix = [(13 * i) % 900 + 101 for i in range(4 * BLOCK + 40)]
    assert r.route("new", new_prefix).group == expected


@pytest.mark.parametrize(("kv_saturation", "goes_to_holder"), [(1.0, True), (0.95, False)])
def test_a_full_kv_cache_saturates_a_group_only_when_asked(kv_saturation: float, goes_to_holder: bool) -> None:
    """By default a nearly full cache of running requests' blocks is a short wait, not a reason to compute the
    prefix again elsewhere."""
    r = router(groups=("a", "b"), kv_saturation=kv_saturation)
    holder = serve(r, PROMPT)
    other = "b" if holder == "a" else "a"
    r.update_engine_load(holder, EngineLoad(running=1, waiting=0, kv_usage=0.97))
    r.update_engine_load(other, EngineLoad(running=1, waiting=0, kv_usage=0.1))
    assert (serve(r, PROMPT, "kv-full") == holder) is goes_to_holder


@pytest.mark.parametrize(("eviction_weight", "expected"), [(1.0, "b"), (0.0, "a")])
def test_a_miss_goes_where_it_evicts_no_cached_prefix(eviction_weight: float, expected: str) -> None:
    """a's cache is full of other prefixes, b has room: a new prefix computed on a would evict them. (Without
    the eviction term a wins the tie by join order.)"""
    r = Router(make_policy("cache_aware", {"eviction_weight": eviction_weight}), BLOCK)
    r.add_group("a", 8)
    r.add_group("b", 64)
    r.index.record_stored("a", block_keys([7] * 8 * BLOCK, BLOCK))
    r.index.record_stored("b", block_keys([9] * 8 * BLOCK, BLOCK))
    assert r.route("x", PROMPT).group == expected


def test_the_routers_free_blocks_follow_the_index() -> None:
    r = router(groups=("a", "b"))
    r.index.record_stored("a", block_keys(PROMPT, BLOCK))
    r.remove_group("b")
    r.add_group("c", 500)
    r.add_group("b", 1000)  # back, in a new index slot
    r.index.record_stored("b", block_keys(PROMPT, BLOCK)[:2])
    seen = record_candidates(r, "free_blocks")
    r.route("x", PROMPT)
    assert seen == [[1000 - 4, 1000 - 2, 500]]  # rows in join order: a, b, c


@pytest.mark.parametrize(("keep_owners", "expected"), [(True, "a"), (False, "b")])
def test_a_group_prefilling_the_prefix_is_costed_as_holding_it(keep_owners: bool, expected: str) -> None:
    """a is prefilling PROMPT (no first token yet, so no index holds it). vLLM caches blocks when it schedules
    them, so a follower sent to a finds the 4 shared blocks cached: it goes to a, though b runs only one request
    (another ingress's), and the router counts only its own last block as prefill queued there. Without prefix
    owners every prefix may spread: a copy of a prefix still being prefilled costs only its own prefill, and b is
    cheaper."""
    r = router(groups=("a", "b"), keep_prefix_owners=keep_owners)
    r.update_engine_load("b", EngineLoad(running=1, waiting=0, kv_usage=0.1))
    seen = record_candidates(r, "prefilling_blocks")
    assert r.route("first", PROMPT).group == "a"
    follower = r.route("follower", PROMPT[: 4 * BLOCK] + [5] * 40)
    assert follower.group == expected
    assert seen == [[0, 0], [4, 0]]
    assert follower.matched_blocks == 0  # what the index held
    assert follower.uncached_tokens == (40 if expected == "a" else len(PROMPT))
    r.route("shares two blocks", PROMPT[: 2 * BLOCK] + [6] * BLOCK)
    assert seen[-1][0] == 2  # as much as this prompt shares with a's prefills


@pytest.mark.parametrize(
    ("another_prefix_in_flight", "spread_when_alone"), [(False, True), (True, True), (False, False)]
)
def test_a_hot_prefix_in_its_first_prefill_spreads(another_prefix_in_flight: bool, spread_when_alone: bool) -> None:
    """Requests for one prefix while its first prefill runs. Where that prefill is the only request in flight and
    a group is idle, the second goes to an idle group: a copy there takes compute that would otherwise wait, and
    no other prefix in flight wants that cache. With another prefix in flight, or ``spread_when_alone`` off, it
    follows the first (counted as holding the prefix). The third, with more in flight than hot_share (1.5) × a
    group's fair share, or all of them beside an idle group, finds the prefix hot: copying it costs only its own
    prefill, and it spreads."""
    r = router(groups=("a", "b", "c"), spread_when_alone=spread_when_alone)
    if another_prefix_in_flight:
        assert r.route("another", [5] * 4 * BLOCK).group == "a"
    first, second, third = (r.route(str(i), PROMPT[: 4 * BLOCK] + [i] * 40).group for i in range(3))
    assert (second == first) == (another_prefix_in_flight or not spread_when_alone)
    assert third not in (first, second)


@pytest.mark.parametrize(("capacity_blocks", "second"), [(13, "a"), (1000, "b")])
def test_a_prefix_alone_in_flight_is_copied_only_where_there_is_room(capacity_blocks: int, second: str) -> None:
    """b owns a reused 8-block prefix. A new prefix's second request, while its first is the only request in flight
    and b is idle, goes to b only where b has room for its 4 blocks beside the 8 it owns and 2 per request in
    flight (this one): 14 blocks. Otherwise the copy would evict a prefix some later request wants."""
    r = Router(make_policy("cache_aware"), BLOCK, clock=lambda: 0.0)
    for name in ("a", "b"):
        r.add_group(name, capacity_blocks)
    owned = [(13 * i) % 900 + 100 for i in range(8 * BLOCK + 40)]
    r.update_engine_load("a", EngineLoad(running=4, waiting=0, kv_usage=0.1))
    assert [serve(r, owned, "owned-1"), serve(r, owned, "owned-2")] == ["b", "b"]
    r.update_engine_load("a", EngineLoad(running=0, waiting=0, kv_usage=0.0))
    assert r.route("first", PROMPT[: 4 * BLOCK] + [0] * 40).group == "a"
    assert r.route("second", PROMPT[: 4 * BLOCK] + [1] * 40).group == second


def test_the_router_counts_prefills_in_progress_by_first_block_until_their_first_token() -> None:
    r = router(groups=("a", "b"))
    seen = record_candidates(r, "prefilling")
    first = r.route("1", PROMPT)
    second = r.route("2", PROMPT[:BLOCK] + [3] * BLOCK)  # same first block, then different
    r.route("3", [4] * 2 * BLOCK)  # another first block
    r.first_token(first)
    r.finished(second, [])  # failed before its first token
    r.route("4", PROMPT)
    r.route("5", PROMPT[: BLOCK - 1])  # shorter than a block: nothing to follow
    row = {"a": 0, "b": 1}
    expected_second = [0, 0]
    expected_second[row[first.group]] = 1
    assert seen[:2] == [[0, 0], expected_second]
    assert seen[3] == [0, 0] and seen[4] == [0, 0]


def test_misses_go_to_the_least_loaded_group_not_the_emptiest_cache() -> None:
    r = router(groups=("a", "b"))
    r.index.record_stored("a", block_keys(PROMPT, BLOCK))  # a holds a lot, b nothing
    r.update_engine_load("b", EngineLoad(running=3, waiting=0, kv_usage=0.2))
    fresh = [p + 1 for p in PROMPT]
    assert serve(r, fresh) == "a"


@pytest.mark.parametrize(("prefill_progress", "expected"), [(True, "b"), (False, "a")])
def test_a_group_midway_through_a_long_prefill_is_costed_for_the_rest(prefill_progress: bool, expected: str) -> None:
    """The router times a's first prefill (552 tokens in 0.5 s: 1,104 tokens/s) and applies that pace to b too,
    which has timed none. At 1.85 s b is 0.85 s into a 1,000-token prefill (938 tokens likely done), a 0.05 s into
    a 552-token one (55 done): a new prompt goes to b, which reaches it first; counted in full, a's queue is less."""
    now = [0.0]
    r = Router(make_policy("cache_aware", {"prefill_progress": prefill_progress}), BLOCK, clock=lambda: now[0])
    for name in ("a", "b"):
        r.add_group(name, 1000)

    def unique(first_token: int, tokens: int) -> list[int]:
        return [first_token] + [(7 * i) % 900 + 100 for i in range(tokens - 1)]

    warm_up = r.route("warm-up", unique(1, 552))
    assert warm_up.group == "a"
    now[0] = 0.5
    r.first_token(warm_up)
    r.finished(warm_up, [])
    now[0] = 1.0
    assert r.route("long", unique(2, 1000)).group == "b"  # equal costs take turns
    now[0] = 1.8
    assert r.route("short", unique(3, 552)).group == "a"
    seen = record_candidates(r, "prefill_done_tokens")
    now[0] = 1.85
    assert r.route("new", unique(4, 552)).group == expected
    assert seen[0] == pytest.approx([0.05 * 1104, 0.85 * 1104])


def warm_then_hot(prompts: int) -> list[Session]:
    """One request warms a long prefix, then many share it."""
    sessions = hot_prefix(VOCAB, prompts + 1, prefix_len=1024, suffix_len=64, output_len=64)
    first = sessions[0].turns[0]
    return [Session([Turn(first.prompt, first.output)] + [s.turns[0] for s in sessions[1:2]])] + sessions[2:]


def test_the_simulator_serves_no_request_before_it_arrives() -> None:
    """A turn is sent when the previous one finishes (a step's end), not when that step starts: an engine already
    stepping must not compute a request that has not arrived, so every TTFT is at least one step long."""
    sessions = shared_prefix(VOCAB, groups=6, prompts_per_group=8, system_len=1024, question_len=64, output_len=16)
    config = SimEngineConfig(num_blocks=32)
    cluster = SimCluster(Router(make_policy("cache_aware"), BLOCK), groups=2, config=config, precise=True)
    result = cluster.run(sessions, 8)
    assert result.requests == len(sessions)
    shortest_step = config.step_overhead_s + config.decode_s_per_seq
    assert min(result.ttft_s) >= shortest_step, min(result.ttft_s)


def test_open_loop_sessions_start_at_their_arrivals_and_wait_for_a_free_slot() -> None:
    """``request_rate``: sessions arrive at Poisson times drawn from the seed; where the cap is reached they wait, and
    their TTFT counts from when they are sent (as ``vllm bench serve --request-rate --max-concurrency``)."""
    sessions = shared_prefix(VOCAB, groups=3, prompts_per_group=4, system_len=512, question_len=64, output_len=8)

    def run(concurrency: int, request_rate: float | None) -> SimResult:
        cluster = SimCluster(Router(make_policy("cache_aware"), BLOCK), 2, SimEngineConfig(num_blocks=64), True)
        return cluster.run(sessions, concurrency, request_rate, seed=3)

    closed_one_at_a_time = run(1, None)
    flood_capped_at_one = run(1, 1e9)  # every session arrives at once and waits its turn
    assert flood_capped_at_one.ttft_s == closed_one_at_a_time.ttft_s
    assert flood_capped_at_one.hit_rate == closed_one_at_a_time.hit_rate

    gaps = random.Random(3)
    last_arrival_s = sum(gaps.expovariate(0.5) for _ in sessions[1:])
    sparse = run(64, 0.5)
    assert sparse.requests == len(sessions)
    assert last_arrival_s < sparse.makespan_s < last_arrival_s + max(closed_one_at_a_time.ttft_s) + 1.0
    assert sparse.makespan_s > 5 * closed_one_at_a_time.makespan_s  # the arrivals, not the engines, set the pace


@pytest.mark.parametrize(("policy", "spreads"), [("cache_aware", True), ("prefix_only", False)])
def test_a_hot_prefix_spreads_beyond_its_first_holder(policy: str, spreads: bool) -> None:
    r = Router(make_policy(policy), BLOCK)
    cluster = SimCluster(r, groups=4, config=SimEngineConfig(num_blocks=1024), precise=True)
    warm = hot_prefix(VOCAB, 1, 1024, 64, 8, seed=1)
    cluster.run(warm, 1)  # one group holds the prefix now
    load = cluster.run(hot_prefix(VOCAB, 64, 1024, 64, 64, seed=1)[:64], 16)
    busiest = max(load.requests_per_group.values()) / sum(load.requests_per_group.values())
    if spreads:
        assert busiest <= 0.5, load.requests_per_group
    else:
        assert busiest >= 0.9, load.requests_per_group


def test_a_prefix_carrying_all_the_load_reaches_every_group() -> None:
    """One prefix, 8 requests in flight on 4 groups: hot_share × owners × fair share (1.5 × 3 × 2) exceeds all 8 once
    3 groups own it, so the dominance clause spreads it to the fourth; serving as round robin does, not below."""

    def run(policy: str) -> SimResult:
        cluster = SimCluster(Router(make_policy(policy), BLOCK), 4, SimEngineConfig(num_blocks=48), precise=True)
        return cluster.run(hot_prefix(VOCAB, 64, 1024, 64, 16, seed=1), 8)

    spread, dealt = run("cache_aware"), run("round_robin")
    assert min(spread.requests_per_group.values()) >= 8, spread.requests_per_group
    assert spread.throughput_tokens_s >= dealt.throughput_tokens_s


def test_two_ingress_replicas_fed_the_same_events_agree() -> None:
    """Replica 1 routed the prefix; replica 2 never saw it but follows the same engine events."""
    first, second = router(), router()
    holder = serve(first, PROMPT)
    for replica in (first, second):
        replica.index.set_precise(holder, True)
        replica.index.record_stored(holder, block_keys(PROMPT, BLOCK))
    assert serve(second, PROMPT, "on-replica-2") == holder
    third = router()  # approximate only: it cannot know
    assert third.route("on-replica-3", PROMPT).best_matched_blocks == 0


@pytest.mark.parametrize(
    ("policy", "loads", "expected"),
    [
        ("least_loaded", {"a": 3, "b": 1, "c": 2, "d": 5}, "b"),
        ("round_robin", {"a": 9, "b": 9, "c": 9, "d": 9}, "a"),
        ("prefix_only", {"a": 0, "b": 50, "c": 0, "d": 0}, "b"),  # b holds the prefix; load ignored
        ("cache_aware", {"a": 0, "b": 50, "c": 0, "d": 0}, "a"),  # b is saturated; a, c, d tie: a first
    ],
)
def test_policy_choices(policy: str, loads: dict[str, int], expected: str) -> None:
    r = router(policy)
    r.index.record_stored("b", block_keys(PROMPT, BLOCK))
    for name, running in loads.items():
        r.update_engine_load(name, EngineLoad(running, 0, 0.1))
    assert r.route("x", PROMPT).group == expected


def test_power_of_two_is_seeded_and_picks_the_less_loaded_of_its_two() -> None:
    picks = []
    for _ in range(2):
        r = router("power_of_two", seed=3)
        for name, running in {"a": 4, "b": 0, "c": 2, "d": 6}.items():
            r.update_engine_load(name, EngineLoad(running, 0, 0.0))
        picks.append([r.route(str(i), PROMPT).group for i in range(8)])
    assert picks[0] == picks[1]
    assert "d" not in picks[0]  # d is the most loaded: it never wins a pair


def test_unknown_policy_parameters_are_errors() -> None:
    with pytest.raises(ValueError, match="decode_wieght"):
        make_policy("cache_aware", {"decode_wieght": 1})
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingConfig(policy="cache_awre")
