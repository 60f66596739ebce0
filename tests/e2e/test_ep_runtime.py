"""CPU expert parallelism on 4 Ray ranks: outputs equal a single-process reference before, during
and after a live rebalance driven by the EPLB controller, and the weights really moved."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from cluster.eplb.controller import EplbController, EplbControllerConfig, EplbState
from cluster.eplb.demo import skewed_tokens
from cluster.eplb.moe import MoeCheckpoint, reference_forward
from cluster.eplb.runtime import CpuEpRuntime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
RANKS, TOKENS = 4, 96


@pytest.fixture(scope="module")
def runtime(tiny_mixtral: Path) -> Iterator[CpuEpRuntime]:
    ray.init(address="local", num_cpus=RANKS, include_dashboard=False, log_to_driver=False)
    ep = CpuEpRuntime(tiny_mixtral, num_ranks=RANKS)
    yield ep
    ep.shutdown()
    ray.shutdown()


def test_outputs_equal_reference_through_a_live_rebalance(runtime: CpuEpRuntime, tiny_mixtral: Path) -> None:
    checkpoint = MoeCheckpoint(tiny_mixtral)
    rng = np.random.default_rng(0)
    batches = [skewed_tokens(checkpoint, TOKENS, hot_expert=5, rng=rng) for _ in range(3)]
    expected = [reference_forward(checkpoint, torch.from_numpy(batch)).numpy() for batch in batches]
    initial = runtime.physical_to_logical()
    controller = EplbController(
        runtime,
        EplbControllerConfig(window_ticks=4, min_window_ticks=3, trigger_balancedness=0.8, min_interval_s=1e9),
    )
    phases_checked = set()
    for step in range(3 + 2 * runtime.num_layers + 2):
        out = runtime.forward(batches[step % 3], np.arange(TOKENS) + step * TOKENS)
        np.testing.assert_allclose(out, expected[step % 3], rtol=1e-4, atol=1e-4)
        phases_checked.add(controller.state)
        controller.tick(float(step))
    assert phases_checked == {EplbState.IDLE, EplbState.MIGRATING}, "outputs were checked during the migration"
    assert controller.rebalances == 1
    last = controller.last_rebalance
    assert last is not None and last.experts_moved > 0
    assert last.balancedness_planned > last.balancedness_before + 0.1
    assert not (runtime.physical_to_logical() == initial).all()

    # Every rank holds, in each slot, exactly the checkpoint weights of the expert its map names.
    placement = runtime.physical_to_logical()
    slots_per_rank = runtime.num_physical // RANKS
    for layer in range(runtime.num_layers):
        sums = ray.get([worker.weights_checksum.remote(layer) for worker in runtime.workers])
        for rank, rank_sums in enumerate(sums):
            for local, value in enumerate(rank_sums):
                expert = int(placement[layer, rank * slots_per_rank + local])
                assert value == pytest.approx(float(checkpoint.expert(layer, expert).double().sum()), abs=1e-6)
