"""Expert parallelism on CPU: one Ray actor per EP rank, gloo all-to-all, live expert migration.

vLLM's CPU build cannot run EP (its CPU MoE kernel ignores the expert map) and rejects EPLB
off CUDA, so this runtime executes the MoE blocks itself:

- each rank holds the gates of every layer (replicated) and the weights of its physical
  slots only, read from the checkpoint;
- a forward pass gives each rank a share of the tokens; per layer each rank routes its
  tokens, picks a replica per (token, choice) as vLLM does (token index + choice, modulo
  the expert's replica count), sends the rows to the owning ranks with
  ``all_to_all_single`` (gloo), the owners run their experts, and the results come back
  the same way and are combined with the routing weights;
- a layer migrates in two steps: ``begin_layer_migration`` posts the point-to-point sends
  and receives (on a separate gloo group, into a buffer) and returns at once, so the layer
  keeps serving with its old weights; ``finish_layer_migration`` waits for them and swaps
  weights and map together on every rank.

Every rank must see the same sequence of forward and migration calls; the driver
(``CpuEpRuntime``) issues them to all ranks at once.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from flotilla.cluster.eplb.moe import MoeCheckpoint, MoeShape, expert_forward, route
from flotilla.cluster.eplb.transfers import LayerMigration, plan_layer_migration


def initial_placement(shape: MoeShape, num_physical: int) -> np.ndarray:
    """vLLM's placement before any rebalance: experts in order, then redundant copies of 0, 1, …"""
    row = list(range(shape.num_experts)) + [i % shape.num_experts for i in range(num_physical - shape.num_experts)]
    return np.tile(np.array(row, dtype=np.int64), (shape.num_layers, 1))


def replica_table(row: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(slots [experts, max_replicas], counts [experts])`` for one layer's map; unused entries -1."""
    counts = np.bincount(row, minlength=num_experts)
    table = np.full((num_experts, max(int(counts.max()), 1)), -1, dtype=np.int64)
    filled = np.zeros(num_experts, dtype=np.int64)
    for slot, expert in enumerate(row.tolist()):
        table[expert, filled[expert]] = slot
        filled[expert] += 1
    return table, counts


@dataclass
class _PendingMigration:
    new_row: np.ndarray
    works: list[Any]
    arriving: dict[int, torch.Tensor]
    """Local slot -> buffer that will hold its new weights."""


@dataclass
class _LayerState:
    row: np.ndarray
    slots: np.ndarray
    counts: np.ndarray
    weights: list[torch.Tensor]
    pending: _PendingMigration | None = field(default=None)


class EpRankWorker:
    """One EP rank (a Ray actor): its slots' expert weights, every gate, and its process groups."""

    def __init__(self, rank: int, num_ranks: int, model_dir: str, placement: np.ndarray, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.rank, self.num_ranks = rank, num_ranks
        checkpoint = MoeCheckpoint(Path(model_dir))
        self.shape = checkpoint.shape
        self.slots_per_rank = placement.shape[1] // num_ranks
        self.gates = [checkpoint.gate(layer) for layer in range(self.shape.num_layers)]
        self.layers = []
        for layer, row in enumerate(placement):
            slots, counts = replica_table(row, self.shape.num_experts)
            weights = [checkpoint.expert(layer, int(e)) for e in row[self._local_slots()]]
            self.layers.append(_LayerState(row.copy(), slots, counts, weights))
        self._migration_group: Any = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 names the address every rank connects to."""
        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]

    def connect(self, address: str, port: int) -> None:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.num_ranks
        )
        self._migration_group = dist.new_group(backend="gloo")

    def forward(self, x: np.ndarray, token_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run every MoE layer on this rank's tokens; returns outputs and dispatched load per physical slot."""
        hidden = torch.tensor(x)  # Ray hands over read-only arrays
        load = np.zeros((self.shape.num_layers, self.layers[0].row.shape[0]), dtype=np.int64)
        tokens = torch.tensor(token_index)
        for layer, state in enumerate(self.layers):
            ids, weights = route(self.gates[layer], hidden, self.shape.top_k)
            choice = torch.arange(self.shape.top_k).expand_as(ids)
            replica = (tokens[:, None] + choice) % torch.from_numpy(state.counts)[ids]
            slot = torch.from_numpy(state.slots)[ids, replica]
            load[layer] = np.bincount(slot.reshape(-1).numpy(), minlength=load.shape[1])
            expert_out = self._dispatch_and_compute(state, hidden, slot.reshape(-1))
            combined = (expert_out.view(*ids.shape, -1) * weights[..., None]).sum(dim=1)
            hidden = hidden + combined
        return hidden.numpy(), load

    def _dispatch_and_compute(self, state: _LayerState, hidden: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Rows to their slots' ranks, experts run there, results back in the original order."""
        top_k = self.shape.top_k
        rows = hidden.repeat_interleave(top_k, dim=0)
        owner = slot // self.slots_per_rank
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.num_ranks)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        received = torch.empty(sum(recv_split), hidden.shape[1])
        dist.all_to_all_single(received, rows[order].contiguous(), recv_split, send_split)
        received_slot = torch.empty(sum(recv_split), dtype=torch.int64)
        dist.all_to_all_single(received_slot, slot[order].contiguous(), recv_split, send_split)

        local = received_slot - self.rank * self.slots_per_rank
        computed = torch.empty_like(received)
        for local_slot in torch.unique(local).tolist():
            mask = local == local_slot
            computed[mask] = expert_forward(state.weights[local_slot], received[mask], self.shape)
        returned = torch.empty_like(rows)
        dist.all_to_all_single(returned, computed, send_split, recv_split)
        result = torch.empty_like(rows)
        result[order] = returned
        return result

    def begin_layer_migration(self, layer: int, new_row: np.ndarray) -> int:
        """Post this rank's sends and receives for ``layer``; returns the bytes it will receive."""
        state = self.layers[layer]
        migration = plan_layer_migration(state.row, new_row, self.num_ranks)
        first_local = self.rank * self.slots_per_rank
        arriving: dict[int, torch.Tensor] = {}
        works = []
        for src_slot, dst_slot in migration.local_copies:
            if dst_slot // self.slots_per_rank == self.rank:
                arriving[dst_slot - first_local] = state.weights[src_slot - first_local].clone()
        for transfer in migration.transfers:  # every rank walks the same list, so posts pair up
            if transfer.dst_rank == self.rank:
                buffer = torch.empty(self.shape.expert_numel)
                arriving[transfer.dst_slot - first_local] = buffer
                works.append(dist.irecv(buffer, transfer.src_rank, group=self._migration_group, tag=transfer.dst_slot))
            elif transfer.src_rank == self.rank:
                source = state.weights[transfer.src_slot - first_local]
                works.append(dist.isend(source, transfer.dst_rank, group=self._migration_group, tag=transfer.dst_slot))
        state.pending = _PendingMigration(np.asarray(new_row).copy(), works, arriving)
        received = sum(1 for t in migration.transfers if t.dst_rank == self.rank)
        return received * self.shape.expert_numel * 4

    def finish_layer_migration(self, layer: int) -> None:
        """Wait for the layer's transfers, then switch its weights and map at once."""
        state = self.layers[layer]
        if state.pending is None:
            raise RuntimeError(f"layer {layer} has no migration in progress")
        for work in state.pending.works:
            work.wait()
        for local_slot, weights in state.pending.arriving.items():
            state.weights[local_slot] = weights
        state.row = state.pending.new_row
        state.slots, state.counts = replica_table(state.row, self.shape.num_experts)
        state.pending = None

    def weights_checksum(self, layer: int) -> list[float]:
        """Sum of each local slot's weights: lets tests check weights moved, not just maps."""
        return [float(w.double().sum()) for w in self.layers[layer].weights]

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _local_slots(self) -> slice:
        return slice(self.rank * self.slots_per_rank, (self.rank + 1) * self.slots_per_rank)


class CpuEpRuntime:
    """Driver-side handle: starts the rank actors and fans every call out to all of them.

    Implements the ``EpRuntime`` protocol the EPLB controller drives. Ray must be initialised.
    """

    num_groups = 1
    num_nodes = 1

    def __init__(
        self, model_dir: Path, num_ranks: int = 4, num_redundant: int | None = None, cpus_per_rank: float = 0.5
    ) -> None:
        import ray

        self.shape = MoeShape.from_model_dir(Path(model_dir))
        redundant = num_ranks if num_redundant is None else num_redundant
        num_physical = self.shape.num_experts + redundant
        if num_physical % num_ranks:
            raise ValueError(
                f"{self.shape.num_experts} experts + {redundant} redundant is not a multiple of {num_ranks}"
            )
        self.num_ranks = num_ranks
        self._placement = initial_placement(self.shape, num_physical)
        self._load = np.zeros(self._placement.shape, dtype=np.int64)
        worker = ray.remote(num_cpus=cpus_per_rank)(EpRankWorker)
        self.workers: list[Any] = [
            worker.remote(rank, num_ranks, str(model_dir), self._placement) for rank in range(num_ranks)
        ]
        address, port = ray.get(self.workers[0].rendezvous_address.remote())
        ray.get([w.connect.remote(address, port) for w in self.workers])

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def num_logical(self) -> int:
        return self.shape.num_experts

    @property
    def num_physical(self) -> int:
        return int(self._placement.shape[1])

    @property
    def expert_bytes(self) -> int:
        return self.shape.expert_numel * 4

    def physical_to_logical(self) -> np.ndarray:
        return self._placement.copy()

    def forward(self, x: np.ndarray, token_index: np.ndarray | None = None) -> np.ndarray:
        """MoE stack over ``x [tokens, hidden]``, tokens split evenly over the ranks."""
        import ray

        x = np.ascontiguousarray(x, dtype=np.float32)
        index = np.arange(x.shape[0]) if token_index is None else np.asarray(token_index)
        shares = np.array_split(np.arange(x.shape[0]), self.num_ranks)
        results = ray.get(
            [w.forward.remote(x[share], index[share]) for w, share in zip(self.workers, shares, strict=True)]
        )
        for _, load in results:
            self._load += load
        return np.concatenate([out for out, _ in results])

    def drain_expert_load(self) -> np.ndarray:
        """Tokens dispatched per ``[layer, physical slot]`` since the last drain."""
        load, self._load = self._load, np.zeros_like(self._load)
        return load

    def begin_layer_migration(self, layer: int, new_row: np.ndarray) -> LayerMigration:
        import ray

        migration = plan_layer_migration(self._placement[layer], new_row, self.num_ranks)
        ray.get([w.begin_layer_migration.remote(layer, new_row) for w in self.workers])
        return migration

    def finish_layer_migration(self, layer: int, new_row: np.ndarray) -> None:
        import ray

        ray.get([w.finish_layer_migration.remote(layer) for w in self.workers])
        self._placement[layer] = new_row

    def shutdown(self) -> None:
        import ray

        ray.get([w.shutdown.remote() for w in self.workers])
        for worker in self.workers:
            ray.kill(worker)
