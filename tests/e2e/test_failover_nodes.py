"""Node loss under load, through the default HTTP path (HAProxy): 5 simulated nodes, 2 groups × PP=2,
one node spare. A node (not the head) holding one group's pipeline stage is killed; the group restarts
on the spare node, the other group never restarts, and no non-streaming request fails nor is left
unanswered. (Its own module: it runs its own cluster in this test process, which must not be connected
to another one.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flotilla.cluster.local_ray import LocalCluster, LocalClusterShape
from flotilla.cluster.ports import free_port
from flotilla.router.settings import IngressConfig
from tests.e2e.faults import TOKEN, group, load_through, status, wait_back_in_routing
from tests.e2e.server import Server, flotilla_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def pp_cluster(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Server]]:
    # The default HTTP path (HAProxy): the cluster's processes need its environment from the start,
    # as deploy/ starts Ray with it; HAProxy's side ports are made free ones.
    haproxy = IngressConfig().ray_env() | {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
    }
    with pytest.MonkeyPatch.context() as env:
        for name, value in haproxy.items():
            env.setenv(name, value)
        cluster = LocalCluster(
            LocalClusterShape(nodes=5, slots_per_node=1, cpus_per_node=4, object_store_bytes=150 << 20),
            namespace="failover-test",
            log_to_driver=False,
        )
    try:
        config = tmp_path_factory.mktemp("failover") / "pp2.yaml"
        config.write_text(
            f"model: {models_dir / 'tiny-llama'}\nserved_model_name: tiny-llama\ngroups: 2\n"
            f"pipeline_parallel_size: 2\ncpu: {{threads_per_worker: 1}}\ncluster: {{address: '{cluster.address}'}}\n"
        )
        with flotilla_serve(str(config), env={"FLOTILLA_ADMIN_TOKEN": TOKEN}) as running:
            yield cluster, running
    finally:
        cluster.shutdown()


def serve_actor_nodes(server: Server) -> set[str]:
    """Nodes running a live Serve proxy or ingress replica."""
    from ray.util.state import list_actors

    actors = list_actors(address=server.ray_address, filters=[("state", "=", "ALIVE")], limit=10_000)
    return {a.node_id for a in actors if "ProxyActor" in a.class_name or "OpenAIIngress" in a.class_name}


def test_lost_node_with_a_pp_stage_restarts_the_group_elsewhere(pp_cluster: tuple[LocalCluster, Server]) -> None:
    cluster, server = pp_cluster
    head = cluster.nodes()[0]
    assert serve_actor_nodes(server) == {head.node_id}  # the node loss must not take the HTTP path with it
    groups = {g["name"]: g for g in status(server)}
    for g in groups.values():
        assert len({r["node_id"] for r in g["ranks"]}) == 2  # each stage on its own node
    # A node holding a pipeline stage, not the head (one accelerator slot per node: one rank on it).
    name, victim_id = next(
        (g["name"], r["node_id"]) for g in groups.values() for r in g["ranks"] if r["node_id"] != head.node_id
    )
    bystander = next(other for other in groups if other != name)
    victim = next(n for n in cluster.nodes() if n.node_id == victim_id)
    before = group(server, name)
    with load_through(server, name):
        cluster.remove_node(victim)
        after = wait_back_in_routing(server, name, before["generation"])
    assert sum(after["restarts"].values()) == 1
    moved = next(g for g in status(server) if g["name"] == name)
    assert victim_id not in {r["node_id"] for r in moved["ranks"]}
    assert group(server, bystander)["generation"] == 1  # the other group never restarted
