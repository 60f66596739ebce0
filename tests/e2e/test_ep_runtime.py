"""CPU expert parallelism on 4 Ray ranks: outputs equal a single-process reference before, during
and after a live rebalance driven by the EPLB controller, and the weights really moved; then the
same with the coordinator owning the EP group and driving its EPLB loop."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from devtools import wait_for
from flotilla.cluster.coordinator import Coordinator, coordinator_actor_options
from flotilla.cluster.eplb.controller import EplbController, EplbControllerConfig, EplbState
from flotilla.cluster.eplb.demo import skewed_tokens, wait_for_ep_group
from flotilla.cluster.eplb.ep_group import EP_GROUP_NAME, EpGroupConfig
from flotilla.cluster.eplb.moe import MoeCheckpoint, reference_forward
from flotilla.cluster.eplb.runtime import CpuEpRuntime
from flotilla.cluster.lifecycle import RecoveryConfig
from tests.e2e.server import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
RANKS, TOKENS = 4, 96


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    ray.init(address="local", num_cpus=RANKS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def runtime(ray_session: None, tiny_mixtral: Path) -> Iterator[CpuEpRuntime]:
    ep = CpuEpRuntime(tiny_mixtral, num_ranks=RANKS)
    yield ep
    ep.shutdown()


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


def test_the_coordinator_drives_eplb_on_its_ep_group(ray_session: None, tiny_mixtral: Path) -> None:
    """The coordinator owns an EP group and ticks its EPLB loop; while tokens flow the skew triggers a
    rebalance, outputs stay equal to the reference throughout, and ``flotilla status`` shows it."""
    namespace = "ep-coordinator-test"
    config = EpGroupConfig(
        model=tiny_mixtral,
        ranks=RANKS,
        tick_s=0.2,
        controller=EplbControllerConfig(
            window_ticks=5, min_window_ticks=3, trigger_balancedness=0.9, rearm_balancedness=0.95
        ),
    )
    coordinator = (
        ray.remote(Coordinator)
        .options(**coordinator_actor_options(namespace))
        .remote({}, RecoveryConfig(), 60.0, namespace, config)
    )
    try:
        ray.get(coordinator.start.remote())
        group = wait_for_ep_group(namespace, timeout_s=120)
        checkpoint = MoeCheckpoint(tiny_mixtral)
        rng = np.random.default_rng(1)
        batches = [skewed_tokens(checkpoint, TOKENS, hot_expert=5, rng=rng) for _ in range(3)]
        expected = [reference_forward(checkpoint, torch.from_numpy(batch)).numpy() for batch in batches]
        states_seen = set()
        deadline = time.monotonic() + 120
        step = 0
        while True:
            out = ray.get(group.forward.remote(batches[step % 3], np.arange(TOKENS) + step * TOKENS))
            np.testing.assert_allclose(out, expected[step % 3], rtol=1e-4, atol=1e-4)
            eplb = next(iter(ray.get(coordinator.get_membership.remote()).eplb), None)
            if eplb is not None:
                states_seen.add(eplb.state)
                if eplb.rebalances >= 1:
                    break
            assert time.monotonic() < deadline, f"no rebalance: {eplb}"
            step += 1
        assert "migrating" in states_seen, "outputs were checked while layers migrated"
        last = eplb.last_rebalance
        assert last is not None and last.experts_moved > 0
        assert last.balancedness_planned > last.balancedness_before + 0.1

        listed = subprocess.run(
            [
                sys.executable,
                "-m",
                "flotilla.cli",
                "status",
                "--json",
                "--namespace",
                namespace,
                "--address",
                ray.get_runtime_context().gcs_address,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        (shown,) = json.loads(listed.stdout)["eplb"]
        assert (
            shown["group"] == EP_GROUP_NAME
            and shown["rebalances"] >= 1
            and shown["ranks"] == RANKS
            and shown["experts_moved_total"] > 0
        )
    finally:
        ray.get(coordinator.shutdown.remote())
        ray.kill(coordinator, no_restart=True)

    def ep_group_gone() -> bool:  # ray.kill returns before the GCS forgets the actor's name
        try:
            ray.get_actor(EP_GROUP_NAME, namespace=namespace)
        except ValueError:
            return True
        return False

    assert wait_for(ep_group_gone, 30), "the coordinator's shutdown left the EP group running"
