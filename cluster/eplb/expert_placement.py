"""Flotilla's expert placement: balanced, movement-aware, node-aware, no duplicate per rank.

Same inputs and output as vLLM's EPLB policy (``rebalance_experts``); see ``vllm_policy``.
Per layer:

1. Replica counts: one replica per expert, then each extra slot goes to the expert with the
   highest load per replica (optimal for the max per-replica load), capped at one replica
   per rank so that no rank ever holds two copies of an expert.
2. A layer whose old placement is already within ``keep_slack`` of the lower bound (mean rank
   load, heaviest replica) and no worse than DeepSeek's plan is kept as it is, unplanned.
3. Fresh placements for the others: node-aware first (groups packed onto nodes, replicas placed
   inside their node) when groups divide by nodes; if it is not within ``good_enough_slack`` of
   the bound, also global (replicas heaviest first onto the lightest rank that does not hold
   the expert, then swaps between the most loaded rank and others) and DeepSeek's own plan with
   its duplicates swapped away. The most balanced wins; node-aware wins ties (it keeps a group's
   tokens inside one node). A layer that still loses to DeepSeek gets a small search over
   replica counts (DeepSeek gets there with two copies on one rank, which we never place).
4. Kept candidates from the old map: experts stay in their slots; surplus replicas leave the most
   loaded ranks, missing ones fill the freed slots, then swaps; every intermediate layout within
   ``keep_slack`` of the fresh one is a candidate, as is the fresh one relabelled so that each
   new rank lands where most of its experts already are.
5. One candidate per layer: start from the most balanced, then trade balance for movement where
   it is cheapest (extra max load per slot not moved) while the plan's sum of per-layer max
   rank loads stays within DeepSeek's. Layers run one after another, so that sum is what a
   forward pass waits for, and vLLM's balancedness (sum of means over sum of maxima) is never
   below DeepSeek's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flotilla.cluster.eplb import deepseek
from flotilla.cluster.eplb.balance import rank_loads, replica_counts

_NO_EXPERT = -1
_NEAR_PARTNERS = 8


@dataclass(frozen=True, slots=True)
class PlacementOptions:
    keep_slack: float = 0.01
    """A kept (incremental) layout may be this fraction less balanced than the fresh one, layer by
    layer, as long as the whole plan stays as balanced as DeepSeek's. Under a stationary load the
    optimum shifts with sampling noise; without slack a few 0.1% of balance would cost a reshuffle."""
    node_affinity_slack: float = 0.0
    """Prefer the node-aware candidate if its max rank load is within this fraction of the
    global one's. 0 picks node-aware only when it balances at least as well."""
    good_enough_slack: float = 2e-3
    """Fresh placements stop swapping within this fraction of the lower bound on the max rank
    load; the last few 0.1% cost most of the planning time."""
    max_swaps_per_rank: int = 4
    """Swap budget per layer, times the number of ranks; bounds planning time."""
    keep_swaps_per_rank: int = 1
    """Swap budget per layer when repairing a kept placement, times the number of ranks: each swap moves two
    replicas, so past this many a fresh placement (relabelled onto the old one) is the cheaper move."""
    max_count_moves: int = 4
    """Replica-count moves tried on a layer whose packing loses to DeepSeek's (see ``_search_counts``)."""
    count_move_breadth: int = 8
    """Each move takes a replica from one of this many experts and gives it to one of this many."""


@dataclass(frozen=True, slots=True)
class PlacementShape:
    num_logical: int
    num_physical: int
    num_groups: int
    num_nodes: int
    num_ranks: int

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @property
    def node_aware_possible(self) -> bool:
        """Groups whole on nodes, and a node's experts can fill its ranks without duplicates."""
        return (
            self.num_nodes > 1
            and self.num_groups % self.num_nodes == 0
            and self.num_logical % self.num_groups == 0
            and self.num_physical % self.num_nodes == 0
            and self.num_logical // self.num_nodes >= self.slots_per_rank
        )

    def validate(self) -> None:
        if self.num_ranks <= 0 or self.num_physical % self.num_ranks:
            raise ValueError(f"num_replicas {self.num_physical} must be a positive multiple of num_ranks")
        if self.num_physical < self.num_logical:
            raise ValueError(f"num_replicas {self.num_physical} < {self.num_logical} logical experts")
        if self.slots_per_rank > self.num_logical:
            raise ValueError(
                f"{self.slots_per_rank} slots per rank > {self.num_logical} experts: a rank would hold duplicates"
            )


def plan_placement(
    weight: np.ndarray,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_physical_to_logical: np.ndarray | None = None,
    options: PlacementOptions = PlacementOptions(),
) -> np.ndarray:
    """``physical_to_logical[layers, num_physical]`` for loads ``weight[layers, num_logical]``.

    ``old_physical_to_logical`` (same shape, -1 for an empty slot) is the current placement;
    without it (or with another shape) nothing is kept. ``num_nodes`` that does not divide
    ``num_ranks`` is treated as one node, as vLLM does.
    """
    weight = np.asarray(weight, dtype=np.float64)
    if weight.ndim != 2:
        raise ValueError(f"weight must be [layers, logical_experts], got shape {weight.shape}")
    if num_nodes <= 0 or num_ranks % num_nodes:
        num_nodes = 1
    shape = PlacementShape(weight.shape[1], num_physical, max(num_groups, 1), num_nodes, num_ranks)
    shape.validate()
    if old_physical_to_logical is not None:
        old_physical_to_logical = np.asarray(old_physical_to_logical, dtype=np.int64)
        if old_physical_to_logical.shape != (weight.shape[0], num_physical):
            old_physical_to_logical = None

    layers = weight.shape[0]
    counts = replica_counts_capped(weight, num_physical, cap=num_ranks)
    baseline = deepseek.rebalance_experts(weight, num_physical, shape.num_groups, num_nodes, num_ranks)
    baseline_max = _max_load(baseline, weight, num_ranks)
    # No layout beats the mean rank load, nor the heaviest replica (greedy counts make it the smallest).
    lower_bound = np.maximum(weight.sum(axis=1) / num_ranks, (weight / counts).max(axis=1))
    if old_physical_to_logical is None:
        return _best_fresh(weight, counts, shape, baseline, baseline_max, lower_bound, options).reshape(layers, -1)

    old = old_physical_to_logical.reshape(layers, num_ranks, shape.slots_per_rank)
    old_counts = replica_counts(old_physical_to_logical, shape.num_logical)
    old_counts_usable = np.asarray((old_counts >= 1).all(axis=1) & (old_counts <= num_ranks).all(axis=1))
    # Layers whose old placement is within keep_slack of the bound and no worse than DeepSeek's stay as
    # they are without planning them afresh (under a stationary load, most of them).
    settled = old_counts_usable & (
        _max_load(old, weight) <= np.minimum(baseline_max, lower_bound * (1 + options.keep_slack))
    )
    todo = np.flatnonzero(~settled)
    fresh = old.copy()
    if todo.size:
        fresh[todo] = _best_fresh(
            weight[todo], counts[todo], shape, baseline[todo], baseline_max[todo], lower_bound[todo], options
        )
    counts = replica_counts(fresh.reshape(layers, num_physical), shape.num_logical)
    fresh_max = _max_load(fresh, weight)
    ranks_per_block = num_ranks // num_nodes if shape.node_aware_possible else 1
    max_swaps = options.keep_swaps_per_rank * num_ranks
    keep_bound = fresh_max * (1 + options.keep_slack)
    # With room for every layer at its keep bound, a kept layout never needs to be better than that bound
    # (more swaps would only move more); otherwise balance is traded layer by layer, so offer the way down.
    room_for_all = baseline_max.sum() - fresh_max.sum() >= options.keep_slack * fresh_max.sum()
    swap_target = keep_bound if room_for_all else fresh_max
    choices = []
    for layer in range(layers):
        if settled[layer]:
            choices.append([_Choice(old[layer], float(fresh_max[layer]), 0)])
            continue
        layer_choices = []
        # Replica counts drift with sampling noise; keeping the old counts first avoids moving replicas for it.
        tries = [old_counts[layer], counts[layer]] if old_counts_usable[layer] else [counts[layer]]
        for layer_counts in tries:
            replica_weight = weight[layer] / layer_counts
            if replica_weight.max() > keep_bound[layer]:
                continue  # its heaviest replica alone outweighs the bound: no layout of these counts can keep
            kept = _incremental_layout(old[layer], layer_counts, replica_weight)
            steps: list[np.ndarray] = [kept.copy()]
            improve_layout(kept, replica_weight, swap_target[layer], max_swaps, steps)
            for step in steps:
                peak = float(replica_weight[step].sum(axis=1).max())
                if peak <= keep_bound[layer]:
                    layer_choices.append(_Choice(step, peak, _slots_moved(step, old[layer])))
            if layer_choices and layer_choices[-1].peak <= swap_target[layer]:
                break  # the fresh plan would only move more
        else:
            relabelled = relabel_to_old(fresh[layer], old[layer], ranks_per_block)
            layer_choices.append(_Choice(relabelled, float(fresh_max[layer]), _slots_moved(relabelled, old[layer])))
        choices.append(layer_choices)
    picked = _least_movement_within(choices, budget=float(baseline_max.sum()))
    return np.stack([choice.layout for choice in picked]).reshape(layers, num_physical)


@dataclass(frozen=True, slots=True)
class _Choice:
    """One candidate layout of a layer: its max rank load and how many slots must receive weights."""

    layout: np.ndarray
    peak: float
    moved: int


def _least_movement_within(choices: list[list[_Choice]], budget: float) -> list[_Choice]:
    """One choice per layer: start from each layer's most balanced, then trade balance for less movement,
    cheapest first (extra max load per slot saved), while the sum of the layers' max loads stays within
    ``budget`` (DeepSeek's sum: the whole plan stays at least as balanced as DeepSeek's, and the sum of
    per-layer maxima is what a forward pass waits for)."""
    picked = [min(layer, key=lambda c: (c.peak, c.moved)) for layer in choices]
    spare = budget - sum(c.peak for c in picked)
    trades = sorted(
        ((c.peak - best.peak) / (best.moved - c.moved), layer, index)
        for layer, (options, best) in enumerate(zip(choices, picked, strict=True))
        for index, c in enumerate(options)
        if c.moved < best.moved
    )
    for _, layer, index in trades:
        candidate, current = choices[layer][index], picked[layer]
        cost = candidate.peak - current.peak
        if candidate.moved < current.moved and cost <= spare:
            picked[layer] = candidate
            spare -= cost
    return picked


def _slots_moved(layout: np.ndarray, old_layout: np.ndarray) -> int:
    """Slots of ``layout[ranks, slots]`` whose expert was not on that rank in ``old_layout``."""
    return int((~(layout[:, :, None] == old_layout[:, None, :]).any(axis=2)).sum())


def _best_fresh(
    weight: np.ndarray,
    counts: np.ndarray,
    shape: PlacementShape,
    baseline: np.ndarray,
    baseline_max: np.ndarray,
    lower_bound: np.ndarray,
    options: PlacementOptions,
) -> np.ndarray:
    """Per layer, the most balanced of: node-aware, ours (global), DeepSeek's (duplicates swapped away).

    The node-aware candidate is tried first and wins ties (it keeps a group's tokens inside one
    node); layers where it is within ``good_enough_slack`` of the bound and no worse than DeepSeek
    skip the global search. DeepSeek's plan is a candidate so that we are never less balanced than
    it where it is duplicate-free; layers that still lose get a replica-count search.
    """
    layers = weight.shape[0]
    todo = np.arange(layers)
    fresh = np.empty((layers, shape.num_ranks, shape.slots_per_rank), dtype=np.int64)
    if shape.node_aware_possible:
        node_aware = _node_aware_layouts(weight, shape, options)
        node_aware_max = _max_load(node_aware, weight)
        fresh[:] = node_aware
        todo = np.flatnonzero(node_aware_max > np.minimum(baseline_max, lower_bound * (1 + options.good_enough_slack)))
    if todo.size:
        fresh[todo] = _best_global(weight[todo], counts[todo], shape, baseline[todo], baseline_max[todo], options)
        if shape.node_aware_possible:
            prefer = node_aware_max[todo] <= _max_load(fresh[todo], weight[todo]) * (1 + options.node_affinity_slack)
            fresh[todo] = np.where(prefer[:, None, None], node_aware[todo], fresh[todo])
    for layer in np.flatnonzero(_max_load(fresh, weight) > baseline_max * (1 + 1e-12)):
        fresh[layer] = _search_counts(weight[layer], fresh[layer], shape.num_ranks, options, baseline_max[layer])
    return fresh


def _best_global(
    weight: np.ndarray,
    counts: np.ndarray,
    shape: PlacementShape,
    baseline: np.ndarray,
    baseline_max: np.ndarray,
    options: PlacementOptions,
) -> np.ndarray:
    """Per layer, the more balanced of our global placement and DeepSeek's with duplicates swapped away."""
    ours = _improved(fresh_layouts(weight, counts, shape.num_ranks), weight / counts, options, baseline_max)
    from_baseline = baseline.reshape(weight.shape[0], shape.num_ranks, shape.slots_per_rank).copy()
    baseline_counts = replica_counts(baseline, shape.num_logical)
    for layer in range(weight.shape[0]):
        try:
            if baseline_counts[layer].max() > shape.num_ranks:
                raise ValueError("more copies of an expert than ranks")
            _repair_duplicates(from_baseline[layer], weight[layer] / baseline_counts[layer])
        except ValueError:  # no duplicate-free form of DeepSeek's plan: not a candidate
            from_baseline[layer] = ours[layer]
    better = _max_load(from_baseline, weight) < _max_load(ours, weight)
    return np.where(better[:, None, None], from_baseline, ours)


def _search_counts(
    weight: np.ndarray, layout: np.ndarray, num_ranks: int, options: PlacementOptions, must_reach: float
) -> np.ndarray:
    """Move one replica at a time between experts while that packs to a lower max rank load.

    The greedy replica counts are optimal for the heaviest replica, not for the packing: with
    few slots per rank another split can pack better (DeepSeek's plan gets there with two
    copies on one rank, which we never place). Run only on layers that lose to DeepSeek.
    """
    counts = replica_counts(layout.reshape(1, -1), weight.shape[0])[0]
    best, best_max = layout, float((weight / counts)[layout].sum(axis=1).max())
    for _ in range(options.max_count_moves):
        if best_max <= must_reach:
            break
        # Near the greedy's margin: the replicas cheapest to give up, the experts next in line for one.
        give_up = np.where(counts > 1, weight / np.maximum(counts - 1, 1), np.inf)
        take = np.where(counts < num_ranks, weight / (counts + 1), -np.inf)
        donors = [d for d in np.argsort(give_up, kind="stable")[: options.count_move_breadth] if counts[d] > 1]
        takers = [t for t in np.argsort(-take, kind="stable")[: options.count_move_breadth] if counts[t] < num_ranks]
        moves = [(d, t) for d in donors for t in takers if d != t]
        if not moves:
            break
        variants = np.repeat(counts[None, :], len(moves), axis=0)
        rows = np.arange(len(moves))
        variants[rows, [d for d, _ in moves]] -= 1
        variants[rows, [t for _, t in moves]] += 1
        lower_bound = np.maximum((weight / variants).max(axis=1), weight.sum() / num_ranks)
        variants = variants[lower_bound < best_max]
        if not len(variants):
            break
        weights = np.repeat(weight[None, :], len(variants), axis=0)
        try:
            layouts = _improved(fresh_layouts(weights, variants, num_ranks), weights / variants, options)
        except ValueError:  # some variant has no duplicate-free packing
            break
        peaks = np.array([(weight / c)[lay].sum(axis=1).max() for c, lay in zip(variants, layouts, strict=True)])
        winner = int(np.argmin(peaks))
        if peaks[winner] >= best_max:
            break
        counts, best, best_max = variants[winner], layouts[winner], float(peaks[winner])
    return best


def replica_counts_capped(weight: np.ndarray, num_physical: int, cap: int) -> np.ndarray:
    """``[rows, n]`` replicas per expert: greedy on the highest load per replica, at most ``cap`` each."""
    rows_count, num_logical = weight.shape
    rows = np.arange(rows_count)
    counts = np.ones((rows_count, num_logical), dtype=np.int64)
    for _ in range(num_physical - num_logical):
        per_replica = np.where(counts < cap, weight / counts, -np.inf)
        expert = np.argmax(per_replica, axis=1)
        counts[rows, expert] += 1
    return counts


def fresh_layouts(weight: np.ndarray, counts: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[rows, ranks, slots_per_rank]``: replicas heaviest first onto the lightest allowed rank."""
    rows_count, num_logical = weight.shape
    num_physical = int(counts[0].sum())
    slots_per_rank = num_physical // num_ranks
    replica_expert = np.stack([np.repeat(np.arange(num_logical), row_counts) for row_counts in counts])
    replica_weight = np.take_along_axis(weight / counts, replica_expert, axis=1)
    order = np.argsort(-replica_weight, axis=1, kind="stable")
    replica_expert = np.take_along_axis(replica_expert, order, axis=1)
    replica_weight = np.take_along_axis(replica_weight, order, axis=1)

    rows = np.arange(rows_count)
    layout = np.full((rows_count, num_ranks, slots_per_rank), _NO_EXPERT, dtype=np.int64)
    loads = np.zeros((rows_count, num_ranks))
    filled = np.zeros((rows_count, num_ranks), dtype=np.int64)
    holds = np.zeros((rows_count, num_ranks, num_logical), dtype=bool)
    for position in range(num_physical):
        expert = replica_expert[:, position]
        full = filled >= slots_per_rank
        allowed = ~full & ~holds[rows, :, expert]
        # A dead end (only ranks holding the expert have room) takes a duplicate, repaired below.
        allowed |= ~full & ~allowed.any(axis=1, keepdims=True)
        rank = np.argmin(np.where(allowed, loads, np.inf), axis=1)
        layout[rows, rank, filled[rows, rank]] = expert
        filled[rows, rank] += 1
        loads[rows, rank] += replica_weight[:, position]
        holds[rows, rank, expert] = True
    for row in range(rows_count):
        _repair_duplicates(layout[row], weight[row] / counts[row])
    return layout


def improve_layout(
    layout: np.ndarray,
    replica_weight: np.ndarray,
    target_max: float,
    max_swaps: int,
    steps: list[np.ndarray] | None = None,
) -> int:
    """Swap replicas between the most loaded rank and others while that lowers the maximum.

    Works in place on ``layout[ranks, slots]``; stops at ``target_max`` or when no swap helps.
    Partners are looked for on the lightest ranks first (cheap), then on all ranks.
    Appends a copy of the layout after each swap to ``steps`` if given. Returns the number of swaps.
    """
    num_ranks, slots_per_rank = layout.shape
    holds = _holds(layout, replica_weight.shape[0])
    loads = replica_weight[layout].sum(axis=1)
    tolerance = 1e-9 * max(float(loads.max()), 1e-12)
    for swap in range(max_swaps):
        top_rank = int(np.argmax(loads))
        if loads[top_rank] <= target_max + tolerance:
            return swap
        by_load = np.argsort(loads, kind="stable")
        partner = _best_swap(layout, holds, loads, replica_weight, top_rank, by_load[:_NEAR_PARTNERS], tolerance)
        if partner is None and num_ranks > _NEAR_PARTNERS:
            partner = _best_swap(layout, holds, loads, replica_weight, top_rank, by_load, tolerance)
        if partner is None:
            return swap
        _swap(layout, holds, loads, replica_weight, *partner)
        if steps is not None:
            steps.append(layout.copy())
    return max_swaps


def _best_swap(
    layout: np.ndarray,
    holds: np.ndarray,
    loads: np.ndarray,
    replica_weight: np.ndarray,
    top_rank: int,
    partner_ranks: np.ndarray,
    tolerance: float,
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The swap of a replica on ``top_rank`` with one on ``partner_ranks`` giving the lowest peak."""
    slots_per_rank = layout.shape[1]
    partner_ranks = partner_ranks[partner_ranks != top_rank]
    outgoing = layout[top_rank]
    incoming = layout[partner_ranks].reshape(-1)
    incoming_rank = np.repeat(partner_ranks, slots_per_rank)
    delta = replica_weight[outgoing][:, None] - replica_weight[incoming][None, :]
    top = loads[top_rank]
    peak = np.maximum(top - delta, loads[incoming_rank][None, :] + delta)
    allowed = (
        (delta > tolerance) & ~holds[incoming_rank[None, :], outgoing[:, None]] & ~holds[top_rank, incoming][None, :]
    )
    peak = np.where(allowed, peak, np.inf)
    best = int(np.argmin(peak))
    if not peak.flat[best] < top - tolerance:
        return None
    out_slot, in_index = divmod(best, incoming.shape[0])
    return (top_rank, out_slot), (int(incoming_rank[in_index]), in_index % slots_per_rank)


def relabel_to_old(layout: np.ndarray, old_layout: np.ndarray, ranks_per_block: int) -> np.ndarray:
    """Permute the ranks of ``layout`` so each lands where most of its experts already are.

    Blocks of ``ranks_per_block`` ranks (a node, for node-aware layouts) move as a whole, so
    a node-aware layout stays node-aware. Experts a rank already held keep their old slot.
    """
    num_ranks = layout.shape[0]
    num_logical = int(max(layout.max(), old_layout.max())) + 1
    new_holds, old_holds = _holds(layout, num_logical), _holds(old_layout, num_logical)
    overlap = new_holds.astype(np.int64) @ old_holds.T.astype(np.int64)  # [new rank, old rank]
    num_blocks = num_ranks // ranks_per_block
    block_overlap = overlap.reshape(num_blocks, ranks_per_block, num_blocks, ranks_per_block).sum(axis=(1, 3))
    target_rank = np.empty(num_ranks, dtype=np.int64)
    for new_block, old_block in _greedy_matching(block_overlap):
        new_ranks = np.arange(ranks_per_block) + new_block * ranks_per_block
        old_ranks = np.arange(ranks_per_block) + old_block * ranks_per_block
        inner = overlap[np.ix_(new_ranks, old_ranks)]
        for new_local, old_local in _greedy_matching(inner):
            target_rank[new_ranks[new_local]] = old_ranks[old_local]
    relabelled = np.empty_like(layout)
    for new_rank, old_rank in enumerate(target_rank):
        relabelled[old_rank] = _keep_slots(layout[new_rank], old_layout[old_rank])
    return relabelled


def _node_aware_layouts(weight: np.ndarray, shape: PlacementShape, options: PlacementOptions) -> np.ndarray:
    """Groups packed onto nodes, then replicas counted and placed inside each node."""
    layers = weight.shape[0]
    group_size = shape.num_logical // shape.num_groups
    groups_per_node = shape.num_groups // shape.num_nodes
    experts_per_node = shape.num_logical // shape.num_nodes
    ranks_per_node = shape.num_ranks // shape.num_nodes
    group_node, group_rank = deepseek.balanced_packing(
        weight.reshape(layers, shape.num_groups, group_size).sum(axis=2), shape.num_nodes
    )
    # node_experts[layer, node, i]: the global id of the node's i-th expert
    local_index = (group_node * groups_per_node + group_rank)[:, :, None] * group_size + np.arange(group_size)
    node_experts = np.empty((layers, shape.num_logical), dtype=np.int64)
    np.put_along_axis(node_experts, local_index.reshape(layers, -1), np.arange(shape.num_logical)[None, :], axis=1)
    node_experts = node_experts.reshape(layers * shape.num_nodes, experts_per_node)

    node_weight = np.take_along_axis(weight.repeat(shape.num_nodes, axis=0), node_experts, axis=1)
    node_counts = replica_counts_capped(node_weight, shape.num_physical // shape.num_nodes, cap=ranks_per_node)
    local = _improved(fresh_layouts(node_weight, node_counts, ranks_per_node), node_weight / node_counts, options)
    global_ids = np.take_along_axis(node_experts[:, None, :].repeat(ranks_per_node, axis=1), local, axis=2)
    return global_ids.reshape(layers, shape.num_ranks, shape.slots_per_rank)


def _improved(
    layouts: np.ndarray, replica_weight: np.ndarray, options: PlacementOptions, must_reach: np.ndarray | None = None
) -> np.ndarray:
    """``layouts`` after swaps, each row stopping near its lower bound (mean rank load, or the heaviest replica),
    and not before its max rank load is down to ``must_reach`` (DeepSeek's, where given)."""
    num_ranks = layouts.shape[1]
    lower_bound = np.maximum(
        np.take_along_axis(replica_weight, layouts.reshape(layouts.shape[0], -1), axis=1).sum(axis=1) / num_ranks,
        replica_weight.max(axis=1),
    )
    for row in range(layouts.shape[0]):
        target = lower_bound[row] * (1 + options.good_enough_slack)
        if must_reach is not None:
            target = min(target, float(must_reach[row]))
        improve_layout(layouts[row], replica_weight[row], target, options.max_swaps_per_rank * num_ranks)
    return layouts


def _incremental_layout(old_layout: np.ndarray, counts: np.ndarray, replica_weight: np.ndarray) -> np.ndarray:
    """The old layout with replicas added and removed to match ``counts``; others stay in their slots."""
    num_logical = counts.shape[0]
    layout = np.where((old_layout >= 0) & (old_layout < num_logical), old_layout, _NO_EXPERT)
    rank_expert = (np.arange(layout.shape[0])[:, None] * num_logical + layout).reshape(-1)
    first_copy = np.zeros(rank_expert.shape[0], dtype=bool)
    first_copy[np.unique(rank_expert, return_index=True)[1]] = True
    layout.reshape(-1)[~first_copy] = _NO_EXPERT  # a second copy on one rank is surplus

    loads = np.where(layout >= 0, replica_weight[np.maximum(layout, 0)], 0.0).sum(axis=1)
    held = np.bincount(layout[layout >= 0], minlength=num_logical)
    for expert in np.flatnonzero(held > counts):
        holders = np.flatnonzero((layout == expert).any(axis=1))
        for rank in holders[np.argsort(-loads[holders], kind="stable")][: held[expert] - counts[expert]]:
            layout[rank][layout[rank] == expert] = _NO_EXPERT
            loads[rank] -= replica_weight[expert]

    missing = np.repeat(np.arange(num_logical), np.maximum(counts - held, 0))
    if missing.size:
        holds = _holds(layout, num_logical)
        free = (layout == _NO_EXPERT).sum(axis=1)
        for expert in missing[np.argsort(-replica_weight[missing], kind="stable")]:
            allowed = (free > 0) & ~holds[:, expert]
            rank = int(np.argmin(np.where(allowed if allowed.any() else free > 0, loads, np.inf)))
            layout[rank, int(np.argmax(layout[rank] == _NO_EXPERT))] = expert
            loads[rank] += replica_weight[expert]
            free[rank] -= 1
            holds[rank, expert] = True
    _repair_duplicates(layout, replica_weight)
    return layout


def _repair_duplicates(layout: np.ndarray, replica_weight: np.ndarray) -> None:
    """Swap away second copies of an expert on one rank, choosing the swap with the lowest peak."""
    num_ranks, slots_per_rank = layout.shape
    ordered = np.sort(layout, axis=1)
    ranks_with_duplicates = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if not ranks_with_duplicates.size:
        return
    holds = _holds(layout, replica_weight.shape[0])
    loads = replica_weight[layout].sum(axis=1)
    other_rank = np.repeat(np.arange(num_ranks), slots_per_rank)
    for rank in ranks_with_duplicates.tolist():  # a swap below never creates a duplicate elsewhere
        for slot in range(slots_per_rank):
            expert = layout[rank, slot]
            if layout[rank].tolist().count(expert) < 2:
                continue
            other = layout.reshape(-1)
            delta = replica_weight[expert] - replica_weight[other]
            allowed = (other_rank != rank) & ~holds[other_rank, expert] & ~holds[rank, other]
            peak = np.where(allowed, np.maximum(loads[rank] - delta, loads[other_rank] + delta), np.inf)
            best = int(np.argmin(peak))
            if not np.isfinite(peak[best]):
                raise ValueError("no duplicate-free placement exists for these replica counts")
            _swap(layout, holds, loads, replica_weight, (rank, slot), divmod(best, slots_per_rank))
            holds = _holds(layout, replica_weight.shape[0])


def _swap(
    layout: np.ndarray,
    holds: np.ndarray,
    loads: np.ndarray,
    replica_weight: np.ndarray,
    first: tuple[int, int],
    second: tuple[int, int],
) -> None:
    (rank_a, slot_a), (rank_b, slot_b) = first, second
    expert_a, expert_b = layout[rank_a, slot_a], layout[rank_b, slot_b]
    layout[rank_a, slot_a], layout[rank_b, slot_b] = expert_b, expert_a
    holds[rank_a, expert_a], holds[rank_b, expert_b] = False, False
    holds[rank_a, expert_b], holds[rank_b, expert_a] = True, True
    delta = replica_weight[expert_a] - replica_weight[expert_b]
    loads[rank_a] -= delta
    loads[rank_b] += delta


def _keep_slots(experts: np.ndarray, old_slots: np.ndarray) -> np.ndarray:
    """Order ``experts`` so that those already in ``old_slots`` stay in their old slot."""
    arriving = experts.tolist()
    ordered = np.full_like(old_slots, _NO_EXPERT)
    for slot, expert in enumerate(old_slots.tolist()):
        if expert in arriving:
            ordered[slot] = expert
            arriving.remove(expert)
    ordered[ordered == _NO_EXPERT] = arriving
    return ordered


def _greedy_matching(overlap: np.ndarray) -> list[tuple[int, int]]:
    """Pairs (row, column), largest overlap first; ties by index so the result is deterministic."""
    order = np.argsort(-overlap, axis=None, kind="stable")
    rows_used, columns_used, pairs = set(), set(), []
    for flat in order.tolist():
        row, column = divmod(flat, overlap.shape[1])
        if row not in rows_used and column not in columns_used:
            rows_used.add(row)
            columns_used.add(column)
            pairs.append((row, column))
    return pairs


def _holds(layout: np.ndarray, num_logical: int) -> np.ndarray:
    holds = np.zeros((layout.shape[0], num_logical), dtype=bool)
    rows, slots = np.nonzero(layout >= 0)
    holds[rows, layout[rows, slots]] = True
    return holds


def _max_load(layouts: np.ndarray, weight: np.ndarray, num_ranks: int | None = None) -> np.ndarray:
    """Max rank load per layer of ``layouts[layers, ranks, slots]`` (or ``[layers, physical]`` and ``num_ranks``)."""
    ranks = layouts.shape[1] if num_ranks is None else num_ranks
    return rank_loads(layouts.reshape(layouts.shape[0], -1), weight, ranks).max(axis=1)
