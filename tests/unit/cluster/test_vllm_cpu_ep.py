"""The wide-EP pieces the platform plugin adds to vLLM's CPU build, against single-process references:
variable-size all-gather / reduce-scatter over a real 2-process gloo group, and CPU fused-MoE experts
that honour ``expert_map`` (vLLM's own CPU kernel, experts split over two "ranks")."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flotilla.cluster.vllm_cpu_ep import all_gather_variable, local_topk, reduce_scatter_variable

WORLD = 2
SIZES = [3, 1]  # rank 0 holds 3 tokens, rank 1 one: the uneven case DP ranks produce


def rank_tokens(rank: int, rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed * 10 + rank))


def _collectives(rank: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        gathered = all_gather_variable(rank_tokens(rank, SIZES[rank], seed=1), SIZES, None, WORLD)
        everything = rank_tokens(rank, sum(SIZES), seed=2)  # each rank's contribution to every token
        scattered = reduce_scatter_variable(everything, SIZES, None, WORLD, rank)
        even = reduce_scatter_variable(rank_tokens(rank, 4, seed=3), None, None, WORLD, rank)
        results[rank] = (gathered, scattered, even)
    finally:
        dist.destroy_process_group()


def test_variable_size_collectives_equal_the_single_process_reference() -> None:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_collectives, args=(init_file, results), nprocs=WORLD, start_method="spawn")
        results = dict(results)
    expected_gather = torch.cat([rank_tokens(r, SIZES[r], seed=1) for r in range(WORLD)])
    total = sum(rank_tokens(r, sum(SIZES), seed=2) for r in range(WORLD))
    even_total = sum(rank_tokens(r, 4, seed=3) for r in range(WORLD))
    for rank in range(WORLD):
        gathered, scattered, even = results[rank]
        torch.testing.assert_close(gathered, expected_gather)
        start = sum(SIZES[:rank])
        torch.testing.assert_close(scattered, total[start : start + SIZES[rank]])
        torch.testing.assert_close(even, even_total[rank * 2 : rank * 2 + 2])


def test_reduce_scatter_rejects_sizes_that_do_not_cover_the_rows() -> None:
    with pytest.raises(ValueError, match="do not cover"):
        reduce_scatter_variable(torch.zeros(5, 2), [3, 1], None, WORLD, 0)


def test_local_topk_maps_ids_and_zeroes_experts_held_elsewhere() -> None:
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)  # this rank holds experts 2 and 3
    weights, ids = local_topk(
        torch.tensor([[0.7, 0.3], [0.6, 0.4]]), torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), expert_map
    )
    assert ids.tolist() == [[0, 0], [0, 1]] and ids.dtype == torch.int32
    torch.testing.assert_close(weights, torch.tensor([[0.7, 0.0], [0.0, 0.4]]))


def test_cpu_experts_split_over_two_ranks_sum_to_the_single_engine_result() -> None:
    """vLLM's CPU fused-MoE kernel over all 4 experts = the sum of two ranks each holding 2 experts and
    given the global top-k ids mapped by ``local_topk`` (what the combine step adds up)."""
    ops = pytest.importorskip("vllm._custom_ops")
    experts, hidden, inter, tokens, topk = 4, 64, 64, 6, 2
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    x = torch.randn(tokens, hidden, generator=g)
    topk_weights, topk_ids = torch.rand(tokens, experts, generator=g).softmax(-1).topk(topk, dim=-1)
    topk_ids = topk_ids.to(torch.int32)

    def run(local: slice, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        packed13 = ops.cpu_prepack_moe_weight(w13[local].contiguous(), "vec")
        packed2 = ops.cpu_prepack_moe_weight(w2[local].contiguous(), "vec")
        ops.cpu_fused_moe(out, x, packed13, packed2, None, None, weights, ids, "silu", "vec")
        return out

    reference = run(slice(0, 4), topk_weights, topk_ids)
    split = torch.zeros_like(x)
    for rank in range(2):
        expert_map = torch.full((experts,), -1, dtype=torch.int32)
        expert_map[rank * 2 : rank * 2 + 2] = torch.arange(2, dtype=torch.int32)
        split += run(slice(rank * 2, rank * 2 + 2), *local_topk(topk_weights, topk_ids, expert_map))
    torch.testing.assert_close(split, reference, rtol=1e-4, atol=1e-4)
