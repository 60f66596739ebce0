"""Groups start independently (``min_ready_groups``): with room for one of two groups, `flotilla serve`
serves with the one that is ready; the other waits for accelerators and joins routing once a node with
them joins the cluster. (Its own module: it runs its own cluster in this test process.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devtools import wait_for
from flotilla.cluster.local_ray import LocalCluster, LocalClusterShape
from tests.e2e.faults import TOKEN, group, routed_to
from tests.e2e.server import Server, flotilla_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a node that joins late: about 3 minutes
JOIN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def short_cluster(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Server]]:
    cluster = LocalCluster(
        LocalClusterShape(nodes=2, slots_per_node=1, cpus_per_node=4, object_store_bytes=150 << 20),
        namespace="partial-start-test",
        log_to_driver=False,
    )
    try:
        cluster.remove_node(cluster.nodes()[1])  # one accelerator slot left: room for one group of two
        config = tmp_path_factory.mktemp("partial") / "two-groups.yaml"
        config.write_text(
            f"model: {models_dir / 'tiny-llama'}\nserved_model_name: tiny-llama\ngroups: 2\nmin_ready_groups: 1\n"
            f"cpu: {{threads_per_worker: 1}}\ningress: {{proxy: serve}}\ncluster: {{address: '{cluster.address}'}}\n"
        )
        with flotilla_serve(str(config), env={"FLOTILLA_ADMIN_TOKEN": TOKEN}) as running:
            yield cluster, running
    finally:
        cluster.shutdown()


def complete(server: Server, prompt: str) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 4}, timeout=60
    )
    assert response.status_code == 200, response.text


def gets_requests(server: Server, name: str) -> bool:
    """Send one more request (a new prompt: nothing cached anywhere); has ``name`` been routed one yet?"""
    complete(server, f"request number {routed_to(server, 'group-0') + routed_to(server, 'group-1'):.0f}")
    return routed_to(server, name) >= 1


def test_serves_with_the_ready_group_and_admits_the_other_when_its_node_joins(
    short_cluster: tuple[LocalCluster, Server],
) -> None:
    cluster, server = short_cluster
    states = {name: group(server, name)["state"] for name in ("group-0", "group-1")}
    # Both groups started at once; whichever was placed first holds the one slot.
    (serving,) = [name for name, state in states.items() if state == "ready"]
    (waiting,) = [name for name, state in states.items() if state == "starting"]
    assert f"serving with 1 of 2 groups; the others ({waiting}) join routing when ready" in server.output()
    for n in range(3):
        complete(server, f"one group is enough {n}")
    assert routed_to(server, serving) == 3 and routed_to(server, waiting) == 0

    cluster.add_node()  # the missing accelerators arrive
    assert wait_for(lambda: group(server, waiting)["state"] == "ready", JOIN_TIMEOUT_S, interval_s=0.5), group(
        server, waiting
    )
    assert group(server, serving)["generation"] == 1  # the serving group was never touched
    assert wait_for(lambda: gets_requests(server, waiting), 60), f"{waiting} gets no requests"
