"""Node loss under load: 5 simulated nodes, 2 groups × PP=2, one node spare. The node holding a
group's second pipeline stage is killed; the group restarts on the spare node, the other group
never restarts, and no non-streaming request fails. (Its own module: it runs its own cluster in
this test process, which must not be connected to another one.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.local_ray import LocalCluster, LocalClusterShape
from tests.e2e.faults import TOKEN, Load, group, status, wait_back_in_routing
from tests.e2e.server import Server, flotilla_serve

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pp_cluster(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Server]]:
    cluster = LocalCluster(
        LocalClusterShape(nodes=5, slots_per_node=1, cpus_per_node=4, object_store_bytes=150 << 20),
        namespace="failover-test",
        log_to_driver=False,
    )
    try:
        config = tmp_path_factory.mktemp("failover") / "pp2.yaml"
        config.write_text(
            f"model: {models_dir / 'tiny-llama'}\nserved_model_name: tiny-llama\ngroups: 2\n"
            f"pipeline_parallel_size: 2\ncpu: {{threads_per_worker: 1}}\ningress: {{proxy: serve}}\n"
            f"cluster: {{address: '{cluster.address}'}}\n"
        )
        with flotilla_serve(str(config), env={"FLOTILLA_ADMIN_TOKEN": TOKEN}) as running:
            yield cluster, running
    finally:
        cluster.shutdown()


def test_lost_node_with_a_pp_stage_restarts_the_group_elsewhere(pp_cluster: tuple[LocalCluster, Server]) -> None:
    cluster, server = pp_cluster
    target = next(g for g in status(server) if g["name"] == "group-0")
    stage_nodes = {r["pp_rank"]: r["node_id"] for r in target["ranks"]}
    assert stage_nodes[0] != stage_nodes[1]
    head = cluster.nodes()[0]
    victim = next(n for n in cluster.nodes() if n.node_id == stage_nodes[1])
    assert victim is not head
    before = group(server, "group-0")
    with Load(server.url, "tiny-llama") as load:
        cluster.remove_node(victim)
        after = wait_back_in_routing(server, "group-0", before["generation"])
        assert load.failures() == [], load.failures()[:3]
    assert sum(after["restarts"].values()) == 1
    moved = next(g for g in status(server) if g["name"] == "group-0")
    assert victim.node_id not in {r["node_id"] for r in moved["ranks"]}
    assert group(server, "group-1")["generation"] == 1  # the other group never restarted
