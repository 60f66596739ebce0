"""``flotilla serve`` configuration: one pydantic model, loaded from YAML.

Example (``examples/local-cpu.yaml``)::

    model: models/tiny-llama
    groups: 2
    tensor_parallel_size: 1
    pipeline_parallel_size: 1
    host: 127.0.0.1
    port: 8000

It nests the cluster's settings (``flotilla.cluster.config``) and the request path's
(``flotilla.router.settings``); only this composition root sees both. Unknown keys are
errors, never silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flotilla.cluster.config import ClusterConfig, ConfigError, CpuEngineDefaults, PlanConfig
from flotilla.cluster.lifecycle import RecoveryConfig
from flotilla.router.settings import FailoverConfig, IngressConfig, RoutingConfig, ServingConfig

# Engine arguments that Flotilla sets itself from the fields below.
RESERVED_ENGINE_ARGS = frozenset(
    {
        "model",
        "served_model_name",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "data_parallel_rank",
        "data_parallel_address",
        "data_parallel_rpc_port",
        "data_parallel_size_local",
        "distributed_executor_backend",
        "worker_extension_cls",  # the leader asks its ranks who they are through it (cluster/rank_probe.py)
        "reasoning_parser",  # serving.reasoning_parser sets it for the groups and the ingress alike
    }
)


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(..., description="Path to a Hugging Face model folder (config.json, tokenizer, weights).")
    served_model_name: str | None = Field(None, description="Name clients use in 'model'; default: folder name.")
    groups: int = Field(1, ge=1, description="Number of DP replica groups.")
    tensor_parallel_size: int | None = Field(
        1, ge=1, description="TP ranks per pipeline stage (kept within a node); null: the planner chooses."
    )
    pipeline_parallel_size: int | None = Field(
        1, ge=1, description="Pipeline stages per group (may span nodes); null: the planner chooses."
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "DP ranks per group. Above 1 every group is a wide-EP group of a MoE model: one vLLM engine per DP rank "
            "(each with TP ranks inside one node), the experts sharded over all of them (expert parallelism), each "
            "rank routed to on its own, and the ranks restarted together."
        ),
    )
    plan: PlanConfig = PlanConfig()
    executor: Literal["auto", "ray", "mp"] = Field(
        "auto",
        description=(
            "How a group's vLLM engine runs its ranks. ray: one Ray worker actor per rank in the group's "
            "bundles (any layout, stages across nodes). mp: vLLM's multiprocessing executor, ranks as child "
            "processes of the leader, which holds the group's accelerators in one bundle (one node). auto: mp for "
            "groups whose ranks fit one node (pipeline_parallel_size 1), ray otherwise."
        ),
    )
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
    startup_timeout_s: float = Field(
        900.0, gt=0, description="Give up if a group is not ready by then, or the ingress that long after the groups."
    )
    min_ready_groups: int | None = Field(
        None,
        ge=1,
        description=(
            "Start serving once this many groups are ready; the others keep starting, are retried with backoff "
            "while they cannot (their nodes have not joined, a start failed) and join routing when ready. "
            "null: every group (one that cannot start fails flotilla serve)."
        ),
    )
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

    @model_validator(mode="after")
    def _min_ready_groups_within_groups(self) -> ServeConfig:
        if self.min_ready_groups is not None and self.min_ready_groups > self.groups:
            raise ValueError(f"min_ready_groups ({self.min_ready_groups}) is more than groups ({self.groups})")
        return self

    @property
    def replica_metrics_port(self) -> int | None:
        """Base port of the ingress replicas' own metrics: ingress.metrics_port, else the serving port + 1
        when there are several replicas (each scrape of the serving port reaches only one of them)."""
        if self.ingress.metrics_port is not None or self.ingress.replicas == 1:
            return self.ingress.metrics_port
        return self.port + 1

    @property
    def groups_to_serve(self) -> int:
        """How many groups must be ready before the ingress serves."""
        return self.min_ready_groups or self.groups

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
    def layout_text(self) -> str:
        dp = f" × DP={self.data_parallel_size} (wide EP)" if self.data_parallel_size > 1 else ""
        return f"{self.groups} group(s){dp} × TP={self.tp} × PP={self.pp}"

    @property
    def slots_per_group(self) -> int:
        return self.tp * self.pp * self.data_parallel_size

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> ServeConfig:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read config {path}: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path} must be a mapping, got {type(raw).__name__}")
        for key, value in (overrides or {}).items():  # a nested override (ingress.metrics_port) keeps its siblings
            raw[key] = raw[key] | value if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
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
