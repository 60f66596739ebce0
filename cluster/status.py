"""``flotilla status``: every group, rank, bundle, node and state, read from a live cluster.

Sources: each leader's own description (phase, rank→bundle map, engine info), Ray's
placement-group table (bundle→node) and Ray's state API (actor state, pid, node).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import ray

from flotilla.cluster.contract import COORDINATOR_NAME, EplbStatus, LeaderDescription, Membership, leader_actor_name
from flotilla.cluster.text_table import format_table

LEADER_PREFIX = leader_actor_name("")
DESCRIBE_TIMEOUT_S = 5.0


@dataclass(slots=True)
class ActorStatus:
    name: str
    state: str
    node_id: str | None
    pid: int | None


@dataclass(slots=True)
class RankStatus:
    rank: int
    pp_rank: int
    tp_rank: int
    bundle: int
    node_id: str | None
    worker: ActorStatus | None
    """The rank's worker: a Ray actor (``ray`` executor), or a child process of the leader (``mp``)."""


@dataclass(slots=True)
class GroupStatus:
    name: str
    state: str
    error: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    leader: ActorStatus | None
    ranks: list[RankStatus] = field(default_factory=list)
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    detail: str | None = None
    """The coordinator's account of the group (what it is doing, or why it is not ready)."""
    restarts: dict[str, int] = field(default_factory=dict)
    last_failure: str | None = None
    leader_bundle: int = 0
    gang: str | None = None
    """The replica group restarted with this one (itself, or the wide-EP group of this DP rank)."""


def vllm_worker_actor_name(instance_id: str, rank: int, tp: int, pp: int) -> str:
    """The name vLLM's Ray executor gives a worker (vllm.v1.executor.ray_utils.build_actor_name)."""
    name = f"vllm_Worker_{instance_id}"
    if tp > 1:
        name += f"_TP{rank % tp}"
    if pp > 1:
        name += f"_PP{(rank // tp) % pp}"
    return name


@dataclass(slots=True)
class ClusterStatus:
    groups: list[GroupStatus]
    eplb: list[EplbStatus] = field(default_factory=list)
    """Every expert-parallel group's balance, where EPLB runs."""


def collect(namespace: str) -> ClusterStatus:
    """Status of every group; actor details need Ray's dashboard (state API) and are "-" without it."""
    from ray.util.state import list_actors
    from ray.util.state.exception import ServerUnavailable

    actors: dict[str, Any] = {}
    listed: list[Any]
    try:
        listed = list_actors(
            address=ray.get_runtime_context().gcs_address, detail=True, limit=10_000, raise_on_missing_output=False
        )
    except ServerUnavailable:
        listed = []
    for actor in listed:
        if actor.name and (actor.name not in actors or actor.state == "ALIVE"):
            actors[actor.name] = actor
    bundle_nodes = {pg_id: pg["bundles_to_node_id"] for pg_id, pg in ray.util.placement_group_table().items()}
    leader_names = {
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == namespace and entry["name"].startswith(LEADER_PREFIX)
    }
    membership = coordinator_membership(namespace)
    groups = {g.name: g for g in membership.groups} if membership else {}
    leader_names |= {leader_actor_name(name) for name in groups}
    statuses = []
    for name in sorted(leader_names):
        status = _group_status(name, namespace, actors, bundle_nodes)
        lifecycle = groups.get(status.name)
        if lifecycle is not None:  # the coordinator's state is the one routing follows
            status.state, status.detail = lifecycle.state.value, lifecycle.detail
            status.restarts, status.last_failure = dict(lifecycle.restarts), lifecycle.last_failure
            status.gang = lifecycle.gang or lifecycle.name
            if lifecycle.state.value != "ready" and status.error and status.error.startswith("ValueError"):
                status.error = None  # no leader while restarting or failed: the detail says why
        statuses.append(status)
    return ClusterStatus(statuses, list(membership.eplb) if membership else [])


def coordinator_membership(namespace: str) -> Membership | None:
    try:
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=namespace)
        return cast(Membership, ray.get(coordinator.get_membership.remote(), timeout=DESCRIBE_TIMEOUT_S))
    except Exception:
        return None


def _group_status(
    leader_name: str, namespace: str, actors: dict[str, Any], bundle_nodes: dict[str, dict[int, str]]
) -> GroupStatus:
    group = leader_name.removeprefix(LEADER_PREFIX)
    leader_actor = actors.get(leader_name)
    try:
        handle = ray.get_actor(leader_name, namespace=namespace)
        description = cast(LeaderDescription, ray.get(handle.describe.remote(), timeout=DESCRIBE_TIMEOUT_S))
    except Exception as err:
        return GroupStatus(group, "unreachable", f"{type(err).__name__}: {err}", 0, 0, _actor(leader_actor))
    tp, pp = description.tensor_parallel_size, description.pipeline_parallel_size
    nodes = bundle_nodes.get(leader_actor.placement_group_id, {}) if leader_actor else {}
    ranks = []
    for rank, bundle in enumerate(description.rank_bundles):
        if description.executor == "mp":
            process = description.rank_processes[rank] if rank < len(description.rank_processes) else None
            node = nodes.get(bundle)
            worker = ActorStatus(process.name, process.state, node, process.pid) if process else None
        else:
            actor = None
            if description.vllm_instance_id:
                actor = actors.get(vllm_worker_actor_name(description.vllm_instance_id, rank, tp, pp))
            worker = _actor(actor)
        ranks.append(RankStatus(rank, rank // tp, rank % tp, bundle, nodes.get(bundle), worker))
    info = description.info
    return GroupStatus(
        name=group,
        state=description.phase.value,
        error=description.error,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        leader=_actor(leader_actor),
        ranks=ranks,
        max_model_len=info.max_model_len if info else None,
        num_kv_blocks=info.num_kv_blocks if info else None,
        # mp: the leader shares its ranks' bundle (a wide-EP DP rank's is its own); ray: bundle 0
        leader_bundle=description.rank_bundles[0] if description.executor == "mp" else 0,
    )


def _actor(actor: Any) -> ActorStatus | None:
    if actor is None:
        return None
    return ActorStatus(actor.name, actor.state, actor.node_id, actor.pid)


def render_json(status: ClusterStatus) -> str:
    return json.dumps(asdict(status), indent=2)


def render_table(status: ClusterStatus) -> str:
    lines = _group_lines(status.groups) if status.groups else ["no replica groups found"]
    for eplb in status.eplb:
        lines += ["", *_eplb_lines(eplb)]
    return "\n".join(lines)


def _group_lines(groups: list[GroupStatus]) -> list[str]:
    header = ("GROUP", "STATE", "TP×PP", "ROLE", "BUNDLE", "NODE", "ACTOR/PROCESS", "PID", "STATE")
    rows: list[tuple[str, ...]] = []
    for g in groups:
        layout = f"{g.tensor_parallel_size}×{g.pipeline_parallel_size}"
        leader = g.leader
        rows.append(
            (g.name, g.state, layout, "leader", str(g.leader_bundle), _short(leader.node_id if leader else None))
            + _actor_cells(leader)
        )
        for r in g.ranks:
            role = f"rank {r.rank} (PP{r.pp_rank} TP{r.tp_rank})"
            rows.append(("", "", "", role, str(r.bundle), _short(r.node_id)) + _actor_cells(r.worker))
    lines = format_table(header, rows)
    for g in groups:
        notes = [g.detail] if g.detail and g.state != "ready" else []
        if g.restarts:
            counts = ", ".join(f"{reason} {count}" for reason, count in sorted(g.restarts.items()))
            notes.append(f"restarts: {sum(g.restarts.values())} ({counts}); last: {g.last_failure}")
        if g.error:
            notes.append(g.error)
        lines += [f"{g.name}: {note}" for note in notes]
    return lines


def _eplb_lines(eplb: EplbStatus) -> list[str]:
    balance = "-" if eplb.balancedness is None else f"{eplb.balancedness:.3f}"
    state = eplb.state if eplb.migrating_layer is None else f"{eplb.state} (layer {eplb.migrating_layer})"
    name = f" ({eplb.group})" if eplb.group else ""
    lines = [
        f"EPLB{name}: {eplb.ranks} EP ranks, {eplb.layers} layers, {eplb.logical_experts} experts in "
        f"{eplb.physical_slots} slots; {state}",
        f"  balancedness {balance} over {eplb.window_ticks} samples"
        + (
            ""
            if eplb.steps_since_rebalance is None
            else f", {eplb.steps_since_rebalance} steps since the last rebalance"
            + (
                " (planned: the last recorded load on this placement; vLLM records load only in the window"
                " before each rearrangement)"
                if not eplb.window_ticks and eplb.balancedness is not None
                else ""
            )
        )
        + (f" (worst layer {min(eplb.balancedness_per_layer):.3f})" if eplb.balancedness_per_layer else ""),
        f"  rebalances {eplb.rebalances} (plans skipped: {eplb.skipped_plans}), {eplb.experts_moved_total} experts / "
        f"{eplb.bytes_moved_total / 1e6:.1f} MB moved in all",
    ]
    last = eplb.last_rebalance
    if last is not None:
        lines.append(
            f"  last: {last.balancedness_before:.3f} -> {last.balancedness_planned:.3f} planned, "
            f"{last.experts_moved} experts / {last.bytes_moved / 1e6:.1f} MB"
            + ("" if math.isnan(last.duration_s) else f" in {last.duration_s:.2f} s")
        )
    return lines


def _actor_cells(actor: ActorStatus | None) -> tuple[str, str, str]:
    if actor is None:
        return ("-", "-", "MISSING")
    return (actor.name, str(actor.pid or "-"), actor.state)


def _short(node_id: str | None) -> str:
    return node_id[:12] if node_id else "-"
