"""Configuration of the request path: the OpenAI serving layer, routing, and the ingress's own settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flotilla.cluster.contract import DEFAULT_NAMESPACE
from flotilla.cluster.engine import EngineSpec
from flotilla.router.policies import DEFAULT_POLICY, make_policy


class ServingConfig(BaseModel):
    """vLLM's OpenAI serving layer, configured by the names of ``vllm serve``'s flags.

    Every field but ``api_keys_env``, ``api_keys_file`` and ``extra_args`` is the vLLM flag of the same name
    (``chat_template`` is ``--chat-template``); ``extra_args`` takes any other field of vLLM's
    ``FrontendArgs`` and is checked against it when ``flotilla serve`` starts.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    chat_template: str | None = Field(
        None, description="Chat template (a file or the template itself); default: the tokenizer's."
    )
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto", description="How message content is handed to the chat template."
    )
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Keyword arguments every chat template call gets (requests may override them)."
    )
    trust_request_chat_template: bool = Field(False, description="Accept a chat_template sent in a request.")
    response_role: str = Field("assistant", description="Role of generated chat messages.")
    enable_auto_tool_choice: bool = Field(
        False, description="Let the model call tools by itself (tool_choice auto); needs tool_call_parser."
    )
    tool_call_parser: str | None = Field(
        None, description="vLLM tool parser that turns model output into tool calls (e.g. llama3_json, hermes)."
    )
    reasoning_parser: str | None = Field(
        None, description="vLLM reasoning parser (e.g. deepseek_r1); also set on every group's engine."
    )
    enable_prompt_tokens_details: bool = Field(
        True,
        description="usage.prompt_tokens_details.cached_tokens in responses (vLLM's default is off; ours is on).",
    )
    enable_force_include_usage: bool = Field(False, description="Usage in every streamed response.")
    return_tokens_as_token_ids: bool = Field(False, description="Logprob tokens as 'token_id:N'.")
    enable_log_requests: bool = Field(False, description="Log every request (prompts included).")
    max_log_len: int | None = Field(None, ge=0, description="Characters of prompts logged with enable_log_requests.")
    api_keys_env: str | None = Field(
        None,
        description=(
            "Environment variable holding the API keys (comma-separated) that /v1/* requires as "
            "'Authorization: Bearer KEY' (401 otherwise); read when flotilla serve starts. Unset: /v1/* is open. "
            "/health and /metrics are always open."
        ),
    )
    api_keys_file: str | None = Field(
        None,
        description=(
            "A file of API keys (comma- or newline-separated) that /v1/* requires, besides api_keys_env's; "
            "every ingress replica reads it again within a few seconds of a change, so keys rotate without a "
            "restart (a mounted Kubernetes Secret updates in place). A file with no key admits no request."
        ),
    )
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="Other fields of vLLM's FrontendArgs (checked at startup)."
    )


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
    load_poll_s: float = Field(
        0.2,
        gt=0,
        description=(
            "The most often each ingress reads an engine's scheduler load. Its leader answers once the load "
            "changes, so an idle engine is not asked again."
        ),
    )
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


class IngressConfig(BaseModel):
    """How HTTP reaches the ingress replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    replicas: int = Field(
        2,
        ge=1,
        description=(
            "Ingress replicas. Two by default, on one machine too: when one dies, HAProxy (or Serve's proxy) sends "
            "new requests to the other at once, and only the requests in flight on the dead one fail."
        ),
    )
    placement: Literal["head", "any"] = Field(
        "head",
        description=(
            "head: ingress replicas (and Serve's HTTP proxy) run on the Ray head node, so losing an accelerator "
            "node never takes an in-flight request's ingress with it and failover can retry it. any: Ray places "
            "them (spread over nodes, for ingress throughput beyond one node's CPUs)."
        ),
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Each ingress replica serves its own series (requests, latency, routing; labelled replica) on "
            "GET /metrics at metrics_port + its rank on its node, for Prometheus to scrape every replica directly: "
            "the serving port reaches one replica per request. /metrics?scope=cluster on the serving port then "
            "gives the rest (groups, engines), which every replica reports alike. null: the serving port + 1 with "
            "several replicas; off with one (its /metrics on the serving port has everything)."
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


class IngressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineSpec = Field(..., description="The groups' engine: the ingress renders and validates as it would.")
    max_model_len: int | None = Field(
        None,
        description=(
            "The groups' max_model_len; None: the first ready group's (the replica waits for one, so it can start "
            "while the groups load)."
        ),
    )
    block_size: int | None = Field(
        None, description="KV block size of every group's engine (the router hashes by it); None: as max_model_len."
    )
    routing: RoutingConfig = RoutingConfig()
    failover: FailoverConfig = FailoverConfig()
    namespace: str = Field(DEFAULT_NAMESPACE, description="Ray namespace of the coordinator and the group leaders.")
    admin_token: str | None = Field(None, description="Bearer token for /admin/*; None disables those endpoints.")
    serving: ServingConfig = ServingConfig()
    api_keys: tuple[str, ...] = Field((), description="Bearer keys /v1/* requires; empty: open.")
    api_keys_file: str | None = Field(None, description="A file of more keys, followed for changes (ServingConfig).")
    metrics_port: int | None = Field(None, description="Base port of the replicas' own metrics (IngressConfig).")
    metrics_host: str = Field("127.0.0.1", description="Where the replicas' own metrics listen (the serving host).")

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def knows_engine_shape(self) -> bool:
        return self.max_model_len is not None and self.block_size is not None

    @property
    def model_path(self) -> str:
        return self.engine.model
