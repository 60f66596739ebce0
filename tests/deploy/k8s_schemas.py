"""Validate Kubernetes objects the way the API server would, without a cluster.

- Built-in kinds: ``kubernetes-validate``'s strict schemas (unknown fields are errors, as with
  ``kubectl apply``'s default strict field validation).
- KubeRay ``RayService``/``RayCluster`` and LWS ``LeaderWorkerSet``: the CRDs' own
  ``openAPIV3Schema``, read from ``$FLOTILLA_CRDS_DIR`` (default ``../shared/crds`` beside the
  repository; see its SOURCES.md for the upstream commits). Structural schemas do not say
  ``additionalProperties: false``, so unknown fields are found by walking the schema, and every
  embedded pod template is also checked against Kubernetes' strict ``PodTemplate`` schema.
- ``ServiceMonitor``/``PrometheusRule``: no schema is available offline; their rules are checked
  with ``promtool`` and their shape by the chart tests instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kube

REPO = Path(__file__).resolve().parents[2]
CRDS_DIR_ENV = "FLOTILLA_CRDS_DIR"
KUBERNETES_VERSION = "1.33"
CRD_FILES = {
    ("ray.io/v1", "RayService"): "ray.io_rayservices.yaml",
    ("ray.io/v1", "RayCluster"): "ray.io_rayclusters.yaml",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
}
NO_OFFLINE_SCHEMA = {"ServiceMonitor", "PrometheusRule"}


def crds_dir() -> Path:
    return Path(os.environ.get(CRDS_DIR_ENV, REPO.parent / "shared" / "crds"))


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    path = crds_dir() / CRD_FILES[(api_version, kind)]
    if not path.exists():  # a clone without ../shared: say what is missing instead of failing
        pytest.skip(f"{kind} CRD schema not found at {path}; set {CRDS_DIR_ENV} to a folder holding {path.name}")
    crd = yaml.safe_load(path.read_text())
    version = api_version.split("/")[1]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return served["schema"]["openAPIV3Schema"]


def unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Paths of fields that a structural schema does not declare (the API server drops or rejects them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                yield from unknown_fields(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from unknown_fields(item, extra, f"{path}.{key}")
            elif props is not None:
                yield f"{path}.{key}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from unknown_fields(item, schema["items"], f"{path}[{index}]")


def pod_templates(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = obj["spec"]
    if obj["kind"] == "RayService":
        spec = spec["rayClusterConfig"]
    if obj["kind"] in ("RayService", "RayCluster"):
        yield "head", spec["headGroupSpec"]["template"]
        for group in spec.get("workerGroupSpecs", []):
            yield f"worker group {group['groupName']}", group["template"]
    elif obj["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        if "leaderTemplate" in lwt:
            yield "leader", lwt["leaderTemplate"]
        yield "worker", lwt["workerTemplate"]


def validation_errors(obj: dict[str, Any]) -> list[str]:
    """Everything wrong with one object; an empty list means it validates."""
    kind, api_version = obj["kind"], obj["apiVersion"]
    if kind in NO_OFFLINE_SCHEMA:
        return []
    if (api_version, kind) not in CRD_FILES:
        return _builtin_errors(obj, kind)
    schema = crd_schema(api_version, kind)
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{kind} {_where(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    errors += [f"{kind} {path}: unknown field" for path in unknown_fields(obj, schema)]
    for name, template in pod_templates(obj):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        errors += [f"{kind} {name}: {e}" for e in _builtin_errors(wrapped, "PodTemplate")]
    return errors


def _builtin_errors(obj: dict[str, Any], kind: str) -> list[str]:
    try:
        kube.validate(obj, KUBERNETES_VERSION, strict=True)
    except kube.ValidationError as err:
        return [f"{kind} {_where(err.absolute_path)}: {err.message}"]
    except kube.SchemaNotFoundError as err:
        return [err.message]
    return []


def _where(path: Any) -> str:
    return "." + ".".join(str(p) for p in path) if path else "(root)"
