"""The EPLB loop: load windows → balancedness → trigger → plan → layer-by-layer migration.

The coordinator calls ``EplbController.tick(now)`` periodically (each call is short: it
drains the runtime's load counters and advances by at most one migration step), and shows
``status()`` in ``flotilla status``. One rebalance:

    IDLE --(armed, balancedness < trigger, interval passed, plan gains enough)--> MIGRATING
    MIGRATING: tick n begins layer l's transfers, tick n+1 swaps it, … one layer at a time,
               so every layer keeps serving (old weights) while its new weights travel
    MIGRATING --(last layer swapped)--> IDLE, window cleared

Hysteresis: after a rebalance the trigger is disarmed until balancedness has been back
above ``rearm_balancedness``; while disarmed, a rebalance still runs if the plan would gain
at least twice ``min_gain`` (the load moved), so one skew the placement cannot fix does not
cause a rebalance at every interval, and a new skew is still handled.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flotilla.cluster.contract import DurationHistogram, EplbStatus, RebalanceSummary
from flotilla.cluster.eplb.balance import balancedness_of_rank_loads, logical_loads, rank_loads, slot_rank_loads
from flotilla.cluster.eplb.expert_placement import plan_placement
from flotilla.cluster.eplb.transfers import LayerMigration


class EpRuntime(Protocol):
    """What the controller needs from an EP runtime (``cluster.eplb.runtime.CpuEpRuntime``)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_logical(self) -> int: ...
    @property
    def num_physical(self) -> int: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def expert_bytes(self) -> int: ...

    def physical_to_logical(self) -> np.ndarray: ...
    def drain_expert_load(self) -> np.ndarray: ...
    def begin_layer_migration(self, layer: int, new_row: np.ndarray) -> LayerMigration: ...
    def finish_layer_migration(self, layer: int, new_row: np.ndarray) -> None: ...


class EplbControllerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    window_ticks: int = Field(
        default=60, gt=0, description="Load samples (ticks) kept; with a 1 s tick, the last minute of traffic."
    )
    min_window_ticks: int = Field(
        default=10, gt=0, description="Samples needed before balancedness is trusted (after start or a rebalance)."
    )
    trigger_balancedness: float = Field(
        default=0.75,
        gt=0,
        le=1,
        description="Rebalance when window balancedness falls below this. vLLM deployments report 0.55-0.65 "
        "unbalanced and 0.9+ after EPLB; 0.75 ignores mild skew, whose migration costs more than it saves.",
    )
    rearm_balancedness: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="Hysteresis: after a rebalance the trigger re-arms only once balancedness was back above this.",
    )
    min_gain: float = Field(
        default=0.05,
        ge=0,
        description="A plan must raise the window's balancedness by at least this much to be executed; "
        "0.05 of balancedness is roughly 5% more tokens per step on the slowest rank.",
    )
    min_interval_s: float = Field(
        default=300.0,
        ge=0,
        description="Minimum time between rebalance starts. vLLM's default is 3000 steps (minutes at serving rates); "
        "a rebalance moves GBs per rank on real models.",
    )

    @model_validator(mode="after")
    def _rearm_above_trigger(self) -> EplbControllerConfig:
        if self.rearm_balancedness < self.trigger_balancedness:
            raise ValueError("rearm_balancedness must be >= trigger_balancedness")
        if self.min_window_ticks > self.window_ticks:
            raise ValueError("min_window_ticks must be <= window_ticks")
        return self


class EplbState(enum.Enum):
    IDLE = "idle"
    MIGRATING = "migrating"


@dataclass(slots=True)
class _Rebalance:
    target: np.ndarray
    started_s: float
    balancedness_before: float
    balancedness_planned: float
    next_layer: int = 0
    layer_in_flight: int | None = None
    experts_moved: int = 0
    bytes_moved: int = 0


@dataclass(slots=True)
class RebalanceRecord:
    started_s: float
    duration_s: float
    balancedness_before: float
    balancedness_planned: float
    experts_moved: int
    bytes_moved: int


@dataclass(slots=True)
class _LoadWindow:
    """Per-tick logical load ``[layers, logical]`` and per-rank load ``[layers, ranks]``."""

    size: int
    logical: deque[np.ndarray] = field(default_factory=deque)
    ranks: deque[np.ndarray] = field(default_factory=deque)

    def add(self, logical: np.ndarray, ranks: np.ndarray) -> None:
        self.logical.append(logical)
        self.ranks.append(ranks)
        while len(self.logical) > self.size:
            self.logical.popleft()
            self.ranks.popleft()

    def clear(self) -> None:
        self.logical.clear()
        self.ranks.clear()

    def __len__(self) -> int:
        return len(self.logical)


class EplbController:
    def __init__(
        self,
        runtime: EpRuntime,
        config: EplbControllerConfig | None = None,
    ) -> None:
        self.runtime = runtime
        self.config = config or EplbControllerConfig()
        self.window = _LoadWindow(self.config.window_ticks)
        self.state = EplbState.IDLE
        self.armed = True
        self.balancedness_per_layer: np.ndarray | None = None
        self.balancedness_overall: float | None = None
        self.last_rebalance: RebalanceRecord | None = None
        self.rebalances = 0
        self.experts_moved_total = 0
        self.bytes_moved_total = 0
        self.skipped_plans = 0
        self.durations = DurationHistogram()
        """Rebalance durations, plan to last layer swapped."""
        self._rebalance: _Rebalance | None = None
        self._last_start_s: float | None = None

    def tick(self, now: float | None = None) -> EplbState:
        """Record the load since the last tick, then advance the trigger or the migration by one step."""
        now = time.monotonic() if now is None else now
        self._record_load()
        if self.state is EplbState.MIGRATING:
            self._advance_migration(now)
        elif self._should_plan(now):
            self._plan(now)
        return self.state

    def status(self) -> EplbStatus:
        last = self.last_rebalance
        return EplbStatus(
            state=self.state.value,
            ranks=self.runtime.num_ranks,
            layers=self.runtime.num_layers,
            logical_experts=self.runtime.num_logical,
            physical_slots=self.runtime.num_physical,
            window_ticks=len(self.window),
            balancedness=self.balancedness_overall,
            balancedness_per_layer=()
            if self.balancedness_per_layer is None
            else tuple(round(float(b), 4) for b in self.balancedness_per_layer),
            rebalances=self.rebalances,
            skipped_plans=self.skipped_plans,
            experts_moved_total=self.experts_moved_total,
            bytes_moved_total=self.bytes_moved_total,
            rebalance_duration=self.durations.copy(),
            migrating_layer=None if self._rebalance is None else self._rebalance.next_layer,
            last_rebalance=None
            if last is None
            else RebalanceSummary(
                duration_s=round(last.duration_s, 3),
                balancedness_before=round(last.balancedness_before, 4),
                balancedness_planned=round(last.balancedness_planned, 4),
                experts_moved=last.experts_moved,
                bytes_moved=last.bytes_moved,
            ),
        )

    def _record_load(self) -> None:
        slot_load = self.runtime.drain_expert_load().astype(np.float64)
        placement = self.runtime.physical_to_logical()
        logical = logical_loads(placement, slot_load, self.runtime.num_logical)
        self.window.add(logical, slot_rank_loads(slot_load, self.runtime.num_ranks))
        per_layer, overall = balancedness_of_rank_loads(np.sum(self.window.ranks, axis=0))
        self.balancedness_per_layer, self.balancedness_overall = per_layer, overall
        if overall >= self.config.rearm_balancedness:
            self.armed = True

    def _should_plan(self, now: float) -> bool:
        if len(self.window) < self.config.min_window_ticks or self.balancedness_overall is None:
            return False
        if self._last_start_s is not None and now - self._last_start_s < self.config.min_interval_s:
            return False
        return self.balancedness_overall < self.config.trigger_balancedness

    def _plan(self, now: float) -> None:
        load = np.sum(self.window.logical, axis=0)
        old = self.runtime.physical_to_logical()
        target = plan_placement(
            load,
            self.runtime.num_physical,
            self.runtime.num_groups,
            self.runtime.num_nodes,
            self.runtime.num_ranks,
            old,
        )
        before = self._expected_balancedness(old, load)
        planned = self._expected_balancedness(target, load)
        # Disarmed (the last rebalance did not restore balance): only a plan that clearly helps runs.
        if planned - before < self.config.min_gain or (not self.armed and planned - before < 2 * self.config.min_gain):
            self.skipped_plans += 1
            self._last_start_s = now
            return
        self._rebalance = _Rebalance(target, now, before, planned)
        self._last_start_s = now
        self.state = EplbState.MIGRATING
        self._advance_migration(now)

    def _expected_balancedness(self, placement: np.ndarray, load: np.ndarray) -> float:
        return balancedness_of_rank_loads(rank_loads(placement, load, self.runtime.num_ranks))[1]

    def _advance_migration(self, now: float) -> None:
        rebalance = self._rebalance
        assert rebalance is not None
        if rebalance.layer_in_flight is not None:
            layer = rebalance.layer_in_flight
            self.runtime.finish_layer_migration(layer, rebalance.target[layer])
            rebalance.layer_in_flight = None
            rebalance.next_layer = layer + 1
            if rebalance.next_layer == self.runtime.num_layers:
                self._complete(now)
            return
        current = self.runtime.physical_to_logical()
        layer = rebalance.next_layer
        while layer < self.runtime.num_layers and (current[layer] == rebalance.target[layer]).all():
            layer += 1
        if layer == self.runtime.num_layers:
            self._complete(now)
            return
        migration = self.runtime.begin_layer_migration(layer, rebalance.target[layer])
        rebalance.layer_in_flight = layer
        rebalance.experts_moved += migration.experts_moved
        rebalance.bytes_moved += migration.experts_moved * self.runtime.expert_bytes

    def _complete(self, now: float) -> None:
        rebalance = self._rebalance
        assert rebalance is not None
        record = RebalanceRecord(
            rebalance.started_s,
            now - rebalance.started_s,
            rebalance.balancedness_before,
            rebalance.balancedness_planned,
            rebalance.experts_moved,
            rebalance.bytes_moved,
        )
        self.last_rebalance = record
        self.rebalances += 1
        self.experts_moved_total += record.experts_moved
        self.bytes_moved_total += record.bytes_moved
        self.durations.observe(record.duration_s)
        self._rebalance = None
        self.state = EplbState.IDLE
        self.armed = False
        self.window.clear()  # loads under the old placement say nothing about the new one
