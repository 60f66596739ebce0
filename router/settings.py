"""Configuration of the request path: routing, and the ingress deployment's own settings."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.group_api import LEADER_NAMESPACE
from router.policies import DEFAULT_POLICY, make_policy


class RoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(
        DEFAULT_POLICY,
        description="round_robin | least_loaded | power_of_two | prefix_only | cache_aware (see router/policies).",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="The policy's parameters (its Params model).")
    kv_events: bool = Field(
        True,
        description=(
            "Engines publish their KV-cache events and every ingress replica follows them (precise prefix "
            "index, consistent across replicas). Off: each replica knows only what it routed itself."
        ),
    )
    load_poll_s: float = Field(0.2, gt=0, description="How often each ingress reads every engine's scheduler load.")
    event_timeout_s: float = Field(
        5.0,
        gt=0,
        description="A group whose events stop for this long after a prefill is routed on approximate knowledge.",
    )

    @model_validator(mode="after")
    def _policy_exists(self) -> RoutingConfig:
        make_policy(self.policy, self.params)  # unknown policy or parameter: an error at load time
        return self


class FailoverConfig(BaseModel):
    """What the ingress does when a group fails a request it was serving."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: int = Field(
        3,
        ge=1,
        description=(
            "Groups tried per request. A request that fails with an engine or actor error before any token reached "
            "the client (always the case for non-streaming requests) is retried on another group."
        ),
    )


class IngressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str
    model_path: str
    max_model_len: int
    block_size: int = Field(..., description="KV block size of every group's engine (the router hashes by it).")
    routing: RoutingConfig = RoutingConfig()
    failover: FailoverConfig = FailoverConfig()
    namespace: str = Field(LEADER_NAMESPACE, description="Ray namespace of the coordinator and the group leaders.")
    admin_token: str | None = Field(None, description="Bearer token for /admin/*; None disables those endpoints.")
