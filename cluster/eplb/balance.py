"""Balancedness and weight movement of expert placements.

Load model (the one vLLM and DeepSeek plan with): every replica of logical expert ``e``
receives ``load[e] / replicas[e]`` tokens. Balancedness is vLLM's: mean over max per-rank
load, 1.0 when every rank does the same work; over several layers it is
``sum(mean) / sum(max)``.
"""

from __future__ import annotations

import numpy as np


def replica_counts(physical_to_logical: np.ndarray, num_logical: int) -> np.ndarray:
    """``[layers, num_logical]``: how many physical slots hold each logical expert."""
    layers = physical_to_logical.shape[0]
    counts = np.zeros((layers, num_logical), dtype=np.int64)
    rows = np.repeat(np.arange(layers), physical_to_logical.shape[1])
    valid = physical_to_logical.reshape(-1) >= 0
    np.add.at(counts, (rows[valid], physical_to_logical.reshape(-1)[valid]), 1)
    return counts


def logical_loads(physical_to_logical: np.ndarray, slot_load: np.ndarray, num_logical: int) -> np.ndarray:
    """``[layers, num_logical]``: the load each logical expert received, summed over the slots holding it."""
    layers = physical_to_logical.shape[0]
    logical = np.zeros((layers, num_logical))
    rows = np.repeat(np.arange(layers), physical_to_logical.shape[1])
    held = physical_to_logical.reshape(-1) >= 0
    np.add.at(logical, (rows[held], physical_to_logical.reshape(-1)[held]), slot_load.reshape(-1)[held])
    return logical


def slot_rank_loads(slot_load: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[layers, num_ranks]``: the load each rank received, from ``[layers, num_physical]`` per-slot load."""
    return slot_load.reshape(slot_load.shape[0], num_ranks, -1).sum(axis=2)


def rank_loads(physical_to_logical: np.ndarray, logical_load: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[layers, num_ranks]``: load per rank when replicas split their expert's load evenly."""
    counts = replica_counts(physical_to_logical, logical_load.shape[1])
    per_replica = np.divide(logical_load, counts, out=np.zeros_like(logical_load, dtype=np.float64), where=counts > 0)
    slot_load = np.take_along_axis(per_replica, np.maximum(physical_to_logical, 0), axis=1)
    slot_load[physical_to_logical < 0] = 0.0
    return slot_load.reshape(physical_to_logical.shape[0], num_ranks, -1).sum(axis=2)


def balancedness_of_rank_loads(loads: np.ndarray) -> tuple[np.ndarray, float]:
    """Per-layer mean/max and the overall ``sum(mean)/sum(max)`` of ``[layers, ranks]`` loads.

    A layer without load counts as perfectly balanced (1.0).
    """
    loads = np.asarray(loads, dtype=np.float64)
    means, maxes = loads.mean(axis=1), loads.max(axis=1)
    per_layer = np.divide(means, maxes, out=np.ones_like(means), where=maxes > 0)
    overall = float(means.sum() / maxes.sum()) if maxes.sum() > 0 else 1.0
    return per_layer, overall


def balancedness(physical_to_logical: np.ndarray, logical_load: np.ndarray, num_ranks: int) -> float:
    return balancedness_of_rank_loads(rank_loads(physical_to_logical, logical_load, num_ranks))[1]


def slots_needing_transfer(old: np.ndarray, new: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[layers, num_physical]`` bool: the slot's new expert was not on its rank before.

    Those slots receive weights from another rank; an expert that only changes slot inside
    its rank is a local copy and is not counted.
    """
    layers, num_physical = new.shape
    slots_per_rank = num_physical // num_ranks
    old_by_rank = old.reshape(layers, num_ranks, slots_per_rank)
    new_by_rank = new.reshape(layers, num_ranks, slots_per_rank)
    held_before = (new_by_rank[..., :, None] == old_by_rank[..., None, :]).any(axis=-1)
    return ~held_before.reshape(layers, num_physical)


def slots_changed(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``[layers, num_physical]`` bool: the slot holds a different expert than before."""
    return np.asarray(old != new)
