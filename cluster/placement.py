"""Placement of one replica group: its placement-group bundles and the rank→bundle map.

Under vLLM's Ray executor a group's placement group holds one leader bundle (CPU only; it
hosts vLLM's async engine) followed by one single-accelerator bundle per vLLM worker rank::

    bundle 0        leader       {"CPU": leader_cpus}
    bundle 1..TP*PP  worker ranks {"GPU": 1}

Under vLLM's multiprocessing executor (``mp``) the ranks are child processes of the leader, so
one bundle holds the leader and every accelerator of the group, on one node::

    bundle 0        leader + ranks {"CPU": leader_cpus, "GPU": TP*PP}

A wide-EP group (DP ranks, each its own engine under ``mp``) has one such bundle per DP rank, free to
spread over nodes: bundle r holds DP rank r's leader and its TP ranks.

vLLM numbers ranks ``rank = pp_rank * TP + tp_rank``. We choose which bundle each rank gets
from where Ray actually placed the bundles, so that the TP ranks of one pipeline stage
always share a node (TP all-reduces every layer), while stages may sit on different nodes
(PP sends one activation per stage boundary). Stage 0 goes on the leader's node when it can.
The map is handed to vLLM explicitly through ``VLLM_RAY_BUNDLE_INDICES``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LEADER_BUNDLE_INDEX = 0
HEAD_NODE_RESOURCE = "node:__internal_head__"
"""Ray gives the head node this resource; a tiny demand of it pins an actor (ingress, coordinator) there."""


class PlacementError(RuntimeError):
    """The placement Ray produced cannot host the layout (for example TP ranks split over nodes)."""


@dataclass(frozen=True, slots=True)
class BundlePlan:
    bundles: list[dict[str, float]]
    strategy: str


@dataclass(frozen=True, slots=True)
class RankAssignment:
    rank: int
    pp_rank: int
    tp_rank: int
    bundle_index: int
    node_id: str


def plan_bundles(
    tp: int, pp: int, leader_cpus: float, executor: str = "ray", accelerator: str = "GPU", data_parallel_size: int = 1
) -> BundlePlan:
    """Bundles for a TP×PP group (× DP ranks for wide EP). One stage fits on one node, so PP=1 packs strictly."""
    if executor == "mp":
        engine = {"CPU": leader_cpus, accelerator: float(tp * pp)}
        if data_parallel_size > 1:
            return BundlePlan(bundles=[dict(engine) for _ in range(data_parallel_size)], strategy="PACK")
        return BundlePlan(bundles=[engine], strategy="STRICT_PACK")
    workers = [{accelerator: 1.0} for _ in range(tp * pp)]
    return BundlePlan(bundles=[{"CPU": leader_cpus}, *workers], strategy="STRICT_PACK" if pp == 1 else "PACK")


def leader_bundle_ranks(
    node_id: str, tp: int, pp: int, bundle_index: int = LEADER_BUNDLE_INDEX
) -> list[RankAssignment]:
    """Under ``mp`` every rank lives in the leader's bundle, on its node."""
    return [
        RankAssignment(rank=p * tp + t, pp_rank=p, tp_rank=t, bundle_index=bundle_index, node_id=node_id)
        for p in range(pp)
        for t in range(tp)
    ]


def assign_ranks(bundle_nodes: Sequence[str], tp: int, pp: int) -> list[RankAssignment]:
    """Map ranks to worker bundles given the node of every bundle (index 0 = leader).

    Raises PlacementError when no node holds enough worker bundles for whole stages.
    """
    leader_node = bundle_nodes[LEADER_BUNDLE_INDEX]
    by_node: dict[str, list[int]] = {}
    for index, node in enumerate(bundle_nodes):
        if index != LEADER_BUNDLE_INDEX:
            by_node.setdefault(node, []).append(index)
    nodes = sorted(by_node, key=lambda node: (node != leader_node, node))
    stages: list[tuple[str, list[int]]] = []
    for node in nodes:
        free = by_node[node]
        while len(free) >= tp and len(stages) < pp:
            stages.append((node, free[:tp]))
            free = free[tp:]
    if len(stages) < pp:
        counts = {node: len(indices) for node, indices in by_node.items()}
        raise PlacementError(
            f"worker bundles landed on nodes as {counts}: cannot form {pp} stage(s) of TP={tp} "
            "ranks on one node each; give every node a multiple of TP accelerator slots"
        )
    return [
        RankAssignment(rank=pp_rank * tp + tp_rank, pp_rank=pp_rank, tp_rank=tp_rank, bundle_index=bundle, node_id=node)
        for pp_rank, (node, bundles) in enumerate(stages)
        for tp_rank, bundle in enumerate(bundles)
    ]


def bundle_indices_env(assignments: Sequence[RankAssignment]) -> str:
    """``VLLM_RAY_BUNDLE_INDICES`` value: the bundle of rank 0, 1, 2, …"""
    return ",".join(str(a.bundle_index) for a in sorted(assignments, key=lambda a: a.rank))
