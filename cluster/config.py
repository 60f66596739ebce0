"""``flotilla serve`` configuration: one pydantic model, loaded from YAML.

Example (``examples/local-cpu.yaml``)::

    model: models/tiny-llama
    groups: 2
    tensor_parallel_size: 1
    pipeline_parallel_size: 1
    host: 127.0.0.1
    port: 8000

Unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cluster.lifecycle import RecoveryConfig
from router.settings import FailoverConfig, RoutingConfig, ServingConfig

# Engine arguments that Flotilla sets itself from the fields above.
RESERVED_ENGINE_ARGS = frozenset(
    {
        "model",
        "served_model_name",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "distributed_executor_backend",
        "reasoning_parser",  # serving.reasoning_parser sets it for the groups and the ingress alike
    }
)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the rule it breaks."""


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


class ClusterConfig(_Strict):
    address: str | None = Field(
        None, description="Existing Ray cluster to join ('auto' or 'host:port'); None starts a local one."
    )
    local: LocalClusterConfig = LocalClusterConfig()
    namespace: str = Field("flotilla", description="Ray namespace for groups and the ingress.")


class CpuEngineDefaults(_Strict):
    """Settings used only when vLLM runs on CPU (Flotilla's platform plugin is active)."""

    kv_cache_memory_bytes: int = Field(
        512 << 20, ge=1 << 20, description="KV cache per worker; vLLM's CPU default would claim most of RAM."
    )
    threads_per_worker: int | None = Field(
        None, ge=1, description="OpenMP threads per worker; default: cores divided among the node's workers."
    )


class IngressConfig(_Strict):
    """How HTTP reaches the ingress replicas."""

    proxy: Literal["haproxy", "serve"] = Field(
        "haproxy",
        description=(
            "haproxy: Ray Serve's direct ingress, HAProxy forwards HTTP straight to the ingress replicas' own "
            "servers (no Python proxy hop; the short path). serve: Ray Serve's Python HTTP proxy actor."
        ),
    )
    drain_period_s: float = Field(
        2.0, ge=0, description="How long a stopping ingress replica keeps accepting (haproxy mode)."
    )
    replicas: int = Field(1, ge=1, description="Ingress replicas.")
    placement: Literal["head", "any"] = Field(
        "head",
        description=(
            "head: ingress replicas (and Serve's HTTP proxy) run on the Ray head node, so losing an accelerator "
            "node never takes an in-flight request's ingress with it and failover can retry it. any: Ray places "
            "them (spread over nodes, for ingress throughput beyond one node's CPUs)."
        ),
    )

    def ray_env(self) -> dict[str, str]:
        """Environment the Serve controller and replicas need (set before Ray starts)."""
        if self.proxy == "serve":
            return {}
        return {
            "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(self.drain_period_s),
        }


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


class ServeConfig(_Strict):
    model: str = Field(..., description="Path to a Hugging Face model folder (config.json, tokenizer, weights).")
    served_model_name: str | None = Field(None, description="Name clients use in 'model'; default: folder name.")
    groups: int = Field(1, ge=1, description="Number of DP replica groups.")
    tensor_parallel_size: int | None = Field(
        1, ge=1, description="TP ranks per pipeline stage (kept within a node); null: the planner chooses."
    )
    pipeline_parallel_size: int | None = Field(
        1, ge=1, description="Pipeline stages per group (may span nodes); null: the planner chooses."
    )
    plan: PlanConfig = PlanConfig()
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM AsyncEngineArgs fields (checked against vLLM at startup).",
    )
    cpu: CpuEngineDefaults = CpuEngineDefaults()
    serving: ServingConfig = ServingConfig()
    routing: RoutingConfig = RoutingConfig()
    failover: FailoverConfig = FailoverConfig()
    coordinator: RecoveryConfig = RecoveryConfig()
    ingress: IngressConfig = IngressConfig()
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    cluster: ClusterConfig = ClusterConfig()
    startup_timeout_s: float = Field(900.0, gt=0, description="Give up if a group is not ready by then.")
    admin_token_env: str = Field(
        "FLOTILLA_ADMIN_TOKEN",
        description="Environment variable holding the bearer token of /admin/*; unset: admin endpoints are off.",
    )

    @field_validator("engine_args")
    @classmethod
    def _no_reserved_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(RESERVED_ENGINE_ARGS & value.keys())
        if clash:
            raise ValueError(f"engine_args may not set {clash}: Flotilla sets them from other fields of the config")
        return value

    @property
    def model_path(self) -> Path:
        return Path(self.model).expanduser().resolve()

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path.name

    @property
    def tp(self) -> int:
        if self.tensor_parallel_size is None:
            raise ConfigError("tensor_parallel_size is not resolved yet (the planner sets it)")
        return self.tensor_parallel_size

    @property
    def pp(self) -> int:
        if self.pipeline_parallel_size is None:
            raise ConfigError("pipeline_parallel_size is not resolved yet (the planner sets it)")
        return self.pipeline_parallel_size

    @property
    def slots_per_group(self) -> int:
        return self.tp * self.pp

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> ServeConfig:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read config {path}: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path} must be a mapping, got {type(raw).__name__}")
        raw |= overrides or {}
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise ConfigError(f"invalid config {path}:\n{_describe(err)}") from err


def _describe(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"  {where}: {item['msg']}")
    return "\n".join(lines)
