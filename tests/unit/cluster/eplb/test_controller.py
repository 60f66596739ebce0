"""The EPLB controller against a simulated EP runtime: trigger, hysteresis, interval, migration, metrics."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from flotilla.cluster.contract import Membership
from flotilla.cluster.eplb.balance import replica_counts
from flotilla.cluster.eplb.controller import EplbController, EplbControllerConfig, EplbState
from flotilla.cluster.eplb.transfers import LayerMigration, plan_layer_migration
from flotilla.cluster.status import ClusterStatus, render_json, render_table
from flotilla.router.metrics import MembershipCollector

LAYERS, LOGICAL, RANKS, PHYSICAL = 3, 16, 4, 20


class SimulatedRuntime:
    """Splits each tick's logical load evenly over an expert's replicas; migrations change the map."""

    num_layers, num_logical, num_physical, num_ranks = LAYERS, LOGICAL, PHYSICAL, RANKS
    num_nodes, num_groups, expert_bytes = 1, 1, 1000

    def __init__(self, shares: np.ndarray) -> None:
        self.shares = shares
        self.placement = np.tile(np.array(list(range(LOGICAL)) + list(range(PHYSICAL - LOGICAL))), (LAYERS, 1))
        self.in_flight: dict[int, np.ndarray] = {}
        self.log: list[tuple[str, int]] = []

    def physical_to_logical(self) -> np.ndarray:
        return self.placement.copy()

    def drain_expert_load(self) -> np.ndarray:
        counts = replica_counts(self.placement, LOGICAL)
        return np.take_along_axis(self.shares * 10_000 / counts, self.placement, axis=1)

    def begin_layer_migration(self, layer: int, new_row: np.ndarray) -> LayerMigration:
        self.log.append(("begin", layer))
        self.in_flight[layer] = new_row
        return plan_layer_migration(self.placement[layer], new_row, RANKS)

    def finish_layer_migration(self, layer: int, new_row: np.ndarray) -> None:
        self.log.append(("finish", layer))
        assert (self.in_flight.pop(layer) == new_row).all()
        self.placement[layer] = new_row


def skewed() -> np.ndarray:
    shares = np.ones((LAYERS, LOGICAL))
    shares[:, :3] = 12.0  # the three hot experts all start on rank 0
    return shares / shares.sum(axis=1, keepdims=True)


def balanced() -> np.ndarray:
    return np.full((LAYERS, LOGICAL), 1.0 / LOGICAL)


def config(**overrides: float) -> EplbControllerConfig:
    return EplbControllerConfig(**{"window_ticks": 5, "min_window_ticks": 3, "min_interval_s": 10.0} | overrides)


def run(controller: EplbController, ticks: int, start: float = 0.0) -> float:
    for step in range(ticks):
        controller.tick(start + step)
    return start + ticks


def test_triggers_on_skew_and_restores_balance() -> None:
    runtime = SimulatedRuntime(skewed())
    controller = EplbController(runtime, config())
    run(controller, 3)
    assert controller.balancedness_overall is not None and controller.balancedness_overall < 0.75
    assert controller.state is EplbState.MIGRATING
    run(controller, 2 * LAYERS + 2, start=3)
    assert controller.state is EplbState.IDLE and controller.rebalances == 1
    run(controller, 3, start=20)
    assert controller.balancedness_overall > 0.9


def test_does_not_trigger_on_balanced_load() -> None:
    runtime = SimulatedRuntime(balanced())
    controller = EplbController(runtime, config())
    run(controller, 50)
    assert controller.balancedness_overall is not None and controller.balancedness_overall > 0.75
    assert controller.rebalances == 0 and runtime.log == []


def test_layers_migrate_one_at_a_time_with_serving_in_between() -> None:
    runtime = SimulatedRuntime(skewed())
    controller = EplbController(runtime, config())
    run(controller, 3 + 2 * LAYERS)
    begins_and_finishes = [kind for kind, _ in runtime.log]
    assert begins_and_finishes == ["begin", "finish"] * (len(runtime.log) // 2)  # never two layers in flight
    assert [layer for kind, layer in runtime.log if kind == "begin"] == sorted({layer for _, layer in runtime.log})


def test_minimum_interval_and_hysteresis_stop_repeated_rebalances() -> None:
    runtime = SimulatedRuntime(skewed())
    # 0.999 cannot be reached with 4 redundant slots: without hysteresis this would rebalance forever.
    controller = EplbController(runtime, config(trigger_balancedness=0.999, rearm_balancedness=0.9995))
    run(controller, 200)
    assert controller.rebalances == 1
    assert controller.skipped_plans >= 1
    assert not controller.armed


def test_a_new_skew_after_a_rebalance_is_handled() -> None:
    runtime = SimulatedRuntime(skewed())
    controller = EplbController(runtime, config())
    now = run(controller, 20)
    assert controller.rebalances == 1
    runtime.shares = np.roll(skewed(), 8, axis=1)  # other experts are hot now
    controller.tick(now)
    after_shift = controller.balancedness_overall
    run(controller, 30, start=now + 1)
    assert controller.rebalances == 2
    assert controller.balancedness_overall > max(after_shift, controller.config.trigger_balancedness)


def test_status_reaches_metrics_and_flotilla_status() -> None:
    runtime = SimulatedRuntime(skewed())
    controller = EplbController(runtime, config())
    run(controller, 3 + 2 * LAYERS + 3)
    eplb = controller.status()
    assert eplb.state == "idle" and eplb.rebalances == 1 and eplb.experts_moved_total > 0
    assert eplb.last_rebalance is not None
    assert eplb.last_rebalance.balancedness_planned > eplb.last_rebalance.balancedness_before
    assert len(eplb.balancedness_per_layer) == LAYERS

    # What every ingress replica exports from the coordinator's membership snapshot, labelled by EP group.
    eplb = replace(eplb, group="ep")
    registry = CollectorRegistry()
    registry.register(MembershipCollector(lambda: Membership(1, 0.0, [], eplb=[eplb])))
    value = registry.get_sample_value
    group = {"group": "ep"}
    assert value("flotilla_eplb_rebalances_total", group) == 1
    assert value("flotilla_eplb_experts_moved_total", group) == eplb.experts_moved_total
    assert value("flotilla_eplb_bytes_moved_total", group) == eplb.experts_moved_total * runtime.expert_bytes
    assert value("flotilla_eplb_rebalance_duration_seconds_count", group) == 1
    assert value("flotilla_eplb_balancedness", group | {"layer": "0"}) == eplb.balancedness_per_layer[0]
    assert value("flotilla_eplb_balancedness_overall", group) == pytest.approx(eplb.balancedness)
    assert value("flotilla_eplb_migrating", group) == 0

    table = render_table(ClusterStatus([], [eplb]))
    assert f"EPLB (ep): {RANKS} EP ranks, {LAYERS} layers" in table and "rebalances 1 " in table
    (shown,) = json.loads(render_json(ClusterStatus([], [eplb])))["eplb"]
    assert shown["rebalances"] == 1 and shown["group"] == "ep"


def test_config_rejects_rearm_below_trigger() -> None:
    with pytest.raises(ValueError, match="rearm"):
        EplbControllerConfig(trigger_balancedness=0.8, rearm_balancedness=0.7)


def test_layer_migration_plan_prefers_local_copies_and_spreads_senders() -> None:
    old = np.array([0, 1, 2, 3, 4, 5, 6, 7])  # 4 ranks x 2 slots
    new = np.array([1, 0, 0, 3, 0, 5, 0, 7])
    migration = plan_layer_migration(old, new, 4)
    assert migration.local_copies == ((1, 0), (0, 1))  # rank 0 only swaps its own slots
    assert [(t.expert, t.src_slot, t.dst_slot) for t in migration.transfers] == [(0, 0, 2), (0, 0, 4), (0, 0, 6)]
    with pytest.raises(ValueError, match="no replica"):
        plan_layer_migration(np.array([0, 0, 1, 1]), np.array([2, 0, 1, 0]), 2)
