"""DeepSeek's EPLB algorithm (deepseek-ai/EPLB ``eplb.py``), the baseline we measure against.

Written from the published description: replicate the expert with the highest load per
replica until every slot is used, then pack replicas onto ranks greedily (heaviest first,
onto the lightest rank with a free slot). When expert groups divide evenly by nodes it is
hierarchical: groups are packed onto nodes first, then replicated and packed inside each
node; otherwise it is the global policy (hierarchical with one group and one node).
It ignores the previous placement and may put two replicas of one expert on one rank.

Loops run over items and slots, vectorised over layers; the choices equal the per-layer
loops of the original (and of vLLM's ``DefaultEplbPolicy``).
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` items per row into ``num_packs`` packs of exactly ``n / num_packs`` items.

    Returns ``pack_index[X, n]`` and ``rank_in_pack[X, n]``.
    """
    rows_count, num_items = weight.shape
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        identity = np.tile(np.arange(num_items, dtype=np.int64), (rows_count, 1))
        return identity, np.zeros_like(identity)
    order = np.argsort(-weight, axis=1, kind="stable")
    rows = np.arange(rows_count)
    pack_index = np.empty((rows_count, num_items), dtype=np.int64)
    rank_in_pack = np.empty((rows_count, num_items), dtype=np.int64)
    pack_weight = np.zeros((rows_count, num_packs))
    pack_items = np.zeros((rows_count, num_packs), dtype=np.int64)
    for position in range(num_items):
        item = order[:, position]
        pack = np.argmin(np.where(pack_items < items_per_pack, pack_weight, np.inf), axis=1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_items[rows, pack]
        pack_weight[rows, pack] += weight[rows, item]
        pack_items[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give ``num_physical - n`` extra replicas, each to the expert with the highest load per replica.

    Returns ``physical_to_logical[X, num_physical]``, ``replica_rank[X, num_physical]`` (which
    replica of its expert each slot is) and ``counts[X, n]``.
    """
    rows_count, num_logical = weight.shape
    rows = np.arange(rows_count)
    physical_to_logical = np.tile(np.arange(num_physical, dtype=np.int64), (rows_count, 1))
    replica_rank = np.zeros((rows_count, num_physical), dtype=np.int64)
    counts = np.ones((rows_count, num_logical), dtype=np.int64)
    for slot in range(num_logical, num_physical):
        expert = np.argmax(weight / counts, axis=1)
        physical_to_logical[:, slot] = expert
        replica_rank[:, slot] = counts[rows, expert]
        counts[rows, expert] += 1
    return physical_to_logical, replica_rank, counts


def _inverse(permutation: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(permutation)
    np.put_along_axis(inverse, permutation, np.arange(permutation.shape[1], dtype=np.int64)[None, :], axis=1)
    return inverse


def rebalance_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> np.ndarray:
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_rank = num_physical // num_ranks

    # 1. groups -> nodes; relabel experts node-major ("mlog")
    group_pack, group_rank = balanced_packing(weight.reshape(layers, num_groups, group_size).sum(axis=2), num_nodes)
    log_to_mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size)
    ).reshape(layers, num_logical)
    mlog_to_log = _inverse(log_to_mlog)

    # 2. replicate inside each node: rows become (layer, node)
    mlog_weight = np.take_along_axis(weight, mlog_to_log, axis=1).reshape(-1, num_logical // num_nodes)
    phy_to_mlog, _, mlog_counts = replicate_experts(mlog_weight, num_physical // num_nodes)

    # 3. replicas -> ranks inside each node, each replica carrying an equal share of its expert's load
    replica_weight = np.take_along_axis(mlog_weight / mlog_counts, phy_to_mlog, axis=1)
    pack, rank_in_pack = balanced_packing(replica_weight, num_ranks // num_nodes)
    packed_to_phy = _inverse(pack * slots_per_rank + rank_in_pack)
    packed_to_mlog = np.take_along_axis(phy_to_mlog, packed_to_phy, axis=1)
    node_offsets = np.arange(num_nodes, dtype=np.int64) * (num_logical // num_nodes)
    packed_to_mlog = (packed_to_mlog.reshape(layers, num_nodes, -1) + node_offsets[None, :, None]).reshape(layers, -1)
    return np.take_along_axis(mlog_to_log, packed_to_mlog, axis=1)


def rebalance_experts(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> np.ndarray:
    """DeepSeek EPLB: ``physical_to_logical[layers, num_physical]`` for ``weight[layers, logical]``."""
    weight = np.asarray(weight, dtype=np.float64)
    if num_groups % num_nodes == 0:
        return rebalance_hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)
    return rebalance_hierarchical(weight, num_physical, 1, 1, num_ranks)
