"""Flotilla's placement and the DeepSeek baseline: validity, balance, movement, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from flotilla.cluster.eplb import deepseek
from flotilla.cluster.eplb.balance import balancedness, rank_loads, replica_counts, slots_needing_transfer
from flotilla.cluster.eplb.expert_placement import plan_placement

# (layers, logical, physical, groups, nodes, ranks)
SHAPES = [
    (3, 8, 12, 1, 1, 4),
    (4, 16, 24, 4, 2, 8),
    (3, 64, 80, 8, 2, 16),
    (2, 256, 288, 8, 4, 32),
    (2, 256, 320, 8, 8, 64),
    (2, 256, 288, 8, 16, 144),
    (2, 60, 72, 6, 4, 12),  # groups do not divide by nodes: global only
]


def zipf_load(rng: np.random.Generator, layers: int, experts: int, alpha: float = 1.0) -> np.ndarray:
    base = 1.0 / np.arange(1, experts + 1) ** alpha
    return rng.poisson(np.stack([rng.permutation(base) for _ in range(layers)]) * 1000 * experts).astype(float)


def assert_valid(placement: np.ndarray, layers: int, logical: int, physical: int, ranks: int) -> None:
    assert placement.shape == (layers, physical)
    assert placement.min() >= 0 and placement.max() < logical
    assert (replica_counts(placement, logical) >= 1).all(), "every logical expert needs a replica"
    by_rank = np.sort(placement.reshape(layers, ranks, -1), axis=2)
    assert not (by_rank[..., 1:] == by_rank[..., :-1]).any(), "a rank holds two replicas of one expert"


def test_deepseek_baseline_reproduces_the_published_example() -> None:
    weight = np.array(
        [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    )
    expected = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1], [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert deepseek.rebalance_experts(weight, 16, 4, 2, 8).tolist() == expected


@pytest.mark.parametrize("shape", SHAPES)
def test_deepseek_baseline_equals_vllm_default_policy(shape: tuple[int, ...]) -> None:
    torch = pytest.importorskip("torch")
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    layers, logical, physical, groups, nodes, ranks = shape
    weight = np.random.default_rng(3).random((layers, logical)) * 100
    theirs = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(weight), physical, groups, nodes, ranks)
    assert (deepseek.rebalance_experts(weight, physical, groups, nodes, ranks) == theirs.numpy()).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_fresh_placement_is_valid_and_at_least_as_balanced_as_deepseek(shape: tuple[int, ...], seed: int) -> None:
    layers, logical, physical, groups, nodes, ranks = shape
    weight = zipf_load(np.random.default_rng(seed), layers, logical)
    ours = plan_placement(weight, physical, groups, nodes, ranks)
    assert_valid(ours, layers, logical, physical, ranks)
    theirs = deepseek.rebalance_experts(weight, physical, groups, nodes, ranks)
    # Layer by layer, even where DeepSeek's plan puts two copies of an expert on one rank (we never do).
    assert (rank_loads(ours, weight, ranks).max(axis=1) <= rank_loads(theirs, weight, ranks).max(axis=1) + 1e-9).all()


@pytest.mark.parametrize("shape", SHAPES[:5])
def test_stationary_load_moves_almost_nothing_and_stays_as_balanced_as_deepseek(shape: tuple[int, ...]) -> None:
    layers, logical, physical, groups, nodes, ranks = shape
    rng = np.random.default_rng(7)
    expected_load = zipf_load(rng, layers, logical, alpha=0.8)
    placement = plan_placement(rng.poisson(expected_load).astype(float), physical, groups, nodes, ranks)
    moved = []
    for _ in range(3):
        window = rng.poisson(expected_load).astype(float)
        new = plan_placement(window, physical, groups, nodes, ranks, placement)
        assert_valid(new, layers, logical, physical, ranks)
        theirs = deepseek.rebalance_experts(window, physical, groups, nodes, ranks)
        assert balancedness(new, window, ranks) >= balancedness(theirs, window, ranks) - 1e-12
        moved.append(slots_needing_transfer(placement, new, ranks).mean())
        placement = new
    assert np.mean(moved) <= 0.10


def test_old_placement_kept_when_it_is_already_optimal() -> None:
    weight = np.ones((2, 16))
    old = plan_placement(weight, 16, 1, 1, 4)
    assert (plan_placement(weight, 16, 1, 1, 4, old) == old).all()


def test_a_load_shift_moves_experts_and_restores_balance() -> None:
    rng = np.random.default_rng(11)
    before = zipf_load(rng, 2, 64)
    placement = plan_placement(before, 80, 8, 2, 16)
    after = before[:, rng.permutation(64)]  # hot experts are now other experts
    stale = balancedness(placement, after, 16)
    new = plan_placement(after, 80, 8, 2, 16, placement)
    assert balancedness(new, after, 16) > stale + 0.1
    assert balancedness(new, after, 16) >= balancedness(deepseek.rebalance_experts(after, 80, 8, 2, 16), after, 16)


def test_node_aware_when_it_balances_as_well() -> None:
    # Uniform load: any placement is perfect, so the node-aware one (a group's experts on one node) wins.
    layers, logical, physical, groups, nodes, ranks = 1, 16, 16, 4, 2, 4
    placement = plan_placement(np.ones((layers, logical)), physical, groups, nodes, ranks)
    node_of_slot = np.arange(physical) // (physical // nodes)
    group_of_expert = placement[0] // (logical // groups)
    for group in range(groups):
        assert len(set(node_of_slot[group_of_expert == group])) == 1


def test_deterministic() -> None:
    weight = zipf_load(np.random.default_rng(5), 3, 64)
    old = plan_placement(weight[:, ::-1].copy(), 80, 8, 2, 16)
    assert (plan_placement(weight, 80, 8, 2, 16, old) == plan_placement(weight, 80, 8, 2, 16, old)).all()


def test_hot_expert_is_replicated_on_distinct_ranks() -> None:
    weight = np.ones((1, 8))
    weight[0, 3] = 1000.0
    placement = plan_placement(weight, 12, 1, 1, 4)
    assert replica_counts(placement, 8)[0, 3] == 4  # capped at one per rank
    assert_valid(placement, 1, 8, 12, 4)
    assert rank_loads(placement, weight, 4)[0].max() == pytest.approx(250 + 2)


@pytest.mark.parametrize(
    ("physical", "ranks", "message"),
    [(13, 4, "multiple of num_ranks"), (4, 4, "< 8 logical"), (40, 4, "duplicates")],
)
def test_rejects_impossible_shapes(physical: int, ranks: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_placement(np.ones((1, 8)), physical, 1, 1, ranks)


def test_old_map_with_empty_slots_or_other_width_is_handled() -> None:
    weight = zipf_load(np.random.default_rng(2), 2, 16)
    old = plan_placement(weight, 24, 4, 2, 8)
    old[0, :5] = -1  # vLLM's fault-tolerant scale-down leaves holes
    assert_valid(plan_placement(weight, 24, 4, 2, 8, old), 2, 16, 24, 8)
    assert_valid(plan_placement(weight, 24, 4, 2, 8, old[:, :16]), 2, 16, 24, 8)
