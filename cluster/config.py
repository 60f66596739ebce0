"""Cluster-side configuration: the local Ray cluster, CPU engine defaults, the planner's assumptions.

The whole ``flotilla serve`` config (``flotilla.config.ServeConfig``) nests these. Unknown keys
are errors, never silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flotilla.cluster.contract import DEFAULT_NAMESPACE


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the rule it breaks."""


SERVE_CONTROL_LOOP_S = 0.5


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalClusterConfig(_Strict):
    """The Ray cluster Flotilla starts itself when ``cluster.address`` is not set.

    On CPU every vLLM worker needs one fake "GPU" slot (see ``cluster.vllm_platform``);
    by default a local cluster declares exactly as many slots as the groups need.
    """

    nodes: int = Field(1, ge=1, description="Simulated nodes (ray.cluster_utils.Cluster) when > 1.")
    slots_per_node: int | None = Field(
        None, ge=1, description="Fake GPU slots per node; default: enough for every group on the nodes given."
    )
    num_cpus_per_node: int | None = Field(
        None, ge=1, description="Ray CPUs per node; default: the machine's cores (logical; not a limit)."
    )
    object_store_memory_mib: int = Field(300, ge=75, description="Object store size per node.")
    serve_control_loop_s: float = Field(
        SERVE_CONTROL_LOOP_S,
        gt=0,
        description=(
            "How often Ray Serve's controller runs its control loop (RAY_SERVE_CONTROL_LOOP_INTERVAL_S; Serve's "
            "default 0.1 s). It manages only the ingress replicas (the coordinator manages the groups), which "
            "then take about 1 s longer to deploy and up to 0.4 s longer to be replaced; ten loops a second cost "
            "the controller and the GCS about 0.03 cores, idle or not, on a machine whose cores the engines need. "
            "A cluster Flotilla joins keeps what it was started with."
        ),
    )


class ClusterConfig(_Strict):
    address: str | None = Field(
        None, description="Existing Ray cluster to join ('auto' or 'host:port'); None starts a local one."
    )
    local: LocalClusterConfig = LocalClusterConfig()
    namespace: str = Field(
        DEFAULT_NAMESPACE,
        description="Ray namespace of the coordinator, the groups' leaders and the ingress (flotilla status/drain/… "
        "take --namespace).",
    )


class CpuEngineDefaults(_Strict):
    """Settings used only when vLLM runs on CPU (Flotilla's platform plugin is active)."""

    kv_cache_memory_bytes: int = Field(
        512 << 20, ge=1 << 20, description="KV cache per worker; vLLM's CPU default would claim most of RAM."
    )
    threads_per_worker: int | None = Field(
        None,
        ge=1,
        description="OpenMP threads per worker; default: the node's cores less one per worker, divided among them.",
    )
    bind_cores: bool = Field(
        True,
        description=(
            "Pin each worker's model threads to cores that no other group on the machine holds, as vLLM's CPU "
            "executor pins its own, and keep the workers' I/O threads and every other process of Ray's on the "
            "machine off those cores where any are left (groups on one node, executor mp; not wide-EP groups). "
            "False: workers run where the OS puts them."
        ),
    )
    rank_in_engine_core: bool = Field(
        True,
        description=(
            "A group of one rank (TP = PP = 1, executor mp) runs its model inside vLLM's EngineCore process, as vLLM "
            "does on GPUs, with the rank's OpenMP threads and cores set for that process. False: vLLM's CPU default, "
            "a worker process of its own that EngineCore busy-waits on at every step."
        ),
    )


class PlanConfig(_Strict):
    """The hardware and workload the planner assumes when TP or PP is omitted (see ``flotilla plan``)."""

    nodes: int | None = Field(None, ge=1, description="Default: cluster.local.nodes (required with cluster.address).")
    accelerators_per_node: int | None = Field(
        None,
        ge=1,
        description="Default: cluster.local.slots_per_node, else one per group (required with cluster.address).",
    )
    memory_gib: float | None = Field(
        None, gt=0, description="Memory per accelerator; default on a local cluster: RAM divided by the slots."
    )
    intra_link: Literal["nvlink", "pcie"] = "nvlink"
    inter_link: Literal["rdma", "ethernet"] = "rdma"
    context_len: int | None = Field(None, ge=1, description="Default: the model's, at most 8192.")
    concurrency: int = Field(64, ge=1, description="Sequences in flight over all groups.")
    latency_sensitive: bool = False
