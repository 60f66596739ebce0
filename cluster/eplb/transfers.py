"""Which slots need whose weights when one layer's placement changes.

For every slot whose expert changes: if its rank already holds the new expert (in another
slot) the weights are copied locally; otherwise they come point-to-point from a rank that
holds it under the old placement. Receivers of one expert are spread round-robin over its
holders, so a hot expert being replicated does not load one sender.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ExpertTransfer:
    expert: int
    src_slot: int
    dst_slot: int
    src_rank: int
    dst_rank: int


@dataclass(frozen=True, slots=True)
class LayerMigration:
    transfers: tuple[ExpertTransfer, ...]
    local_copies: tuple[tuple[int, int], ...]
    """(src_slot, dst_slot) pairs on the same rank."""

    @property
    def experts_moved(self) -> int:
        return len(self.transfers)


def plan_layer_migration(old_row: np.ndarray, new_row: np.ndarray, num_ranks: int) -> LayerMigration:
    """Transfers and local copies that turn ``old_row`` into ``new_row`` (``[num_physical]`` each)."""
    old_row, new_row = np.asarray(old_row), np.asarray(new_row)
    slots_per_rank = new_row.shape[0] // num_ranks
    transfers: list[ExpertTransfer] = []
    local_copies: list[tuple[int, int]] = []
    receivers_so_far: dict[int, int] = {}
    for dst_slot in range(new_row.shape[0]):
        expert = int(new_row[dst_slot])
        if old_row[dst_slot] == expert:
            continue
        dst_rank = dst_slot // slots_per_rank
        rank_slots = np.arange(dst_rank * slots_per_rank, (dst_rank + 1) * slots_per_rank)
        on_rank = rank_slots[old_row[rank_slots] == expert]
        if on_rank.size:
            local_copies.append((int(on_rank[0]), dst_slot))
            continue
        holders = np.flatnonzero(old_row == expert)
        if not holders.size:
            raise ValueError(f"expert {expert} has no replica in the old placement to copy from")
        index = receivers_so_far.get(expert, 0)
        receivers_so_far[expert] = index + 1
        src_slot = int(holders[index % holders.size])
        transfers.append(ExpertTransfer(expert, src_slot, dst_slot, src_slot // slots_per_rank, dst_rank))
    return LayerMigration(tuple(transfers), tuple(local_copies))
