"""vLLM's EPLB on a wide-EP group of vLLM engines, as the coordinator reports it.

The engines rebalance themselves (vLLM's ``EplbState``, with Flotilla's placement as its policy;
on CPU through the platform plugin, ``vllm_cpu_eplb``). The coordinator reads every rank's EPLB
state (``RankProbe.flotilla_eplb_snapshot``) every few seconds and turns it into the same
:class:`EplbStatus` the CPU EP runtime's controller reports: balancedness per layer over the steps
of vLLM's load window recorded under the current placement, and each rebalance it sees (the slot map
changed since the last read) with the experts and bytes it moved and, where the engine timed it, how
long it took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flotilla.cluster.contract import DurationHistogram, EplbStatus, RebalanceSummary
from flotilla.cluster.eplb.balance import (
    balancedness,
    balancedness_of_rank_loads,
    logical_loads,
    rank_loads,
    slot_rank_loads,
    slots_needing_transfer,
)


@dataclass(frozen=True, slots=True)
class EngineEplbState:
    """The EP group's EPLB state summed over its ranks (each rank records the load it routed)."""

    ranks: int
    logical_experts: int
    window_steps: int
    """Engine steps of the current placement that ``load`` covers: vLLM records its window only in the last
    ``window_size`` steps before a rearrangement, so this is 0 for most of an interval."""
    load: np.ndarray
    """``[layers, physical slots]`` tokens routed to each slot over those steps."""
    physical_to_logical: np.ndarray
    bytes_per_expert: int
    last_rearrange_s: float | None
    steps_since_rebalance: int
    """Engine steps since vLLM last rearranged (or started)."""

    @classmethod
    def combine(cls, snapshots: list[dict[str, Any]]) -> EngineEplbState | None:
        """One state from every rank's snapshot (None when no rank runs EPLB)."""
        present = [s for s in snapshots if s is not None]
        if not present:
            return None
        first = present[0]
        durations = [s["last_rearrange_s"] for s in present if s.get("last_rearrange_s") is not None]
        return cls(
            ranks=int(first["ranks"]),
            logical_experts=int(first["logical_experts"]),
            window_steps=min(int(s["window_steps"]) for s in present),
            load=np.sum([np.asarray(s["load"], dtype=np.float64) for s in present], axis=0),
            physical_to_logical=np.asarray(first["physical_to_logical"], dtype=np.int64),
            bytes_per_expert=int(first["bytes_per_expert"]),
            last_rearrange_s=max(durations) if durations else None,  # the slowest rank ends the rearrangement
            steps_since_rebalance=min(int(s["steps_since_rebalance"]) for s in present),
        )

    def rank_loads(self) -> np.ndarray:
        return slot_rank_loads(self.load, self.ranks)

    def logical_load(self) -> np.ndarray:
        return logical_loads(self.physical_to_logical, self.load, self.logical_experts)


@dataclass
class VllmEplbWatch:
    """What the coordinator remembers of one EP group between reads."""

    group: str
    rebalances: int = 0
    experts_moved_total: int = 0
    bytes_moved_total: int = 0
    durations: DurationHistogram = field(default_factory=DurationHistogram)
    last_rebalance: RebalanceSummary | None = None
    _previous: EngineEplbState | None = None
    _generation: int = -1
    _previous_balancedness: float | None = None
    _last_logical_load: np.ndarray | None = None
    """``[layers, logical experts]`` load of the latest steps recorded (under whichever placement)."""

    def update(self, state: EngineEplbState, generation: int) -> EplbStatus:
        """The status after reading ``state`` from the group's engines of ``generation`` (a restarted
        group starts again from vLLM's initial placement: not a rebalance).

        Balancedness is measured over the steps recorded under the current placement; between vLLM's
        recording windows (most of an interval) it is the latest recorded load spread over the current
        placement, which is what vLLM's policy planned for (a logical expert's load does not depend on
        where it sits). ``window_ticks`` says which: the steps measured, 0 for the planned figure."""
        previous = self._previous if generation == self._generation else None
        if previous is None:
            self._last_logical_load = None
        self._generation = generation
        if previous is not None and not np.array_equal(previous.physical_to_logical, state.physical_to_logical):
            moved = int(
                slots_needing_transfer(previous.physical_to_logical, state.physical_to_logical, state.ranks).sum()
            )
            self.rebalances += 1
            self.experts_moved_total += moved
            self.bytes_moved_total += moved * state.bytes_per_expert
            if state.last_rearrange_s is not None:
                self.durations.observe(state.last_rearrange_s)
            self.last_rebalance = RebalanceSummary(
                duration_s=state.last_rearrange_s if state.last_rearrange_s is not None else float("nan"),
                balancedness_before=self._previous_balancedness or 0.0,
                balancedness_planned=(
                    balancedness(state.physical_to_logical, self._last_logical_load, state.ranks)
                    if self._last_logical_load is not None
                    else float("nan")
                ),  # the load seen before, under the new placement
                experts_moved=moved,
                bytes_moved=moved * state.bytes_per_expert,
            )
        self._previous = state
        measured = state.window_steps > 0 and bool(state.load.sum() > 0)
        loads: np.ndarray | None = None
        if measured:
            loads = state.rank_loads()
            self._last_logical_load = state.logical_load()
        elif self._last_logical_load is not None:
            loads = rank_loads(state.physical_to_logical, self._last_logical_load, state.ranks)
        per_layer, overall = balancedness_of_rank_loads(loads) if loads is not None else ((), 0.0)
        if measured:
            self._previous_balancedness = overall
        return EplbStatus(
            group=self.group,
            state="idle",
            ranks=state.ranks,
            layers=int(state.load.shape[0]),
            logical_experts=state.logical_experts,
            physical_slots=int(state.load.shape[1]),
            window_ticks=state.window_steps,
            balancedness=round(overall, 4) if loads is not None else None,
            balancedness_per_layer=tuple(round(float(b), 4) for b in per_layer),
            rebalances=self.rebalances,
            skipped_plans=0,
            experts_moved_total=self.experts_moved_total,
            bytes_moved_total=self.bytes_moved_total,
            rebalance_duration=self.durations.copy(),
            migrating_layer=None,
            last_rebalance=self.last_rebalance,
            steps_since_rebalance=state.steps_since_rebalance,
        )
