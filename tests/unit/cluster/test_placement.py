from __future__ import annotations

import pytest

from flotilla.cluster.placement import PlacementError, assign_ranks, bundle_indices_env, plan_bundles


def test_plan_bundles_leader_first_then_one_accelerator_per_rank() -> None:
    plan = plan_bundles(tp=2, pp=2, leader_cpus=1.0)
    assert plan.bundles == [{"CPU": 1.0}] + [{"GPU": 1.0}] * 4
    assert plan.strategy == "PACK"
    assert plan_bundles(tp=4, pp=1, leader_cpus=0.5).strategy == "STRICT_PACK"


@pytest.mark.parametrize(
    ("name", "bundle_nodes", "tp", "pp", "expected"),
    [
        # expected: (rank, pp_rank, tp_rank, bundle, node) per rank
        ("tp1 one node", ["a", "a"], 1, 1, [(0, 0, 0, 1, "a")]),
        ("tp2 one node", ["a", "a", "a"], 2, 1, [(0, 0, 0, 1, "a"), (1, 0, 1, 2, "a")]),
        ("pp2 leader node hosts stage 0", ["b", "a", "b"], 1, 2, [(0, 0, 0, 2, "b"), (1, 1, 0, 1, "a")]),
        (
            "tp2 pp2: stages never split across nodes",
            ["a", "b", "a", "b", "a"],
            2,
            2,
            [(0, 0, 0, 2, "a"), (1, 0, 1, 4, "a"), (2, 1, 0, 1, "b"), (3, 1, 1, 3, "b")],
        ),
        ("pp2 packed on one node", ["a", "a", "a"], 1, 2, [(0, 0, 0, 1, "a"), (1, 1, 0, 2, "a")]),
    ],
)
def test_assign_ranks(name, bundle_nodes, tp, pp, expected) -> None:
    got = [(a.rank, a.pp_rank, a.tp_rank, a.bundle_index, a.node_id) for a in assign_ranks(bundle_nodes, tp, pp)]
    assert got == expected


def test_tp_ranks_that_would_span_nodes_are_refused() -> None:
    with pytest.raises(PlacementError, match="multiple of TP"):
        assign_ranks(["a", "a", "b"], tp=2, pp=1)


def test_bundle_indices_env_lists_bundles_in_rank_order() -> None:
    assignments = assign_ranks(["b", "a", "b"], 1, 2)
    assert bundle_indices_env(assignments) == "2,1"


def test_mp_groups_hold_every_accelerator_in_the_leaders_bundle() -> None:
    from flotilla.cluster.placement import leader_bundle_ranks

    plan = plan_bundles(tp=2, pp=2, leader_cpus=1.0, executor="mp")
    assert plan.bundles == [{"CPU": 1.0, "GPU": 4.0}] and plan.strategy == "STRICT_PACK"
    ranks = leader_bundle_ranks("n1", tp=2, pp=2)
    assert [(r.rank, r.pp_rank, r.tp_rank, r.bundle_index) for r in ranks] == [
        (0, 0, 0, 0),
        (1, 0, 1, 0),
        (2, 1, 0, 0),
        (3, 1, 1, 0),
    ]
    assert bundle_indices_env(ranks) == "0,0,0,0"


def test_a_wide_ep_group_has_one_bundle_per_dp_rank_free_to_spread() -> None:
    from flotilla.cluster.placement import leader_bundle_ranks

    plan = plan_bundles(tp=2, pp=1, leader_cpus=1.0, executor="mp", data_parallel_size=3)
    assert plan.bundles == [{"CPU": 1.0, "GPU": 2.0}] * 3 and plan.strategy == "PACK"
    assert bundle_indices_env(leader_bundle_ranks("n2", tp=2, pp=1, bundle_index=2)) == "2,2"
