"""The two pieces vLLM's CPU build lacks for expert parallelism across DP ranks (wide-EP).

vLLM's naive all-to-all on CPU (``AgRsAll2AllManager``) dispatches tokens with the device
communicator's ``all_gatherv`` and combines them with ``reduce_scatterv``; the CPU communicator
inherits both from the base class, which raises ``NotImplementedError``. And the CPU fused-MoE
experts index their local weights with *global* expert ids (they ignore ``expert_map``), so the
first real batch of an EP rank reads past its weights and the worker segfaults.

Both are filled here, for CPU only: ``CpuRayPlatform`` names :class:`EpCpuCommunicator` as its
device communicator and applies :func:`patch_cpu_experts` when it loads; on a GPU the platform
plugin steps aside and nothing here is imported. Written here because no released vLLM has them
(0.32); each piece is small and checked against a single-process reference in the unit tests.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

# --- variable-size collectives over gloo ----------------------------------------------------------------


def all_gather_variable(input_: torch.Tensor, sizes: Sequence[int] | None, group: Any, world_size: int) -> torch.Tensor:
    """Concatenate every rank's ``input_`` along dim 0, rank ``i`` contributing ``sizes[i]`` rows.

    Gloo has no variable-size all-gather: each rank pads to the largest size, all-gathers, and
    the padding is cut off again.
    """
    if sizes is None:
        sizes = [input_.shape[0]] * world_size
    if len(sizes) != world_size:
        raise ValueError(f"{len(sizes)} sizes for {world_size} ranks")
    padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    chunks = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(chunks, padded, group=group)
    return torch.cat([chunk[:size] for chunk, size in zip(chunks, sizes, strict=True)])


def reduce_scatter_variable(
    input_: torch.Tensor, sizes: Sequence[int] | None, group: Any, world_size: int, rank: int
) -> torch.Tensor:
    """Sum ``input_`` over the ranks and keep this rank's rows: ``sizes[rank]`` rows from its offset
    (equal chunks without ``sizes``). An all-reduce, then a slice: gloo has no reduce-scatter."""
    rows = input_.shape[0]
    if sizes is None:
        if rows % world_size:
            raise ValueError(f"{rows} rows do not split evenly over {world_size} ranks")
        sizes = [rows // world_size] * world_size
    if len(sizes) != world_size or sum(sizes) != rows:
        raise ValueError(f"sizes {list(sizes)} do not cover {rows} rows over {world_size} ranks")
    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[:rank])
    return total[start : start + sizes[rank]].contiguous()


class EpCpuCommunicator(CpuCommunicator):
    """vLLM's CPU communicator with ``all_gatherv`` and ``reduce_scatterv`` (dim 0, as the all-to-all
    managers call them), so DP × EP runs on CPU."""

    def all_gatherv(
        self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        if dim != 0:
            raise NotImplementedError("only dim 0 all-gatherv is supported")
        if isinstance(input_, torch.Tensor):
            return all_gather_variable(input_, sizes, self.device_group, self.world_size)
        return [all_gather_variable(t, sizes, self.device_group, self.world_size) for t in input_]

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        if dim < 0:
            dim += input_.dim()
        moved = input_.movedim(0, dim)  # as vLLM's CUDA communicator: scatter along the moved axis 0
        out = reduce_scatter_variable(moved, sizes, self.device_group, self.world_size, self.rank_in_group)
        return out.movedim(0, dim).contiguous()


# --- fused-MoE experts that honour expert_map -----------------------------------------------------------


def local_topk(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ids → this rank's local ids (``expert_map``: -1 where the expert is elsewhere).

    A choice of a non-local expert gets weight 0 and local id 0 (any valid row): its token's output
    from this rank is then exactly the local experts' share, and the combine step adds the others'.
    """
    local_ids = expert_map[topk_ids.long()]
    here = local_ids >= 0
    weights = torch.where(here, topk_weights, torch.zeros_like(topk_weights))
    ids = torch.where(here, local_ids, torch.zeros_like(local_ids)).to(topk_ids.dtype)
    return weights, ids


_PATCHED = "_flotilla_expert_map"


def patch_cpu_experts() -> None:
    """Make vLLM's unquantized CPU experts map ``topk_ids`` through ``expert_map`` (idempotent)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    original = CPUUnquantizedExperts.apply
    if getattr(original, _PATCHED, False):
        return

    signature = inspect.signature(original)

    def apply(*args: Any, **kwargs: Any) -> None:
        call = signature.bind(*args, **kwargs)  # vLLM passes some arguments by name, some by position
        expert_map = call.arguments.get("expert_map")
        if expert_map is not None:
            weights, ids = local_topk(call.arguments["topk_weights"], call.arguments["topk_ids"], expert_map)
            call.arguments["topk_weights"], call.arguments["topk_ids"] = weights, ids
        original(*call.args, **call.kwargs)

    setattr(apply, _PATCHED, True)
    CPUUnquantizedExperts.apply = apply  # type: ignore[method-assign]
