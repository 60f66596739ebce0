"""values.schema.json of the Helm chart; its ``config`` part is generated from ``ServeConfig``.

Helm checks values against this schema on install, upgrade, lint and template, so a typo or a
bad value fails before anything reaches the cluster. ``config`` is Flotilla's own serve config
(flotilla/config.py) minus the keys the chart sets itself; TP and PP must be numbers there
because the chart sizes pods from them.
"""

from __future__ import annotations

import copy
from typing import Any

from flotilla.config import ServeConfig
from flotilla.router.policies import POLICIES

CHART_OWNED_CONFIG_KEYS = ("model", "host", "cluster")


def _obj(properties: dict[str, Any], required: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema | extra


def _int(minimum: int = 0, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum} | extra


STR = {"type": "string"}
NONEMPTY = {"type": "string", "minLength": 1}
MAP = {"type": "object"}
LIST = {"type": "array"}
QUANTITY = {"type": ["string", "integer"], "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"}
DURATION = {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"}


def _probe(description: str) -> dict[str, Any]:
    return _obj(
        {"periodSeconds": _int(1), "failureThreshold": _int(1), "timeoutSeconds": _int(1)},
        ("periodSeconds", "failureThreshold", "timeoutSeconds"),
        description=description,
    )


STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# NetworkPolicyPeer: which pods (by namespace and pod labels) or addresses a rule admits.
LABEL_SELECTOR = _obj(
    {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}, "matchExpressions": LIST}
)
PEERS = {
    "type": "array",
    "items": _obj(
        {
            "namespaceSelector": LABEL_SELECTOR,
            "podSelector": LABEL_SELECTOR,
            "ipBlock": _obj({"cidr": NONEMPTY, "except": {"type": "array", "items": STR}}, ("cidr",)),
        },
        minProperties=1,
    ),
}
# Escape hatches: Kubernetes fields passed through to the pod template. Their shape is checked here
# (so `helm install` rejects a map where a list belongs), their content by the API server.
ENV_VAR = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": NONEMPTY, "value": {"type": "string"}, "valueFrom": MAP},
    "additionalProperties": False,
}
NAMED_LIST = {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {"name": NONEMPTY}}}
VOLUME_MOUNTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "mountPath"],
        "properties": {
            "name": NONEMPTY,
            "mountPath": {"type": "string", "pattern": "^/"},
            "readOnly": {"type": "boolean"},
        },
    },
}
CAPABILITIES = _obj({"add": {"type": "array", "items": STR}, "drop": {"type": "array", "items": STR}})
SECURITY_CONTEXT = {
    "type": "object",
    "properties": {"capabilities": CAPABILITIES, "privileged": {"type": "boolean"}, "runAsUser": {"type": "integer"}},
}
SPREAD = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["maxSkew", "topologyKey", "whenUnsatisfiable"],
        "properties": {
            "maxSkew": {"type": "integer", "minimum": 1},
            "topologyKey": NONEMPTY,
            "whenUnsatisfiable": {"enum": ["DoNotSchedule", "ScheduleAnyway"]},
            "labelSelector": MAP,
        },
    },
}
DNS_NAME = {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$"}


def _pod_placement(description: str, resources: dict[str, Any]) -> dict[str, Any]:
    return _obj(
        {
            "resources": resources,
            "nodeSelector": STRING_MAP,
            "tolerations": {"type": "array", "items": MAP},
            "affinity": MAP,
            "env": {"type": "array", "items": ENV_VAR},
            "envFrom": {"type": "array", "items": MAP},
            "securityContext": SECURITY_CONTEXT,
            "podSecurityContext": MAP,
            "runtimeClassName": DNS_NAME,
            "priorityClassName": DNS_NAME,
            "serviceAccountName": DNS_NAME,
            "podAnnotations": STRING_MAP,
            "podLabels": STRING_MAP,
            "extraVolumes": NAMED_LIST,
            "extraVolumeMounts": VOLUME_MOUNTS,
            "topologySpreadConstraints": SPREAD,
        }
        | ({"shmSize": QUANTITY} if "worker" in description else {}),
        description=description,
    )


def serve_config_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema of ``config``, its ``$defs``), from ServeConfig without the chart-owned keys."""
    schema = ServeConfig.model_json_schema(ref_template="#/$defs/{model}")
    defs = schema.pop("$defs", {})
    for key in CHART_OWNED_CONFIG_KEYS:
        schema["properties"].pop(key)
    schema["required"] = ["tensor_parallel_size", "pipeline_parallel_size"]
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        prop = schema["properties"][key]
        prop.pop("anyOf", None)
        prop.update(type="integer", minimum=1)
    schema["description"] = (
        "Flotilla's serve config (ServeConfig, flotilla/config.py); the chart sets model, host and cluster."
    )
    routing = defs["RoutingConfig"]["properties"]["policy"]
    routing["enum"] = sorted(POLICIES)
    return schema, defs


def values_schema() -> dict[str, Any]:
    config, defs = serve_config_schema()
    resources = _obj({"requests": MAP, "limits": MAP, "claims": LIST})
    properties = {
        "mode": {
            "enum": ["kuberay", "lws"],
            "description": "kuberay: one RayService; lws: one LeaderWorkerSet, one LWS group per replica group.",
        },
        "image": _obj(
            {"repository": NONEMPTY, "tag": NONEMPTY, "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}},
            ("repository", "tag"),
        ),
        "imagePullSecrets": {"type": "array", "items": _obj({"name": NONEMPTY}, ("name",))},
        "accelerator": _obj(
            {
                "type": {"enum": ["nvidia", "cpu"]},
                "perNode": _int(1, description="Accelerators per node; tensor_parallel_size must divide it."),
                "resourceName": NONEMPTY,
            },
            ("type", "perNode", "resourceName"),
        ),
        "model": _obj(
            {
                "path": {"type": "string", "pattern": "^/", "description": "Absolute model folder in the pods."},
                "mountPath": {"type": "string", "pattern": "^/"},
                "existingClaim": STR,
                "volume": {
                    "type": "object",
                    "maxProperties": 1,
                    "description": "One Kubernetes volume source instead of existingClaim, e.g. emptyDir.",
                },
                "download": _obj(
                    {
                        "repo": STR,
                        "revision": {
                            "type": "string",
                            "pattern": "^([0-9a-f]{40})?$",
                            "description": "The commit to download (40 hex characters); required with repo.",
                        },
                    }
                ),
            },
            ("path", "mountPath"),
        ),
        "config": config,
        "head": _pod_placement("Ray head (kuberay mode): ingress and router.", resources),
        "worker": _pod_placement("Accelerator pods (kuberay workers; lws leaders and workers).", resources),
        "nodeLossTolerationSeconds": _int(0),
        "waitForWorkersSeconds": _int(
            60, description="How long the head / an LWS leader waits for the workers' accelerator slots."
        ),
        "kuberay": _obj(
            {
                "rayVersion": NONEMPTY,
                "annotations": MAP,
                "gcsFaultTolerance": _obj(
                    {
                        "enabled": {"type": "boolean"},
                        "redisAddress": {"type": "string", "pattern": r"^([^\s:]+:[0-9]+)?$"},
                        "redisPassword": {
                            "oneOf": [
                                {"type": "object", "maxProperties": 0},
                                _obj({"name": NONEMPTY, "key": NONEMPTY}, ("name", "key")),
                            ],
                            "description": "Secret key holding the Redis password: {name, key}.",
                        },
                        "externalStorageNamespace": STR,
                    },
                    description="KubeRay gcsFaultToleranceOptions with an external Redis.",
                ),
                "upgradeStrategy": {
                    "enum": ["", "NewCluster", "None"],
                    "description": "RayService spec.upgradeStrategy.type; empty: KubeRay's default (NewCluster).",
                },
            }
        ),
        "lws": _obj(
            {
                "startupPolicy": {"enum": ["LeaderCreated"], "description": "LeaderReady would deadlock."},
                "restartPolicy": {
                    "enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart"],
                    "description": "A group cannot rejoin its collectives: restart it whole.",
                },
                "maxUnavailable": {"type": ["integer", "string"]},
                "maxSurge": {"type": ["integer", "string"]},
                "exclusiveTopology": STR,
            }
        ),
        "probes": _obj(
            {
                "startup": _probe("Budget for Ray start, workers joining, weight load and warm-up."),
                "liveness": _probe("Ray GCS alive (dashboard /api/gcs_healthz), off the data path."),
                "readiness": _probe("At least one routable group (/health)."),
                "worker": _probe("Accelerator pods without HTTP: the raylet (dashboard agent)."),
            },
            ("startup", "liveness", "readiness"),
        ),
        "terminationGracePeriodSeconds": _int(0),
        "networkPolicy": _obj(
            {
                "enabled": {"type": "boolean"},
                "servingFrom": PEERS,
                "monitoringFrom": PEERS,
                "operatorFrom": PEERS,
            }
        ),
        "pdb": _obj(
            {
                "enabled": {"type": "boolean"},
                "maxUnavailable": {"type": ["integer", "string"], "minimum": 1, "pattern": "^[0-9]+%$"},
                "protectHead": {"type": "boolean"},
            }
        ),
        "service": _obj(
            {
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "port": _int(1, maximum=65535),
                "annotations": MAP,
            }
        ),
        "secrets": _obj(
            {"create": {"type": "boolean"}, "existingSecret": STR, "adminToken": STR, "apiKeys": STR, "hfToken": STR}
        ),
        "metrics": _obj(
            {
                "serviceMonitor": _obj(
                    {"enabled": {"type": "boolean"}, "interval": DURATION, "scrapeTimeout": DURATION, "labels": MAP}
                ),
                "prometheusRule": _obj(
                    {"enabled": {"type": "boolean"}, "labels": MAP, "runbookBaseUrl": {"type": "string"}}
                ),
            }
        ),
        "grafana": _obj({"dashboards": _obj({"enabled": {"type": "boolean"}, "labels": MAP, "annotations": MAP})}),
        "tests": _obj({"enabled": {"type": "boolean"}, "maxTokens": _int(1)}),
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Flotilla Helm chart values",
        **_obj(properties, ("mode", "image", "accelerator", "model", "config")),
        "$defs": copy.deepcopy(defs),
    }
