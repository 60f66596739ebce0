"""Ray clusters that Flotilla starts itself on one machine.

One node: a plain local Ray instance. Several nodes: ``ray.cluster_utils.Cluster``, which
runs one raylet per simulated node on this machine, so placement across nodes (PP stages on
different nodes) behaves as on a real multi-node cluster.

On CPU each node declares fake "GPU" slots, one per vLLM worker it should host
(see ``cluster.vllm_platform``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray

from flotilla.cluster.config import SERVE_CONTROL_LOOP_S, LocalClusterConfig
from flotilla.cluster.ports import free_port


@dataclass(frozen=True, slots=True)
class LocalClusterShape:
    nodes: int
    slots_per_node: int
    cpus_per_node: int
    object_store_bytes: int
    serve_control_loop_s: float = SERVE_CONTROL_LOOP_S

    @classmethod
    def for_groups(cls, config: LocalClusterConfig, slots_needed: int, leaders: int) -> LocalClusterShape:
        slots_per_node = config.slots_per_node or -(-slots_needed // config.nodes)
        # Ray CPUs are logical: leave room for every leader bundle plus the ingress and spare.
        cpus = config.num_cpus_per_node or max(os.cpu_count() or 1, leaders + 2)
        return cls(
            config.nodes, slots_per_node, cpus, config.object_store_memory_mib << 20, config.serve_control_loop_s
        )

    @property
    def total_slots(self) -> int:
        return self.nodes * self.slots_per_node


# Ray starts its workers at nice 15; the group's engine workers, leaders and ingress replicas are the
# serving path and run at normal priority (see cluster.engine.run_at_normal_priority).
WORKER_PRIORITY = {"worker_niceness": 0}
SERVE_CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"


class LocalCluster:
    """A running local cluster; ``shutdown`` stops every process it started."""

    def __init__(self, shape: LocalClusterShape, namespace: str, log_to_driver: bool) -> None:
        self.shape = shape
        self._multi_node: Any = None
        node_args: dict[str, Any] = {
            "num_cpus": shape.cpus_per_node,
            "num_gpus": shape.slots_per_node,
            "object_store_memory": shape.object_store_bytes,
        }
        self._node_args = node_args
        os.environ[SERVE_CONTROL_LOOP_ENV] = str(shape.serve_control_loop_s)  # Ray's processes inherit it
        if shape.nodes == 1:
            ray.init(
                address="local",  # always a new cluster, never one found in /tmp/ray
                **node_args,
                _system_config=WORKER_PRIORITY,
                namespace=namespace,
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                dashboard_port=free_port(),  # 8265 may belong to another cluster on this machine
                log_to_driver=log_to_driver,
            )
        else:
            from ray.cluster_utils import Cluster

            self._multi_node = Cluster(
                initialize_head=True,
                head_node_args=node_args
                | {"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port()}
                | {"_system_config": WORKER_PRIORITY},
            )
            try:
                for _ in range(shape.nodes - 1):
                    self._multi_node.add_node(**node_args)
                self._multi_node.wait_for_nodes()
                ray.init(address=self._multi_node.address, namespace=namespace, log_to_driver=log_to_driver)
            except BaseException:
                self._multi_node.shutdown()  # leave no half-started cluster behind
                raise
        self.address: str = ray.get_runtime_context().gcs_address

    def nodes(self) -> list[Any]:
        """The simulated nodes (``ray._private.node.Node``), head first; only for a multi-node cluster."""
        if self._multi_node is None:
            raise RuntimeError("a single-node cluster has no simulated nodes")
        return list(self._multi_node.list_all_nodes())

    def add_node(self) -> Any:
        """One more node of the cluster's shape, as a machine joining would; returns it once registered."""
        if self._multi_node is None:
            raise RuntimeError("a single-node cluster cannot grow")
        node = self._multi_node.add_node(**self._node_args)
        self._multi_node.wait_for_nodes()
        return node

    def remove_node(self, node: Any) -> None:
        """Kill every process of one simulated node at once, as a machine failure would."""
        if self._multi_node is None:
            raise RuntimeError("a single-node cluster has no simulated nodes")
        self._multi_node.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        ray.shutdown()
        if self._multi_node is not None:
            self._multi_node.shutdown()
            self._multi_node = None
