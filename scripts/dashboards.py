"""Grafana dashboards for Flotilla, generated from the panel lists below into deploy/grafana/*.json.

Every query reads the ingress's ``GET /metrics`` (``flotilla_*`` and each group's ``vllm:*`` with a
``group`` label) and filters on the ``$namespace`` (and, where it applies, ``$group``) template
variables. Group-lifecycle series are exported by every ingress replica alike, so they are
aggregated with ``max by (group)``; counters and histograms are summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NS = 'namespace=~"$namespace"'
NS_GROUP = 'namespace=~"$namespace", group=~"$group"'
WINDOW = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]  # (legend, PromQL)
    unit: str = "short"
    description: str = ""
    width: int = 12


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[str, ...] = ("namespace",)
    tags: tuple[str, ...] = field(default=("flotilla",))

    @property
    def filename(self) -> str:
        return f"{self.uid}.json"


def _quantiles(metric: str, selector: str, by: str = "") -> tuple[tuple[str, str], ...]:
    extra = f", {by}" if by else ""
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (
            f"{legend}p{q}",
            f"histogram_quantile(0.{q}, sum by (le{extra}) (rate({metric}_bucket{{{selector}}}[{WINDOW}])))",
        )
        for q in ("50", "99")
    )


def _ratio(numerator: str, denominator: str, by: str = "") -> str:
    """0/0-safe ratio of two rates; a numerator with no series (no errors yet) counts as 0."""
    grouping = f" by ({by})" if by else ""
    fallback = "" if by else " or vector(0)"
    return (
        f"(sum{grouping} (rate({numerator}[{WINDOW}])){fallback})"
        f" / clamp_min(sum{grouping} (rate({denominator}[{WINDOW}])), 1e-9)"
    )


OVERVIEW = Dashboard(
    uid="flotilla-overview",
    title="Flotilla / Cluster overview",
    description="Traffic, errors, latency and throughput of the whole deployment, as the ingress sees it.",
    panels=(
        Panel(
            "Request rate by endpoint",
            (("{{endpoint}}", f"sum by (endpoint) (rate(flotilla_requests_total{{{NS}}}[{WINDOW}]))"),),
            unit="reqps",
        ),
        Panel(
            "Server error ratio (5xx)",
            (
                (
                    "5xx / all",
                    _ratio(f'flotilla_requests_total{{{NS}, status=~"5.."}}', f"flotilla_requests_total{{{NS}}}"),
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Requests by status",
            (("{{status}}", f"sum by (status) (rate(flotilla_requests_total{{{NS}}}[{WINDOW}]))"),),
            unit="reqps",
        ),
        Panel(
            "Ready replica groups",
            (("ready", f'sum(max by (group) (flotilla_group_state{{{NS}, state="ready"}}))'),),
            description="Groups the router may send requests to (coordinator state).",
        ),
        Panel(
            "Time to first token (ingress, streaming)",
            _quantiles("flotilla_time_to_first_token_seconds", NS),
            unit="s",
        ),
        Panel(
            "Time to first token (engines)",
            _quantiles("vllm:time_to_first_token_seconds", NS),
            unit="s",
        ),
        Panel(
            "Inter-token latency (engines)",
            _quantiles("vllm:inter_token_latency_seconds", NS),
            unit="s",
        ),
        Panel(
            "End-to-end latency (ingress)",
            _quantiles("flotilla_request_latency_seconds", NS),
            unit="s",
        ),
        Panel(
            "End-to-end latency (engines)",
            _quantiles("vllm:e2e_request_latency_seconds", NS),
            unit="s",
        ),
        Panel(
            "Tokens per second",
            (
                ("prompt", f"sum(rate(flotilla_prompt_tokens_total{{{NS}}}[{WINDOW}]))"),
                ("generated", f"sum(rate(flotilla_generation_tokens_total{{{NS}}}[{WINDOW}]))"),
            ),
            unit="short",
        ),
        Panel(
            "Requests in flight",
            (("in flight", f"sum(flotilla_group_in_flight_requests{{{NS}}})"),),
        ),
        Panel(
            "Retried and aborted requests",
            (
                ("retried {{reason}}", f"sum by (reason) (rate(flotilla_requests_retried_total{{{NS}}}[{WINDOW}]))"),
                (
                    "aborted {{endpoint}}",
                    f"sum by (endpoint) (rate(flotilla_aborted_requests_total{{{NS}}}[{WINDOW}]))",
                ),
            ),
            unit="reqps",
        ),
    ),
)

ROUTER = Dashboard(
    uid="flotilla-router",
    title="Flotilla / Router",
    description="Routing decisions, prefix matches, per-group load and the engines' prefix-cache hit rate.",
    variables=("namespace", "group"),
    panels=(
        Panel(
            "Decisions by group",
            (("{{group}}", f"sum by (group) (rate(flotilla_routing_decisions_total{{{NS_GROUP}}}[{WINDOW}]))"),),
            unit="reqps",
        ),
        Panel(
            "Decisions by policy",
            (("{{policy}}", f"sum by (policy) (rate(flotilla_routing_decisions_total{{{NS_GROUP}}}[{WINDOW}]))"),),
            unit="reqps",
        ),
        Panel(
            "Matched block ratio",
            (
                *_quantiles("flotilla_routing_matched_block_ratio", NS),
                (
                    "mean",
                    _ratio(
                        f"flotilla_routing_matched_block_ratio_sum{{{NS}}}",
                        f"flotilla_routing_matched_block_ratio_count{{{NS}}}",
                    ),
                ),
            ),
            unit="percentunit",
            description="Share of a prompt's full blocks that the chosen group already holds (router index).",
        ),
        Panel(
            "Decision latency",
            _quantiles("flotilla_routing_decision_seconds", NS),
            unit="s",
        ),
        Panel(
            "Load per group",
            (("{{group}} {{signal}}", f"max by (group, signal) (flotilla_group_load{{{NS_GROUP}}})"),),
            description="in_flight and pending_prefill_tokens (ingress), running, waiting, kv_usage (engine).",
        ),
        Panel(
            "In flight per group",
            (("{{group}}", f"sum by (group) (flotilla_group_in_flight_requests{{{NS_GROUP}}})"),),
        ),
        Panel(
            "Prefix-cache hit rate per group (engine counters)",
            (
                (
                    "{{group}}",
                    _ratio(
                        f"vllm:prefix_cache_hits_total{{{NS_GROUP}}}",
                        f"vllm:prefix_cache_queries_total{{{NS_GROUP}}}",
                        by="group",
                    ),
                ),
            ),
            unit="percentunit",
            width=24,
        ),
    ),
)

GROUPS = Dashboard(
    uid="flotilla-groups",
    title="Flotilla / Replica groups",
    description="Lifecycle (state, restarts, detection and recovery) and engine saturation of each group.",
    variables=("namespace", "group"),
    panels=(
        Panel(
            "State",
            (("{{group}} {{state}}", f"max by (group, state) (flotilla_group_state{{{NS_GROUP}}}) == 1"),),
            description="One series per group, named after its current state.",
        ),
        Panel(
            "Restarts (1 h)",
            (
                (
                    "{{group}} {{reason}}",
                    f"max by (group, reason) ((flotilla_group_restarts_total{{{NS_GROUP}}}"
                    f" unless flotilla_group_restarts_total{{{NS_GROUP}}} offset 1h)"
                    f" or increase(flotilla_group_restarts_total{{{NS_GROUP}}}[1h]))",
                ),
            ),
        ),
        Panel(
            "Failure detection time",
            _quantiles("flotilla_group_detection_seconds", NS),
            unit="s",
        ),
        Panel(
            "Recovery time (out of routing → back)",
            _quantiles("flotilla_group_recovery_seconds", NS),
            unit="s",
        ),
        Panel(
            "KV cache usage",
            (("{{group}}", f"max by (group) (vllm:kv_cache_usage_perc{{{NS_GROUP}}})"),),
            unit="percentunit",
        ),
        Panel(
            "Requests running and waiting",
            (
                ("{{group}} running", f"max by (group) (vllm:num_requests_running{{{NS_GROUP}}})"),
                ("{{group}} waiting", f"max by (group) (vllm:num_requests_waiting{{{NS_GROUP}}})"),
            ),
        ),
        Panel(
            "Preemptions",
            (("{{group}}", f"sum by (group) (rate(vllm:num_preemptions_total{{{NS_GROUP}}}[{WINDOW}]))"),),
            unit="ops",
        ),
        Panel(
            "Generated tokens per second",
            (("{{group}}", f"sum by (group) (rate(flotilla_generation_tokens_total{{{NS_GROUP}}}[{WINDOW}]))"),),
        ),
    ),
)

EPLB = Dashboard(
    uid="flotilla-eplb",
    title="Flotilla / Expert load balancing",
    description="Expert-parallel load balance and the rebalances that keep it (MoE models with EPLB).",
    panels=(
        Panel(
            "Balancedness (mean / max tokens per EP rank)",
            (("overall", f"min(flotilla_eplb_balancedness_overall{{{NS}}})"),),
            unit="percentunit",
        ),
        Panel(
            "Balancedness by layer",
            (("layer {{layer}}", f"min by (layer) (flotilla_eplb_balancedness{{{NS}}})"),),
            unit="percentunit",
        ),
        Panel(
            "Rebalances",
            (("rebalances", f"sum(rate(flotilla_eplb_rebalances_total{{{NS}}}[{WINDOW}]))"),),
            unit="ops",
        ),
        Panel(
            "Rebalance duration",
            _quantiles("flotilla_eplb_rebalance_duration_seconds", NS),
            unit="s",
        ),
        Panel(
            "Experts moved",
            (("experts", f"sum(rate(flotilla_eplb_experts_moved_total{{{NS}}}[{WINDOW}]))"),),
            unit="ops",
        ),
        Panel(
            "Bytes moved",
            (("bytes", f"sum(rate(flotilla_eplb_bytes_moved_total{{{NS}}}[{WINDOW}]))"),),
            unit="Bps",
        ),
    ),
)

# dcgm-exporter (NVIDIA's GPU operator) with its Kubernetes pod mapping labels each GPU with the pod
# using it; scraped with honorLabels false (its ServiceMonitor's default) those labels arrive as
# exported_namespace / exported_pod, beside the exporter's own namespace.
GPU = 'exported_namespace=~"$namespace"'
GPU_BY = "exported_pod"

GPUS = Dashboard(
    uid="flotilla-gpus",
    title="Flotilla / Accelerators (DCGM)",
    description=(
        "The GPUs of Flotilla's pods, from NVIDIA's dcgm-exporter (GPU operator, Kubernetes pod mapping on): "
        "utilisation, memory, tensor-core activity, temperature, power and XID errors."
    ),
    panels=(
        Panel(
            "GPU utilisation",
            (("{{exported_pod}}", f"avg by ({GPU_BY}) (DCGM_FI_DEV_GPU_UTIL{{{GPU}}})"),),
            unit="percent",
            description="Share of time a kernel ran, averaged over each pod's GPUs.",
        ),
        Panel(
            "GPU memory used",
            (
                (
                    "{{exported_pod}}",
                    f"sum by ({GPU_BY}) (DCGM_FI_DEV_FB_USED{{{GPU}}}) / clamp_min(sum by ({GPU_BY}) "
                    f"(DCGM_FI_DEV_FB_USED{{{GPU}}} + DCGM_FI_DEV_FB_FREE{{{GPU}}}), 1)",
                ),
            ),
            unit="percentunit",
            description="vLLM takes gpu_memory_utilization of each GPU at start-up: flat near it is normal.",
        ),
        Panel(
            "Tensor core activity",
            (("{{exported_pod}}", f"avg by ({GPU_BY}) (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{GPU}}})"),),
            unit="percentunit",
            description="A profiling field (data-centre GPUs): how busy the matrix units are, beyond 'a kernel ran'.",
        ),
        Panel(
            "Temperature",
            (("{{exported_pod}} GPU {{gpu}}", f"max by ({GPU_BY}, gpu) (DCGM_FI_DEV_GPU_TEMP{{{GPU}}})"),),
            unit="celsius",
        ),
        Panel(
            "Power",
            (("{{exported_pod}}", f"sum by ({GPU_BY}) (DCGM_FI_DEV_POWER_USAGE{{{GPU}}})"),),
            unit="watt",
        ),
        Panel(
            "XID errors",
            (("{{exported_pod}} GPU {{gpu}}", f"max by ({GPU_BY}, gpu) (DCGM_FI_DEV_XID_ERRORS{{{GPU}}}) > 0"),),
            description="The last XID error code of a GPU (0: none). 48, 63, 64, 74, 79, 94, 95: drain the node; "
            "see runbooks/node-loss.md.",
        ),
    ),
)

DASHBOARDS = (OVERVIEW, ROUTER, GROUPS, EPLB, GPUS)

_VARIABLE_QUERIES = {
    "namespace": "label_values(flotilla_group_in_flight_requests, namespace)",
    "group": 'label_values(flotilla_group_in_flight_requests{namespace=~"$namespace"}, group)',
}


def _variable(name: str) -> dict[str, Any]:
    query = _VARIABLE_QUERIES[name]
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def _panel(index: int, panel: Panel, x: int, y: int) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (legend, expr) in enumerate(panel.targets)
        ],
    }


def to_grafana(dashboard: Dashboard) -> dict[str, Any]:
    panels, x, y = [], 0, 0
    for index, panel in enumerate(dashboard.panels):
        if x + panel.width > 24:
            x, y = 0, y + 8
        panels.append(_panel(index, panel, x, y))
        x += panel.width
    datasource = {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
    }
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": list(dashboard.tags),
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {"list": [datasource, *(_variable(name) for name in dashboard.variables)]},
        "annotations": {"list": []},
        "links": [{"title": "Flotilla dashboards", "type": "dashboards", "tags": ["flotilla"], "asDropdown": True}],
        "panels": panels,
    }
