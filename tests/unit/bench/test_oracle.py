"""The offline oracle of the routing grid: a shared prefix on one group, the groups' work equal, a hot prefix spread."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.oracle import StaticOracle, oracle_assignment
from bench.workloads import hot_prefix, multi_turn, optimal_hit_rate, shared_prefix
from flotilla.router.routing import Router
from flotilla.router.sim_cluster import SimCluster
from flotilla.router.sim_engine import SimEngineConfig

BLOCK = 128
VOCAB = list(range(100, 30000))


def test_each_shared_prefix_lives_on_one_group_and_the_groups_share_the_work() -> None:
    sessions = shared_prefix(VOCAB, groups=6, prompts_per_group=4, system_len=1024, question_len=64, output_len=8)
    assignment = oracle_assignment(sessions, groups=2, block_size=BLOCK)
    groups_of_prefix: dict[tuple[int, ...], set[int]] = {}
    for session in sessions:
        prompt = session.turns[0].prompt
        groups_of_prefix.setdefault(tuple(prompt[:1024]), set()).add(assignment[tuple(prompt)])
    assert len(groups_of_prefix) == 6 and all(len(groups) == 1 for groups in groups_of_prefix.values())
    assert Counter(next(iter(g)) for g in groups_of_prefix.values()) == {0: 3, 1: 3}


def test_a_hot_prefix_is_spread_over_every_group() -> None:
    sessions = hot_prefix(VOCAB, prompts=16, prefix_len=1024, suffix_len=64, output_len=8)
    assignment = oracle_assignment(sessions, groups=4, block_size=BLOCK)
    assert Counter(assignment[tuple(s.turns[0].prompt)] for s in sessions) == {0: 4, 1: 4, 2: 4, 3: 4}


def test_a_conversation_stays_on_one_group() -> None:
    sessions = multi_turn(VOCAB, sessions=8, turns=3, system_len=256, user_len=64, output_len=16)
    assignment = oracle_assignment(sessions, groups=4, block_size=BLOCK)
    homes = [{assignment[tuple(turn.prompt)] for turn in session.turns} for session in sessions]
    assert all(len(home) == 1 for home in homes)
    assert Counter(next(iter(home)) for home in homes) == {0: 2, 1: 2, 2: 2, 3: 2}


@pytest.mark.parametrize("groups", [2, 3])
def test_with_room_and_one_request_at_a_time_the_oracle_reaches_the_ceiling(groups: int) -> None:
    sessions = shared_prefix(VOCAB, groups=6, prompts_per_group=4, system_len=1024, question_len=64, output_len=8)
    oracle = StaticOracle(oracle_assignment(sessions, groups, BLOCK))
    result = SimCluster(Router(oracle, BLOCK), groups, SimEngineConfig(num_blocks=512)).run(sessions, 1)
    assert result.hit_rate == pytest.approx(optimal_hit_rate(sessions, BLOCK))
