"""One replica group's Ray resources: its placement group, its leader actor(s), and their teardown.

One group = one placement group + one leader actor + the vLLM worker actors that the
leader's engine creates inside that placement group. A wide-EP group has one leader (one
engine, one routable member) per DP rank, all in the group's one placement group. ``ReplicaGroup.start`` walks
placement → engine start (workers, weights, KV cache) → ready and reports each step;
``teardown`` removes all of it at once (the gang). Both are detached from their creator, so
a coordinator that dies and comes back finds its groups still serving (``adopt``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import (
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flotilla.cluster.contract import DEFAULT_NAMESPACE, EngineInfo, EnginePhase, LeaderDescription, leader_actor_name
from flotilla.cluster.engine import EngineSpec
from flotilla.cluster.leader import GroupLeader
from flotilla.cluster.placement import (
    LEADER_BUNDLE_INDEX,
    RankAssignment,
    assign_ranks,
    bundle_indices_env,
    leader_bundle_ranks,
    plan_bundles,
)

LEADER_SHUTDOWN_TIMEOUT_S = 10.0


ADOPT_TIMEOUT_S = 5.0
"""A leader that does not describe itself within this is not adopted (it may be hung)."""


def placement_group_name(group_name: str) -> str:
    return f"flotilla-pg-{group_name}"


def member_names(group_name: str, data_parallel_size: int) -> list[str]:
    """The routable engines of a group: the group itself, or ``<group>-dp<r>`` per DP rank of a wide-EP group."""
    if data_parallel_size == 1:
        return [group_name]
    return [f"{group_name}-dp{rank}" for rank in range(data_parallel_size)]


@dataclass
class Member:
    """One engine of a group and its leader: what routing sees as one target with its own KV cache."""

    name: str
    data_parallel_rank: int = 0
    leader: Any = None
    info: EngineInfo | None = None

    @property
    def instance_id(self) -> str | None:
        return self.info.vllm_instance_id if self.info else None


@dataclass
class ReplicaGroup:
    name: str
    spec: EngineSpec
    leader_cpus: float = 1.0
    namespace: str = DEFAULT_NAMESPACE
    generation: int = 0
    phase: EnginePhase = EnginePhase.PLACING
    ranks: list[RankAssignment] = field(default_factory=list)
    error: str | None = None
    step_durations_s: dict[str, float] = field(default_factory=dict)
    placement_group: Any = None
    members: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = member_names(self.name, self.spec.data_parallel_size)
        self.members = [Member(name, rank) for rank, name in enumerate(names)]

    @property
    def leader(self) -> Any:
        """DP rank 0's leader (the only one outside wide EP)."""
        return self.members[0].leader

    @property
    def info(self) -> EngineInfo | None:
        """DP rank 0's engine (every rank of a wide-EP group has the same shape)."""
        return self.members[0].info

    @property
    def instance_id(self) -> str | None:
        return self.members[0].instance_id

    async def start(self, timeout_s: float, on_progress: Callable[[ReplicaGroup], None] | None = None) -> None:
        """Place, start and wait for the engine; raises on failure or timeout (``error`` says why)."""
        notify = on_progress or (lambda group: None)
        try:
            await asyncio.wait_for(self._start(notify), timeout_s)
        except Exception as err:
            if self.error is None:
                what = f"not ready after {timeout_s:.0f} s" if isinstance(err, TimeoutError) else str(err)
                self.error = f"{self.phase.value}: {what}"
            self.phase = EnginePhase.FAILED
            notify(self)
            raise

    async def _start(self, notify: Callable[[ReplicaGroup], None]) -> None:
        tp, pp, dp = self.spec.tensor_parallel_size, self.spec.pipeline_parallel_size, self.spec.data_parallel_size
        mp = self.spec.executor == "mp"
        plan = plan_bundles(tp, pp, self.leader_cpus, self.spec.executor, data_parallel_size=dp)
        self.phase = EnginePhase.PLACING
        notify(self)
        began = time.monotonic()
        self.placement_group = placement_group(
            plan.bundles, strategy=plan.strategy, name=placement_group_name(self.name), lifetime="detached"
        )
        await self.placement_group.ready()
        bundle_nodes = placement_group_table(self.placement_group)["bundles_to_node_id"]
        nodes = [bundle_nodes[i] for i in range(len(plan.bundles))]
        if not mp:
            self.ranks = assign_ranks(nodes, tp, pp)
        else:  # DP rank r (one engine, all its ranks) in bundle r
            self.ranks = [a for r in range(dp) for a in leader_bundle_ranks(nodes[r], tp, pp, bundle_index=r)]
        self.step_durations_s["placement"] = time.monotonic() - began

        self.phase = EnginePhase.STARTING_ENGINE
        notify(self)
        began = time.monotonic()
        for member in self.members:
            bundle = member.data_parallel_rank if mp else LEADER_BUNDLE_INDEX
            ranks = [a for a in self.ranks if a.bundle_index == bundle] if mp else self.ranks
            spec = dataclasses.replace(self.spec, data_parallel_rank=member.data_parallel_rank)
            member.leader = (
                ray.remote(GroupLeader)
                .options(
                    name=leader_actor_name(member.name),
                    namespace=self.namespace,
                    lifetime="detached",
                    num_cpus=self.leader_cpus,
                    num_gpus=float(tp * pp) if mp else 0,  # mp: the leader's children use the bundle's accelerators
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=bundle
                    ),
                )
                .remote(member.name, spec, self.placement_group, bundle_indices_env(ranks), self.generation)
            )
        # Wide EP: rank 0's engine listens for the others at an address on its node.
        master = await self.members[0].leader.data_parallel_master.remote() if self.spec.wide_ep else None
        infos = await asyncio.gather(*(member.leader.start.remote(master) for member in self.members))
        for member, info in zip(self.members, infos, strict=True):
            member.info = info
        self.step_durations_s["engine"] = time.monotonic() - began
        self.phase = EnginePhase.READY
        notify(self)

    async def adopt(self) -> bool:
        """Take over a ready group left by a previous owner (a coordinator that restarted)."""
        try:
            leaders = [ray.get_actor(leader_actor_name(m.name), namespace=self.namespace) for m in self.members]
            descriptions: list[LeaderDescription] = await asyncio.wait_for(
                asyncio.gather(*(leader.describe.remote() for leader in leaders)), ADOPT_TIMEOUT_S
            )
        except Exception:
            return False
        self.generation = descriptions[0].generation  # kept even when not adopted: the next start is newer
        if any(d.phase is not EnginePhase.READY or d.info is None for d in descriptions):
            return False
        for member, leader, description in zip(self.members, leaders, descriptions, strict=True):
            member.leader, member.info = leader, description.info
        self.placement_group = get_placement_group(placement_group_name(self.name))
        self.phase = EnginePhase.READY
        return True

    async def teardown(self, graceful: bool = True) -> None:
        """Kill every leader (their engines and workers go with them) and remove the placement group.

        ``graceful`` first asks the engines to shut down (skipped after a failure: a hung leader
        would only delay the restart). Also finds leftovers by name, from a previous owner too.
        """
        leaders = []
        for member in self.members:
            leader = member.leader
            if leader is None:
                try:
                    leader = ray.get_actor(leader_actor_name(member.name), namespace=self.namespace)
                except ValueError:
                    leader = None
            if leader is not None:
                leaders.append(leader)
        if graceful and leaders:
            await asyncio.wait(
                [asyncio.ensure_future(_shut_down(leader)) for leader in leaders], timeout=LEADER_SHUTDOWN_TIMEOUT_S
            )
        for leader in leaders:
            ray.kill(leader, no_restart=True)
        pg = self.placement_group
        if pg is None:
            try:
                pg = get_placement_group(placement_group_name(self.name))
            except ValueError:
                pg = None
        if pg is not None:
            remove_placement_group(pg)  # kills every actor still in it: the worker ranks
        for member in self.members:
            member.leader = None
        self.placement_group = None
        self.phase = EnginePhase.STOPPED

    def stop(self) -> None:
        """Blocking teardown, for callers outside an event loop."""
        asyncio.run(self.teardown())

    def describe_step(self) -> str:
        if self.phase is EnginePhase.PLACING:
            return "placement: reserving bundles …"
        if self.phase is EnginePhase.STARTING_ENGINE:
            if len(self.members) > 1:  # wide EP under mp: DP rank r's ranks are in bundle r
                dp_ranks = sorted({(a.bundle_index, a.node_id[:8]) for a in self.ranks})
                where = ", ".join(f"DP{rank}→node {node}" for rank, node in dp_ranks)
            else:
                stages = sorted({(a.pp_rank, a.node_id[:8]) for a in self.ranks})
                where = ", ".join(f"PP{pp}→node {node}" for pp, node in stages)
            return f"placed ({where}) in {self.step_durations_s['placement']:.1f} s; loading weights, KV cache …"
        if self.phase is EnginePhase.READY and self.info is not None:
            engines = f"{len(self.members)} DP ranks, each " if len(self.members) > 1 else ""
            return (
                f"ready in {sum(self.step_durations_s.values()):.1f} s ({engines}"
                f"{self.info.num_kv_blocks} KV blocks × {self.info.block_size} tokens, "
                f"max_model_len {self.info.max_model_len})"
            )
        return f"{self.phase.value}: {self.error or ''}"


async def _shut_down(leader: Any) -> None:
    try:
        await leader.shutdown.remote()
    except Exception:
        pass
