"""The coordinator's reading of vLLM's EPLB state on a wide-EP group: load summed over ranks, balancedness
per layer, and each rebalance (slot map changed) with the experts and bytes it moved."""

from __future__ import annotations

import numpy as np
import pytest

from flotilla.cluster.eplb.balance import balancedness
from flotilla.cluster.eplb.vllm_group import EngineEplbState, VllmEplbWatch
from flotilla.cluster.rank_probe import steps_recorded_under_this_placement

BYTES_PER_EXPERT = 1000


def snapshot(load: list[list[int]], placement: list[list[int]], took: float | None = None, recorded: int = 8) -> dict:
    """One rank's ``RankProbe.flotilla_eplb_snapshot``: 2 EP ranks, 4 experts in 6 slots (3 per rank)."""
    return {
        "ranks": 2,
        "logical_experts": 4,
        "window_steps": recorded,
        "load": load,
        "physical_to_logical": placement,
        "bytes_per_expert": BYTES_PER_EXPERT,
        "last_rearrange_s": took,
        "steps_since_rebalance": 3,
    }


BEFORE = [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
AFTER = [[3, 1, 2, 0, 0, 1], [0, 1, 2, 3, 0, 1]]  # layer 0: expert 3 copied to rank 0; expert 0 moved within rank 1


def test_load_is_summed_over_ranks_and_balancedness_is_mean_over_max_per_rank() -> None:
    state = EngineEplbState.combine(
        [
            snapshot([[6, 0, 0, 2, 0, 0], [1, 1, 1, 1, 1, 1]], BEFORE),
            None,  # a rank of a non-MoE stage reports nothing
            snapshot([[6, 0, 0, 2, 0, 0], [1, 1, 1, 1, 1, 1]], BEFORE),
        ]
    )
    assert state is not None
    assert state.load.tolist() == [[12, 0, 0, 4, 0, 0], [2, 2, 2, 2, 2, 2]]
    status = VllmEplbWatch("group-0").update(state, generation=1)
    assert status.group == "group-0" and (status.ranks, status.layers, status.physical_slots) == (2, 2, 6)
    # layer 0: ranks carry 12 and 4 (mean 8, max 12); layer 1: 6 and 6
    assert status.balancedness_per_layer == (round(8 / 12, 4), 1.0)
    assert status.balancedness == round((8 + 6) / (12 + 6), 4)
    assert status.rebalances == 0 and status.last_rebalance is None
    assert EngineEplbState.combine([None, None]) is None


def test_a_changed_slot_map_is_one_rebalance_counting_only_weights_that_crossed_ranks() -> None:
    watch = VllmEplbWatch("group-0")
    before = EngineEplbState.combine([snapshot([[12, 0, 0, 4, 0, 0], [2, 2, 2, 2, 2, 2]], BEFORE)])
    assert before is not None
    first = watch.update(before, generation=1)
    after = EngineEplbState.combine([snapshot([[4, 4, 0, 4, 4, 0], [2, 2, 2, 2, 2, 2]], AFTER, took=0.25)])
    assert after is not None
    status = watch.update(after, generation=1)
    assert status.rebalances == 1
    assert status.experts_moved_total == 1 and status.bytes_moved_total == BYTES_PER_EXPERT
    last = status.last_rebalance
    assert last is not None and last.duration_s == 0.25 and status.rebalance_duration.count == 1
    assert last.balancedness_before == pytest.approx(first.balancedness, abs=1e-4)
    planned = balancedness(np.array(AFTER), before.logical_load(), 2)
    assert last.balancedness_planned == planned
    assert watch.update(after, generation=1).rebalances == 1, "the same map read again is no rebalance"


def test_a_restarted_group_starting_from_vllms_initial_placement_is_not_a_rebalance() -> None:
    watch = VllmEplbWatch("group-0")
    rebalanced = EngineEplbState.combine([snapshot([[1] * 6, [1] * 6], AFTER)])
    fresh = EngineEplbState.combine([snapshot([[0] * 6, [0] * 6], BEFORE)])
    assert rebalanced is not None and fresh is not None
    watch.update(rebalanced, generation=1)
    status = watch.update(fresh, generation=2)
    assert status.rebalances == 0 and status.balancedness is None, "no load yet: no balancedness to show"


@pytest.mark.parametrize(
    ("steps_since_rebalance", "recorded"),
    [(0, 0), (95, 0), (96, 0), (97, 1), (127, 31), (128, 32), (140, 32)],  # 140: an async rearrangement still running
)
def test_only_the_steps_vllm_recorded_since_its_last_rearrangement_count(steps_since_rebalance, recorded) -> None:
    # vLLM (interval 128, window 32) records the load of steps 96..127 of each interval only
    assert steps_recorded_under_this_placement(steps_since_rebalance, 128, 32) == recorded


def test_the_ranks_agree_on_the_fewest_recorded_steps_and_a_placement_not_yet_recorded_has_no_balancedness() -> None:
    state = EngineEplbState.combine(
        [snapshot([[0] * 6, [0] * 6], AFTER, recorded=0), snapshot([[1] * 6] * 2, AFTER, recorded=2)]
    )
    assert state is not None and state.window_steps == 0
    status = VllmEplbWatch("group-0").update(state, generation=1)
    assert status.window_ticks == 0 and status.balancedness is None and status.balancedness_per_layer == ()


def test_between_vllms_recording_windows_balancedness_is_the_last_recorded_load_on_the_new_placement() -> None:
    watch = VllmEplbWatch("group-0")
    before = EngineEplbState.combine([snapshot([[12, 0, 0, 4, 0, 0], [2, 2, 2, 2, 2, 2]], BEFORE)])
    # vLLM just rearranged (expert 0 and 3 on both ranks in layer 0): its window still holds the old
    # placement's load, so the rank reports none
    balanced = [[0, 1, 3, 0, 2, 3], BEFORE[1]]
    rearranged = EngineEplbState.combine([snapshot([[0] * 6, [0] * 6], balanced, recorded=0)])
    recorded = EngineEplbState.combine([snapshot([[5, 0, 2, 6, 0, 2], [2, 2, 2, 2, 2, 2]], balanced, recorded=2)])
    assert before is not None and rearranged is not None and recorded is not None
    first = watch.update(before, generation=1)
    planned = watch.update(rearranged, generation=1)
    assert planned.rebalances == 1 and planned.window_ticks == 0
    assert planned.last_rebalance is not None
    assert planned.balancedness == planned.last_rebalance.balancedness_planned == 1.0
    assert first.balancedness == round((8 + 6) / (12 + 6), 4)
    measured = watch.update(recorded, generation=1)  # layer 0: ranks carry 7 and 8
    assert measured.window_ticks == 2 and measured.balancedness == round((7.5 + 6) / (8 + 6), 4)
