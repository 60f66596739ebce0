"""A replica group's lifecycle, seen from the process that owns it.

One group = one placement group + one leader actor + the vLLM worker actors that the
leader's engine creates inside that placement group. ``ReplicaGroup.start`` walks
placement → engine start (workers, weights, KV cache) → ready and reports each step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.engine import EngineSpec
from cluster.group_api import LEADER_NAMESPACE, leader_actor_name
from cluster.leader import EngineInfo, GroupLeader
from cluster.placement import (
    LEADER_BUNDLE_INDEX,
    RankAssignment,
    assign_ranks,
    bundle_indices_env,
    plan_bundles,
)


class GroupState(StrEnum):
    PLACING = "placing"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


def placement_group_name(group_name: str) -> str:
    return f"flotilla-pg-{group_name}"


@dataclass
class ReplicaGroup:
    name: str
    spec: EngineSpec
    leader_cpus: float = 1.0
    state: GroupState = GroupState.PLACING
    ranks: list[RankAssignment] = field(default_factory=list)
    info: EngineInfo | None = None
    error: str | None = None
    step_durations_s: dict[str, float] = field(default_factory=dict)
    placement_group: Any = None
    leader: Any = None

    async def start(self, timeout_s: float, on_progress: Callable[[ReplicaGroup], None] | None = None) -> None:
        """Place, start and wait for the engine; raises on failure or timeout (state says why)."""
        notify = on_progress or (lambda group: None)
        try:
            await asyncio.wait_for(self._start(notify), timeout_s)
        except Exception as err:
            if self.error is None:
                what = f"not ready after {timeout_s:.0f} s" if isinstance(err, TimeoutError) else str(err)
                self.error = f"{self.state.value}: {what}"
            self.state = GroupState.FAILED
            notify(self)
            raise

    async def _start(self, notify: Callable[[ReplicaGroup], None]) -> None:
        tp, pp = self.spec.tensor_parallel_size, self.spec.pipeline_parallel_size
        plan = plan_bundles(tp, pp, self.leader_cpus)
        self.state = GroupState.PLACING
        notify(self)
        began = time.monotonic()
        self.placement_group = placement_group(
            plan.bundles, strategy=plan.strategy, name=placement_group_name(self.name)
        )
        await self.placement_group.ready()
        bundle_nodes = placement_group_table(self.placement_group)["bundles_to_node_id"]
        self.ranks = assign_ranks([bundle_nodes[i] for i in range(len(plan.bundles))], tp, pp)
        self.step_durations_s["placement"] = time.monotonic() - began

        self.state = GroupState.STARTING
        notify(self)
        began = time.monotonic()
        self.leader = (
            ray.remote(GroupLeader)
            .options(
                name=leader_actor_name(self.name),
                namespace=LEADER_NAMESPACE,
                num_cpus=self.leader_cpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=LEADER_BUNDLE_INDEX
                ),
            )
            .remote(self.name, self.spec, self.placement_group, bundle_indices_env(self.ranks))
        )
        self.info = await self.leader.start.remote()
        self.step_durations_s["engine"] = time.monotonic() - began
        self.state = GroupState.READY
        notify(self)

    def stop(self) -> None:
        if self.leader is not None:
            try:
                ray.get(self.leader.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(self.leader, no_restart=True)
            self.leader = None
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        self.state = GroupState.STOPPED
