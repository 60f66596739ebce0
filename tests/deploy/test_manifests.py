"""deploy/k8s (plain manifests), deploy/grafana and the chart's copies are current and valid."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from scripts import render_manifests
from scripts.dashboards import DASHBOARDS
from tests.deploy.k8s_schemas import validation_errors

PLAIN_MANIFESTS = sorted(render_manifests.K8S.glob("*/*.yaml"))


def test_generated_files_are_current() -> None:
    stale = render_manifests.stale(render_manifests.expected_files())
    stale += render_manifests.stale(render_manifests.expected_manifests())
    assert stale == [], "run: python -m scripts.render_manifests"


def test_check_mode_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render_manifests, "GRAFANA", tmp_path)  # nothing written there yet
    assert render_manifests.main(["--check"]) == 1


@pytest.mark.parametrize("path", PLAIN_MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_plain_manifests_validate(path: Path) -> None:
    objects = [o for o in yaml.safe_load_all(path.read_text()) if o]
    assert objects
    assert [e for o in objects for e in validation_errors(o)] == []


def test_plain_manifests_cover_both_modes() -> None:
    kinds: dict[str, set[str]] = {}
    for path in PLAIN_MANIFESTS:
        kinds.setdefault(path.parent.name, set()).update(o["kind"] for o in yaml.safe_load_all(path.read_text()) if o)
    assert kinds["kuberay"] >= {"RayService", "Service", "ConfigMap", "ServiceMonitor", "PrometheusRule"}
    assert kinds["lws"] >= {"LeaderWorkerSet", "Service", "ConfigMap", "ServiceMonitor", "PrometheusRule"}
    assert "Pod" not in kinds["kuberay"] | kinds["lws"]  # the helm-test pod is Helm-only


def test_dashboards_have_template_variables_and_queries() -> None:
    for dashboard in DASHBOARDS:
        model = json.loads((render_manifests.GRAFANA / dashboard.filename).read_text())
        variables = {v["name"] for v in model["templating"]["list"]}
        assert {"datasource", "namespace"} <= variables
        exprs = [t["expr"] for p in model["panels"] for t in p["targets"]]
        assert exprs and all('namespace=~"$namespace"' in e for e in exprs)
        if "group" in variables:
            assert any('group=~"$group"' in e for e in exprs)
        assert len({p["id"] for p in model["panels"]}) == len(model["panels"])


def test_rules_file_passes_promtool(prometheus_bin) -> None:
    promtool = prometheus_bin.parent / "promtool"
    result = subprocess.run(
        [promtool, "check", "rules", render_manifests.RULES], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout


def test_rules_unit_tests_pass(prometheus_bin) -> None:
    """deploy/prometheus/flotilla-rules.test.yaml: the error-rate traffic guard, the scoped absent()
    and the target-down alert, each firing where it must and quiet where it must."""
    promtool = prometheus_bin.parent / "promtool"
    tests = render_manifests.RULES.with_name("flotilla-rules.test.yaml")
    result = subprocess.run([promtool, "test", "rules", tests], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {
        a
        for group in yaml.safe_load(tests.read_text())["tests"]
        for t in group["alert_rule_test"]
        for a in [t["alertname"]]
    }
    assert {"FlotillaHighErrorRate", "FlotillaTargetDown", "FlotillaMetricsMissing"} <= alerts


def test_alerts_are_scoped_to_flotillas_jobs() -> None:
    rules = {
        r["alert"]: r["expr"] for g in yaml.safe_load(render_manifests.RULES.read_text())["groups"] for r in g["rules"]
    }
    for selector in re.findall(r"absent\(([^)]*)\)", rules["FlotillaMetricsMissing"]):
        assert 'job=~".*flotilla.*"' in selector, selector
    selectors = re.findall(r"absent\(([^)]*)\)", rules["FlotillaMetricsMissing"])
    assert len(selectors) == 2
    assert rules["FlotillaTargetDown"].endswith('(up{job=~".*flotilla.*"}) == 0')
    assert ">= 0.1" in rules["FlotillaHighErrorRate"]  # the minimum-traffic guard


@pytest.mark.parametrize("path", PLAIN_MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_plain_manifests_render_no_null_fields(path: Path) -> None:
    assert not re.search(r":\s+null\s*$", path.read_text(), re.M)
    assert "Secret" not in {o["kind"] for o in yaml.safe_load_all(path.read_text()) if o}  # kubectl create secret


def test_the_secret_holds_only_what_was_given() -> None:
    assert "Secret" not in {o["kind"] for o in render_manifests.rendered_objects({})}
    objs = render_manifests.rendered_objects({"secrets": {"hfToken": "hf_x"}})
    (secret,) = [o for o in objs if o["kind"] == "Secret"]
    assert set(secret["data"]) == {"hf-token"}


def test_image_recipe_matches_the_project_and_its_users() -> None:
    repo = render_manifests.REPO
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    project = pyproject["project"]
    dockerfile = (repo / "deploy" / "docker" / "Dockerfile").read_text()
    assert set(re.findall(r"^FROM \S+ AS (\w+)$", dockerfile, re.M)) == {"base", "cpu", "gpu"}
    for target in ("cpu", "gpu"):
        assert f" AS {target}\n" in dockerfile, target
        assert target in project["optional-dependencies"] and f"'.[{target}]'" in dockerfile
    tag = f"{project['version']}-cuda"
    values = yaml.safe_load((render_manifests.CHART / "values.yaml").read_text())
    cloud = yaml.safe_load((repo / "deploy" / "ray" / "gpu-cluster.yaml").read_text())
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    assert values["image"]["tag"] == tag and cloud["docker"]["image"] == image
    assert f"-t {image} ." in dockerfile
    assert "COPY deploy/ray/wait_for_slots.py" in dockerfile
    for folder in pyproject["tool"]["setuptools"]["package-dir"].values():  # every folder the wheel maps
        assert f"COPY {folder} ./{folder}" in dockerfile, folder
