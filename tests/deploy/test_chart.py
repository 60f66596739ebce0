"""The Helm chart, rendered and linted by Helm's own engine (helm-python-sdk embeds Helm v4's Go SDK).

Every rendered object is checked against Kubernetes' strict schemas and the KubeRay and LWS CRDs
(read from $FLOTILLA_CRDS_DIR, default ../shared/crds: see tests/deploy/k8s_schemas.py).
"""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
import yaml

from flotilla.config import ServeConfig
from flotilla.router.settings import IngressConfig
from scripts.render_manifests import CHART, rendered_objects
from tests.deploy.k8s_schemas import validation_errors

MODES = ("kuberay", "lws")
REVISION = "0e9e39f249a16976918f6564b8830bc894c89659"
MONITORING = {
    "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    "grafana": {"dashboards": {"enabled": True}},
}
# Values a real user might set, to exercise optional branches of the templates.
RICH = MONITORING | {
    "model": {
        "download": {"repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": REVISION},
        "volume": {"emptyDir": {"sizeLimit": "40Gi"}},
    },
    "secrets": {"adminToken": "s3cret", "hfToken": "hf_x"},
    "imagePullSecrets": [{"name": "registry"}],
    "lws": {"exclusiveTopology": "cloud.google.com/gke-nodepool"},
    "worker": {"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    "config": {
        "groups": 3,
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "ingress": {"proxy": "haproxy", "replicas": 2, "drain_period_s": 5},
    },
}


def objects(mode: str, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return rendered_objects({"mode": mode} | (values or {}))


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def only(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = by_kind(objs, kind)
    return found


def serve_config(objs: list[dict[str, Any]]) -> ServeConfig:
    configmap = next(o for o in objs if o["kind"] == "ConfigMap" and "flotilla.yaml" in o["data"])
    return ServeConfig.model_validate(yaml.safe_load(configmap["data"]["flotilla.yaml"]))


def containers(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in template["spec"]["containers"]}


@pytest.mark.parametrize("values", [{}, RICH], ids=["defaults", "rich"])
@pytest.mark.parametrize("mode", MODES)
def test_chart_lints_clean(mode: str, values: dict[str, Any]) -> None:
    report = helm.lint(CHART, {"mode": mode} | values, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["errors"] == [] and problems == []


@pytest.mark.parametrize("values", [{}, RICH], ids=["defaults", "rich"])
@pytest.mark.parametrize("mode", MODES)
def test_every_rendered_object_validates(mode: str, values: dict[str, Any]) -> None:
    objs = objects(mode, values)
    errors = [error for obj in objs for error in validation_errors(obj)]
    assert errors == []
    expected = {"ConfigMap", "Service", "Pod", "RayService" if mode == "kuberay" else "LeaderWorkerSet"}
    assert expected <= {o["kind"] for o in objs}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "k8s"}, "at '/mode': value must be one of 'kuberay', 'lws'"),
        ({"config": {"groups": 0}}, "at '/config/groups': minimum: got 0, want 1"),
        ({"config": {"tensor_parallel_size": "8"}}, "at '/config/tensor_parallel_size': got string, want integer"),
        ({"config": {"tensor_parallel_size": None}}, "at '/config': missing property 'tensor_parallel_size'"),
        ({"config": {"routing": {"policy": "random"}}}, "at '/config/routing/policy': value must be one of"),
        ({"config": {"model": "/elsewhere"}}, "at '/config': additional properties 'model' not allowed"),
        ({"config": {"grups": 2}}, "at '/config': additional properties 'grups' not allowed"),
        ({"config": {"ingress": {"proxy": "nginx"}}}, "at '/config/ingress/proxy': value must be one of"),
        ({"accelerator": {"type": "amd"}}, "at '/accelerator/type': value must be one of 'nvidia', 'cpu'"),
        ({"lws": {"restartPolicy": "None"}}, "at '/lws/restartPolicy': value must be one of"),
        ({"lws": {"startupPolicy": "LeaderReady"}}, "at '/lws/startupPolicy': value must be 'LeaderCreated'"),
        ({"probes": {"startup": {"failureThreshold": 0}}}, "at '/probes/startup/failureThreshold': minimum"),
        ({"image": {"tag": ""}}, "at '/image/tag': minLength: got 0, want 1"),
        ({"model": {"path": "models/x"}}, "at '/model/path'"),
        ({"metrics": {"serviceMonitor": {"interval": "15 seconds"}}}, "at '/metrics/serviceMonitor/interval'"),
        ({"replicas": 3}, "additional properties 'replicas' not allowed"),
        # Escape hatches: Kubernetes shapes, checked before anything renders.
        ({"worker": {"env": {"NCCL_DEBUG": "INFO"}}}, "at '/worker/env': got object, want array"),
        ({"head": {"env": [{"value": "x"}]}}, "at '/head/env/0': missing property 'name'"),
        (
            {"worker": {"securityContext": {"capabilities": {"add": "IPC_LOCK"}}}},
            "at '/worker/securityContext/capabilities/add': got string, want array",
        ),
        ({"head": {"podAnnotations": {"x": 1}}}, "at '/head/podAnnotations/x': got number, want string"),
        (
            {"worker": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}},
            "at '/worker/topologySpreadConstraints/0': missing property 'whenUnsatisfiable'",
        ),
        ({"worker": {"runtimeClassName": "Nvidia Runtime"}}, "at '/worker/runtimeClassName'"),
        (
            {"worker": {"extraVolumeMounts": [{"name": "x", "mountPath": "rel"}]}},
            "at '/worker/extraVolumeMounts/0/mountPath'",
        ),
        ({"worker": {"extraVolumes": [{"emptyDir": {}}]}}, "at '/worker/extraVolumes/0': missing property 'name'"),
        ({"worker": {"hostNetwork": True}}, "at '/worker': additional properties 'hostNetwork' not allowed"),
    ],
)
def test_schema_rejects_bad_values_with_readable_errors(values: dict[str, Any], message: str) -> None:
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert message in str(err.value)
    report = helm.lint(CHART, values, strict=True)  # `helm lint` reports the same error
    assert any(message in m["error"] for m in report["messages"] if m["severity"] == 3)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"config": {"tensor_parallel_size": 3}}, "accelerator.perNode (8) must be a multiple of"),
        (
            {"config": {"tensor_parallel_size": 4, "pipeline_parallel_size": 3}},
            "pipeline_parallel_size × data_parallel_size (12) must fill whole nodes of accelerator.perNode (8)",
        ),
    ],
)
def test_layouts_that_cannot_place_fail_with_the_rule(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message.replace("(", r"\(").replace(")", r"\)")):
        objects("kuberay", values)


@pytest.mark.parametrize(
    ("tp", "pp", "per_node", "groups", "nodes_per_group", "slots_per_pod"),
    [
        (8, 1, 8, 2, 1, 8),
        (8, 2, 8, 3, 2, 8),
        (2, 1, 8, 4, 1, 2),
        (4, 4, 8, 1, 2, 8),
        (1, 2, 1, 2, 2, 1),
    ],
)
def test_pods_are_sized_from_tp_and_pp(
    tp: int, pp: int, per_node: int, groups: int, nodes_per_group: int, slots_per_pod: int
) -> None:
    values = {
        "accelerator": {"type": "nvidia", "perNode": per_node, "resourceName": "nvidia.com/gpu"},
        "config": {"groups": groups, "tensor_parallel_size": tp, "pipeline_parallel_size": pp},
    }
    service = only(objects("kuberay", values), "RayService")["spec"]["rayClusterConfig"]
    (workers,) = service["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == groups * nodes_per_group
    assert workers["rayStartParams"]["num-gpus"] == str(slots_per_pod)
    assert containers(workers["template"])["ray-worker"]["resources"]["limits"]["nvidia.com/gpu"] == slots_per_pod
    head = containers(service["headGroupSpec"]["template"])["ray-head"]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert "--num-gpus=0" in head["args"][0]
    assert f"wait_for_slots.py {tp * pp} " in head["args"][0]  # config.min_ready_groups: 1 (the chart's default)

    lws = only(objects("lws", values), "LeaderWorkerSet")["spec"]
    assert lws["replicas"] == groups
    assert lws["leaderWorkerTemplate"]["size"] == nodes_per_group
    leader = containers(lws["leaderWorkerTemplate"]["leaderTemplate"])["flotilla"]
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == slots_per_pod
    assert f"wait_for_slots.py {tp * pp} " in leader["args"][0]


def test_kuberay_head_serves_once_min_ready_groups_are_up_and_waits_for_their_slots_only() -> None:
    values = {"config": {"groups": 3, "tensor_parallel_size": 8, "pipeline_parallel_size": 2}}
    for min_ready, waited_groups in ((1, 1), (2, 2), (None, 3)):
        objs = objects("kuberay", values | {"config": values["config"] | {"min_ready_groups": min_ready}})
        assert serve_config(objs).groups_to_serve == waited_groups
        service = only(objs, "RayService")["spec"]["rayClusterConfig"]
        head = containers(service["headGroupSpec"]["template"])["ray-head"]
        assert f"wait_for_slots.py {16 * waited_groups} " in head["args"][0]
    # lws: every LWS group is a Ray cluster of one group, which it must have
    assert serve_config(objects("lws", values)).min_ready_groups is None
    with pytest.raises(helm.HelmRenderError, match=r"config.min_ready_groups \(4\) is more than config.groups \(3\)"):
        objects("kuberay", values | {"config": values["config"] | {"min_ready_groups": 4}})


@pytest.mark.parametrize("mode", MODES)
def test_serve_config_is_a_valid_flotilla_config(mode: str) -> None:
    config = serve_config(objects(mode, RICH))
    assert config.cluster.address == "auto" and config.host == "0.0.0.0"
    assert config.model == "/models/model"
    assert (config.tp, config.pp) == (8, 2)
    assert config.groups == (3 if mode == "kuberay" else 1)  # lws: one Flotilla group per LWS group
    assert config.ingress.replicas == 2


@pytest.mark.parametrize("proxy", ["haproxy", "serve"])
@pytest.mark.parametrize("mode", MODES)
def test_ray_processes_get_the_environment_the_ingress_needs(mode: str, proxy: str) -> None:
    objs = objects(mode, {"config": {"ingress": {"proxy": proxy, "drain_period_s": 3.5}}})
    want = IngressConfig(proxy=proxy, drain_period_s=3.5).ray_env()
    templates = [t for o in objs if o["kind"] in ("RayService", "LeaderWorkerSet") for _, t in _templates(o)]
    assert len(templates) == 2
    for template in templates:
        for container in template["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("RAY_SERVE_")}
            assert env.keys() == want.keys()
            assert all(float(env[k]) == float(v) for k, v in want.items())


def _templates(obj: dict[str, Any]):
    from tests.deploy.k8s_schemas import pod_templates

    return pod_templates(obj)


def test_lws_restarts_whole_groups_and_workers_join_the_leader() -> None:
    lws = only(objects("lws"), "LeaderWorkerSet")
    spec = lws["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"
    leader = containers(spec["leaderWorkerTemplate"]["leaderTemplate"])["flotilla"]["args"][0]
    worker = containers(spec["leaderWorkerTemplate"]["workerTemplate"])["ray-worker"]["args"][0]
    assert "ray start --head" in leader and "exec flotilla serve --config /etc/flotilla/flotilla.yaml" in leader
    assert 'ray start --address="${LWS_LEADER_ADDRESS}:6379"' in worker and "--block" in worker


@pytest.mark.parametrize("mode", MODES)
def test_probes_leave_room_for_slow_model_loads(mode: str) -> None:
    objs = objects(mode)
    serving = only(objs, "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    name = "head" if mode == "kuberay" else "leader"
    template = dict(_templates(serving))[name]
    (container,) = template["spec"]["containers"]
    startup = container["startupProbe"]
    config = serve_config(objs)
    wait_s = int(re.search(r"wait_for_slots.py \d+ (\d+) ", container["args"][0]).group(1))
    # The probe outlasts both of Flotilla's own deadlines: workers joining, then the groups' start.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= wait_s + config.startup_timeout_s
    # Liveness reads Ray's GCS through the dashboard, never the ingress (the data path): a slow
    # ingress must not restart the head and with it every group.
    liveness = container["livenessProbe"]["httpGet"]
    assert (liveness["path"], liveness["port"]) == ("/api/gcs_healthz", "dashboard")
    assert "dashboard" in {p["name"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 without a routable group
    tolerations = {t["key"]: t["tolerationSeconds"] for t in template["spec"]["tolerations"]}
    assert tolerations["node.kubernetes.io/unreachable"] == 60


@pytest.mark.parametrize("mode", MODES)
def test_service_selects_the_pods_that_serve_http(mode: str) -> None:
    objs = objects(mode)
    selector = only(objs, "Service")["spec"]["selector"]
    serving = only(objs, "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    labelled = {name: t["metadata"]["labels"] for name, t in _templates(serving)}
    matching = [name for name, labels in labelled.items() if selector.items() <= labels.items()]
    assert matching == ["head" if mode == "kuberay" else "leader"]


def test_secrets_hold_tokens_and_pods_read_them() -> None:
    objs = objects("kuberay", RICH)
    secret = only(objs, "Secret")
    assert set(secret["data"]) == {"admin-token", "hf-token"}
    head = dict(_templates(only(objs, "RayService")))["head"]
    env = {e["name"]: e for e in head["spec"]["containers"][0]["env"]}
    assert env["FLOTILLA_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    init = head["spec"]["initContainers"][0]
    assert "snapshot_download" in init["args"][0] and any(e["name"] == "HF_TOKEN" for e in init["env"])
    assert by_kind(objects("kuberay", {"secrets": {"existingSecret": "mine"}}), "Secret") == []


@pytest.mark.parametrize("mode", MODES)
def test_api_keys_come_from_the_secret_to_the_serving_pod_and_the_test_pod(mode: str) -> None:
    values = {"config": {"serving": {"api_keys_env": "FLOTILLA_API_KEYS"}}, "secrets": {"apiKeys": "k1,k2"}}
    objs = objects(mode, values)
    secret = only(objs, "Secret")
    assert "api-keys" in secret["data"]
    serving = only(objs, "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    head = dict(_templates(serving))["head" if mode == "kuberay" else "leader"]
    for container in (head["spec"]["containers"][0], only(objs, "Pod")["spec"]["containers"][0]):
        env = {e["name"]: e for e in container["env"]}
        ref = env["FLOTILLA_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "api-keys")
    assert serve_config(objs).serving.api_keys_env == "FLOTILLA_API_KEYS"


@pytest.mark.parametrize("mode", MODES)
def test_api_keys_as_a_mounted_file_rotate_without_a_restart(mode: str) -> None:
    path = "/etc/flotilla-secrets/api-keys"
    objs = objects(mode, {"config": {"serving": {"api_keys_file": path}}, "secrets": {"apiKeys": "k1,k2"}})
    secret = only(objs, "Secret")["metadata"]["name"]
    serving = only(objs, "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    head = dict(_templates(serving))["head" if mode == "kuberay" else "leader"]
    volumes = {v["name"]: v for v in head["spec"]["volumes"]}
    # a whole-Secret volume (no subPath), so the kubelet replaces the file when the Secret changes
    assert volumes["api-keys"]["secret"] == {"secretName": secret, "items": [{"key": "api-keys", "path": "api-keys"}]}
    mounts = {m["name"]: m for m in head["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["api-keys"]["mountPath"] == "/etc/flotilla-secrets" and "subPath" not in mounts["api-keys"]
    assert serve_config(objs).serving.api_keys_file == path
    test_env = {e["name"]: e for e in only(objs, "Pod")["spec"]["containers"][0]["env"]}
    assert test_env["FLOTILLA_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "api-keys"}
    plain = objects(mode, {"secrets": {"apiKeys": "k1"}})  # no file configured: nothing mounted
    serving = only(plain, "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    assert all("api-keys" not in {v["name"] for v in t["spec"]["volumes"]} for _, t in _templates(serving))


def test_helm_test_pod_sends_a_chat_completion() -> None:
    pod = only(objects("kuberay"), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    assert "/v1/chat/completions" in script and '"model": "my-model"' in script


@pytest.mark.parametrize("mode", MODES)
def test_monitoring_objects_are_optional_and_complete(mode: str) -> None:
    assert {"ServiceMonitor", "PrometheusRule"} & {o["kind"] for o in objects(mode)} == set()
    objs = objects(mode, MONITORING)
    monitor = only(objs, "ServiceMonitor")
    service = only(objs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert ("metricRelabelings" in monitor["spec"]["endpoints"][0]) == (mode == "lws")
    rules = only(objs, "PrometheusRule")["spec"]["groups"]
    alerts = [r for g in rules for r in g["rules"] if "alert" in r]
    assert alerts and all(r["annotations"]["runbook_url"].endswith(".md") for r in alerts)
    dashboards = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard")]
    assert {next(iter(d["data"])) for d in dashboards} == {
        "flotilla-overview.json",
        "flotilla-router.json",
        "flotilla-groups.json",
        "flotilla-eplb.json",
        "flotilla-gpus.json",
    }


@pytest.mark.parametrize("mode", MODES)
def test_every_ingress_replica_is_scraped_on_its_own_port(mode: str) -> None:
    values = MONITORING | {"config": {"ingress": {"replicas": 3, "metrics_port": 9600}}}
    objs = objects(mode, values)
    endpoints = only(objs, "ServiceMonitor")["spec"]["endpoints"]
    service_ports = {p["name"]: p for p in only(objs, "Service")["spec"]["ports"]}
    templates = [t for o in objs if o["kind"] in ("RayService", "LeaderWorkerSet") for _, t in _templates(o)]
    serving = next(
        t for t in templates if "serve" in {p["name"] for c in containers(t).values() for p in c.get("ports", [])}
    )
    container_ports = {p["name"]: p["containerPort"] for c in containers(serving).values() for p in c.get("ports", [])}
    # The serving port (through HAProxy: one replica per scrape) only for what every replica reports alike
    assert endpoints[0]["port"] == "http" and endpoints[0]["params"] == {"scope": ["cluster"]}
    replica_endpoints = endpoints[1:]
    assert [e["port"] for e in replica_endpoints] == ["rep-metrics-0", "rep-metrics-1", "rep-metrics-2"]
    for rank, endpoint in enumerate(replica_endpoints):
        port = service_ports[endpoint["port"]]
        assert port["port"] == 9600 + rank and container_ports[port["targetPort"]] == 9600 + rank
        assert ("metricRelabelings" in endpoint) == (mode == "lws")  # lws groups are renamed on every endpoint
    assert serve_config(objs).ingress.metrics_port == 9600
    # off: the serving port's /metrics has everything (one replica)
    off = objects(mode, MONITORING | {"config": {"ingress": {"replicas": 1, "metrics_port": None}}})
    (endpoint,) = only(off, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == "http" and "params" not in endpoint


def test_runbook_base_url_is_configurable() -> None:
    base = "https://wiki.example.com/flotilla"
    values = MONITORING | {"metrics": {"prometheusRule": {"enabled": True, "runbookBaseUrl": base}}}
    rules = only(objects("kuberay", values), "PrometheusRule")["spec"]["groups"]
    urls = [r["annotations"]["runbook_url"] for g in rules for r in g["rules"] if "alert" in r]
    assert urls and all(url.startswith(base + "/") for url in urls)


def test_notes_render_in_both_modes() -> None:
    from scripts.render_manifests import render_chart

    for mode in MODES:
        notes = next(text for path, text in render_chart({"mode": mode}).items() if path.endswith("NOTES.txt"))
        assert "helm test flotilla" in notes and "port-forward svc/flotilla" in notes


@pytest.mark.parametrize("mode", MODES)
def test_cpu_mode_declares_slots_without_requesting_gpus(mode: str) -> None:
    values = {
        "image": {"tag": "0.1.0-cpu"},
        "accelerator": {"type": "cpu", "perNode": 2},
        "config": {"groups": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 1},
    }
    objs = objects(mode, values)
    assert [e for o in objs for e in validation_errors(o)] == []
    serving = only(objs, "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    for name, template in _templates(serving):
        for container in template["spec"]["containers"]:
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {}), name
    if mode == "kuberay":
        (workers,) = serving["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        assert workers["rayStartParams"]["num-gpus"] == "2"  # Flotilla's CPU plugin places workers on these
    else:
        leader = containers(serving["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["flotilla"]
        assert "--num-gpus=2" in leader["args"][0]


WIDE_EP_EXAMPLE = CHART.parent / "examples" / "deepseek-v3-wide-ep.yaml"


@pytest.mark.parametrize("mode", MODES)
def test_the_wide_ep_example_renders_one_ep_group_over_two_8_gpu_pods(mode: str) -> None:
    """deploy/helm/examples/deepseek-v3-wide-ep.yaml: DP = 16 × TP = 1 = 16 GPUs per group, two pods."""
    values = yaml.safe_load(WIDE_EP_EXAMPLE.read_text()) | {"mode": mode}
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    objs = objects(mode, values)
    assert [error for obj in objs for error in validation_errors(obj)] == []
    config = serve_config(objs)
    assert (config.data_parallel_size, config.tensor_parallel_size, config.slots_per_group) == (16, 1, 16)
    if mode == "lws":
        lws = only(objs, "LeaderWorkerSet")["spec"]
        assert lws["leaderWorkerTemplate"]["size"] == 2
        assert lws["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
        leader = containers(lws["leaderWorkerTemplate"]["leaderTemplate"])["flotilla"]
        assert leader["resources"]["limits"]["nvidia.com/gpu"] == 8 and "wait_for_slots.py 16 " in leader["args"][0]
    else:
        cluster = only(objs, "RayService")["spec"]["rayClusterConfig"]
        (workers,) = cluster["workerGroupSpecs"]
        assert workers["replicas"] == 2 and workers["rayStartParams"]["num-gpus"] == "8"
        assert "wait_for_slots.py 16 " in containers(cluster["headGroupSpec"]["template"])["ray-head"]["args"][0]


def _config_checksums(mode: str, values: dict[str, Any]) -> dict[str, str]:
    """checksum/config of every pod template that mounts the serve config ConfigMap."""
    serving = only(objects(mode, values), "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    sums = {}
    for name, template in _templates(serving):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert "configMap" in volumes["config"], name  # every pod mounts flotilla.yaml
        sums[name] = template["metadata"].get("annotations", {}).get("checksum/config")
    return sums


@pytest.mark.parametrize("mode", MODES)
def test_config_changes_roll_every_pod_that_mounts_it(mode: str) -> None:
    """`helm upgrade` with a changed `config.*` changes every pod template (else nothing restarts)."""
    before = _config_checksums(mode, {})
    after = _config_checksums(mode, {"config": {"routing": {"policy": "least_loaded"}}})
    again = _config_checksums(mode, {})
    assert len(before) == 2 and all(before.values()), before
    assert before == again  # deterministic: an unchanged config rolls nothing
    assert all(before[name] != after[name] for name in before), (before, after)
    engine = _config_checksums(mode, {"config": {"engine_args": {"max_model_len": 8192}}})
    assert all(before[name] != engine[name] for name in before)
    if mode == "lws":  # groups are LWS replicas there, not part of flotilla.yaml: scaling rolls nothing
        assert _config_checksums(mode, {"config": {"groups": 5}}) == before


def test_kuberay_upgrade_strategy_is_optional_and_checked() -> None:
    assert "upgradeStrategy" not in only(objects("kuberay"), "RayService")["spec"]  # KubeRay's default
    objs = objects("kuberay", {"kuberay": {"upgradeStrategy": "None"}})
    assert only(objs, "RayService")["spec"]["upgradeStrategy"] == {"type": "None"}
    assert [e for o in objs for e in validation_errors(o)] == []
    with pytest.raises(helm.HelmValuesError, match="upgradeStrategy"):
        helm.Chart.load(CHART).validate_schema({"kuberay": {"upgradeStrategy": "Incremental"}})


# Every escape hatch at once, as an RDMA/InfiniBand GPU cluster would set them.
HATCHES: dict[str, Any] = {
    "head": {
        "env": [{"name": "RAY_LOG_TO_STDERR", "value": "1"}],
        "priorityClassName": "flotilla-head",
        "podAnnotations": {"example.com/owner": "sre"},
        "podLabels": {"team": "inference"},
        "serviceAccountName": "flotilla",
    },
    "worker": {
        "env": [
            {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
            {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
            {"name": "NCCL_IB_HCA", "value": "mlx5"},
            {"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "envFrom": [{"configMapRef": {"name": "nccl-tuning"}}],
        "resources": {"limits": {"rdma/ib": 1}, "requests": {"cpu": "32", "memory": "256Gi"}},
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
        "podSecurityContext": {"fsGroup": 1000},
        "runtimeClassName": "nvidia",
        "priorityClassName": "gpu-serving",
        "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
        "podLabels": {"team": "inference", "app.kubernetes.io/component": "hijack"},
        "extraVolumes": [{"name": "ib", "hostPath": {"path": "/dev/infiniband"}}],
        "extraVolumeMounts": [{"name": "ib", "mountPath": "/dev/infiniband"}],
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "nodeSelector": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}


COMPONENTS = {"head": "head", "worker group accelerators": "worker", "leader": "leader", "worker": "worker"}


@pytest.mark.parametrize("mode", MODES)
def test_escape_hatches_reach_every_pod_template_and_validate(mode: str) -> None:
    objs = objects(mode, HATCHES)
    assert [e for o in objs for e in validation_errors(o)] == []  # KubeRay/LWS CRDs + strict PodTemplate
    report = helm.lint(CHART, {"mode": mode} | HATCHES, strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    serving = only(objs, "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    templates = dict(_templates(serving))
    roles = (
        {"head": "head", "worker group accelerators": "worker"}
        if mode == "kuberay"
        else {
            "leader": "worker",
            "worker": "worker",
        }
    )
    assert set(templates) == set(roles)
    for name, role in roles.items():
        hatch, template = HATCHES[role], templates[name]
        spec, meta = template["spec"], template["metadata"]
        (container,) = spec["containers"]
        env = [e["name"] for e in container["env"]]
        wanted = [e["name"] for e in hatch["env"]]
        assert env[-len(wanted) :] == wanted, name  # after the chart's own
        assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" in env and "HF_TOKEN" in env, name  # chart's still there
        assert spec["priorityClassName"] == hatch["priorityClassName"], name
        assert (
            hatch["podAnnotations"].items() <= meta["annotations"].items() and "checksum/config" in meta["annotations"]
        )
        assert meta["labels"]["team"] == "inference"
        assert meta["labels"]["app.kubernetes.io/component"] == COMPONENTS[name]  # not the podLabel
        if role == "worker":
            assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
            assert container["resources"]["limits"]["rdma/ib"] == 1
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 8  # the chart's own limit kept
            assert container["envFrom"] == hatch["envFrom"]
            assert spec["runtimeClassName"] == "nvidia" and spec["securityContext"] == {"fsGroup": 1000}
            assert {"name": "ib", "hostPath": {"path": "/dev/infiniband"}} in spec["volumes"]
            assert {"name": "ib", "mountPath": "/dev/infiniband"} in container["volumeMounts"]
            assert {v["name"] for v in spec["volumes"]} >= {"config", "model", "dshm"}
            (spread,) = spec["topologySpreadConstraints"]
            assert spread["labelSelector"]["matchLabels"] == {
                "app.kubernetes.io/name": "flotilla",
                "app.kubernetes.io/instance": "flotilla",
                "app.kubernetes.io/component": meta["labels"]["app.kubernetes.io/component"],
            }
            assert spec["nodeSelector"] == hatch["nodeSelector"]
            assert hatch["tolerations"][0] in spec["tolerations"]
            assert any(t["key"] == "node.kubernetes.io/unreachable" for t in spec["tolerations"])
        else:
            assert spec["serviceAccountName"] == "flotilla"
            assert "runtimeClassName" not in spec and "securityContext" not in container
    # The Service still selects exactly the serving pods (a podLabel cannot steal the component).
    selector = only(objs, "Service")["spec"]["selector"]
    assert [n for n, t in templates.items() if selector.items() <= t["metadata"]["labels"].items()] == [
        "head" if mode == "kuberay" else "leader"
    ]


@pytest.mark.parametrize("mode", MODES)
def test_a_bad_hatch_fails_helm_template(mode: str) -> None:
    """Helm's own render (`helm template`/`install`) checks values.schema.json before anything renders."""
    chart = helm.Chart.load(CHART)
    for bad, where in [
        ({"worker": {"env": {"NCCL_DEBUG": "INFO"}}}, "/worker/env"),
        ({"worker": {"securityContext": {"capabilities": {"add": "IPC_LOCK"}}}}, "/worker/securityContext"),
        ({"head": {"priorityClassName": 7}}, "/head/priorityClassName"),
    ]:
        with pytest.raises(helm.HelmValuesError, match=where):
            chart.render({"mode": mode} | bad, name="flotilla", namespace="default", is_install=True)


@pytest.mark.parametrize("mode", MODES)
def test_startup_budget_below_flotillas_own_deadlines_is_refused(mode: str) -> None:
    values = {"config": {"startup_timeout_s": 3600}, "probes": {"startup": {"failureThreshold": 360}}}
    with pytest.raises(helm.HelmRenderError, match=r"probes.startup allows 3600 s .* may need 4560 s"):
        objects(mode, values)
    values["probes"]["startup"]["failureThreshold"] = 456
    objects(mode, values)  # exactly enough renders


@pytest.mark.parametrize("mode", MODES)
def test_accelerator_pods_have_explicit_raylet_probes(mode: str) -> None:
    """KubeRay injects wget-based probes (and a Serve proxy check on RayService workers) into any
    worker container without its own; Flotilla's proxy runs on the head only, so they would stay
    NotReady. Workers get explicit probes of their raylet instead."""
    serving = only(objects(mode), "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    name = "worker group accelerators" if mode == "kuberay" else "worker"
    (container,) = dict(_templates(serving))[name]["spec"]["containers"]
    probes = ("readinessProbe", "livenessProbe", "startupProbe") if mode == "kuberay" else ("readinessProbe",)
    for probe in probes:
        assert container[probe]["httpGet"] == {"path": "/api/local_raylet_healthz", "port": 52365}, probe
        assert "exec" not in container[probe]
    if mode == "lws":  # a liveness kill while waiting for the leader would recreate the whole group
        assert "livenessProbe" not in container and "--block" in container["args"][0]


def test_kuberay_head_takes_no_ray_cpus() -> None:
    cluster = only(objects("kuberay"), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    head = containers(cluster["headGroupSpec"]["template"])["ray-head"]
    assert "--num-cpus=0" in head["args"][0]  # our own `ray start`: KubeRay does not rewrite it
    lws = only(objects("lws"), "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    assert "--num-cpus" not in containers(lws["leaderTemplate"])["flotilla"]["args"][0]  # leaders hold ranks


def test_gcs_fault_tolerance_is_optional_and_uses_a_secret() -> None:
    assert "gcsFaultToleranceOptions" not in only(objects("kuberay"), "RayService")["spec"]["rayClusterConfig"]
    values = {
        "kuberay": {
            "gcsFaultTolerance": {
                "enabled": True,
                "redisAddress": "redis.flotilla.svc:6379",
                "redisPassword": {"name": "redis", "key": "password"},
                "externalStorageNamespace": "flotilla-prod",
            }
        }
    }
    objs = objects("kuberay", values)
    assert [e for o in objs for e in validation_errors(o)] == []  # the field is in the RayCluster CRD
    cluster = only(objs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.flotilla.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}},
        "externalStorageNamespace": "flotilla-prod",
    }
    head = containers(cluster["headGroupSpec"]["template"])["ray-head"]["args"][0]
    assert '--redis-password="${REDIS_PASSWORD}"' in head
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmValuesError, match="redisPassword"):
        chart.validate_schema({"kuberay": {"gcsFaultTolerance": {"redisPassword": "hunter2"}}})
    with pytest.raises(helm.HelmRenderError, match="redisAddress is required"):
        objects("kuberay", {"kuberay": {"gcsFaultTolerance": {"enabled": True}}})


@pytest.mark.parametrize("mode", MODES)
def test_disruption_budget_covers_the_accelerator_pods(mode: str) -> None:
    objs = objects(mode)
    assert [e for o in objs for e in validation_errors(o)] == []
    (pdb,) = by_kind(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    selector = pdb["spec"]["selector"]
    serving = only(objs, "RayService" if mode == "kuberay" else "LeaderWorkerSet")

    def selected(labels: dict[str, str]) -> bool:
        ok = selector["matchLabels"].items() <= labels.items()
        return ok and all(labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"])

    covered = sorted(name for name, t in _templates(serving) if selected(t["metadata"]["labels"]))
    assert covered == (["worker group accelerators"] if mode == "kuberay" else ["leader", "worker"])
    assert by_kind(objects(mode, {"pdb": {"enabled": False}}), "PodDisruptionBudget") == []
    if mode == "kuberay":
        budgets = by_kind(objects(mode, {"pdb": {"protectHead": True}}), "PodDisruptionBudget")
        head = next(b for b in budgets if b["metadata"]["name"].endswith("-head"))
        assert head["spec"]["minAvailable"] == 1
        assert head["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "head"


@pytest.mark.parametrize("mode", MODES)
def test_chart_defaults_use_production_recovery_deadlines(mode: str) -> None:
    """Flotilla's built-in 3 s / 4 s deadlines fit tiny CPU models; a big GPU group would be
    gang-restarted on a short stall."""
    recovery = serve_config(objects(mode)).coordinator
    assert recovery.health_timeout_s >= 30 and recovery.hang_timeout_s >= 120
    assert recovery.health_period_s < recovery.health_timeout_s


HOST_CACHE = {"hostPath": {"path": "/var/lib/flotilla/models", "type": "DirectoryOrCreate"}}


@pytest.mark.parametrize("mode", MODES)
def test_downloads_are_pinned_resumable_and_once_per_node(mode: str) -> None:
    values = {"model": {"download": {"repo": "org/model", "revision": REVISION}, "volume": HOST_CACHE}}
    objs = objects(mode, values)
    assert [e for o in objs for e in validation_errors(o)] == []
    serving = only(objs, "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    for name, template in _templates(serving):
        (init,) = template["spec"]["initContainers"]
        script = init["args"][0]
        assert f'"org/model", "{REVISION}"' in script and "revision=revision" in script, name
        assert "fcntl.flock" in script and ".flotilla-downloaded-" in script, name  # once per node and revision
        assert script.index("snapshot_download(repo") < script.index("done.touch()"), name  # marker last
        token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")["valueFrom"]["secretKeyRef"]
        assert token["key"] == "hf-token"
        model = next(v for v in template["spec"]["volumes"] if v["name"] == "model")
        assert model["hostPath"] == HOST_CACHE["hostPath"]
    compile(script, "download-model", "exec")  # the init script is valid Python


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"download": {"repo": "org/model"}}, "model.download.revision must be the 40-character commit"),
        (
            {"download": {"repo": "org/model", "revision": REVISION}, "volume": {"emptyDir": {}}},
            "model.volume.emptyDir needs a sizeLimit",
        ),
    ],
)
def test_unpinned_or_unbounded_downloads_are_refused(model: dict[str, Any], message: str) -> None:
    for mode in MODES:
        with pytest.raises(helm.HelmRenderError, match=message):
            objects(mode, {"model": model})


def test_a_branch_is_not_a_revision() -> None:
    with pytest.raises(helm.HelmValuesError, match="/model/download/revision"):
        helm.Chart.load(CHART).validate_schema({"model": {"download": {"repo": "org/model", "revision": "main"}}})


@pytest.mark.parametrize("mode", MODES)
def test_the_default_claim_is_mounted_read_only_everywhere(mode: str) -> None:
    """Pods on several nodes mount it: read-only (a ReadOnlyMany or ReadWriteMany claim), never written."""
    serving = only(objects(mode), "RayService" if mode == "kuberay" else "LeaderWorkerSet")
    for name, template in _templates(serving):
        model = next(v for v in template["spec"]["volumes"] if v["name"] == "model")
        assert model["persistentVolumeClaim"] == {"claimName": "flotilla-models", "readOnly": True}, name
        assert "initContainers" not in template["spec"]


RAY_PORTS = {6379, 8265, 10001, 8076, 8077, 52365}  # GCS, dashboard, client, object and node managers, agent


@pytest.mark.parametrize("mode", MODES)
def test_network_policy_admits_ray_only_from_the_release(mode: str) -> None:
    objs = objects(mode, MONITORING)
    policy = only(objs, "NetworkPolicy")["spec"]
    release = only(objs, "Service")["spec"]["selector"]
    release = {k: v for k, v in release.items() if k != "app.kubernetes.io/component"}
    assert policy["podSelector"]["matchLabels"] == release and policy["policyTypes"] == ["Ingress"]
    # every pod of the release carries the labels the policy selects, so all of them are covered
    for template in (t for o in objs if o["kind"] in ("RayService", "LeaderWorkerSet") for _, t in _templates(o)):
        assert release.items() <= template["metadata"]["labels"].items()
    named = {
        p["name"]: p["containerPort"]
        for t in _serving_templates(objs)
        for c in containers(t).values()
        for p in c["ports"]
    }

    def port_number(port: int | str) -> int:
        return port if isinstance(port, int) else named[port]

    for rule in policy["ingress"]:
        peers = rule.get("from")
        if peers == [{"podSelector": {"matchLabels": release}}]:
            assert "ports" not in rule  # the release's own pods: every port (Ray's are dynamic)
            continue
        assert "ports" in rule, rule  # no other rule opens every port
        opened = {port_number(p["port"]) for p in rule["ports"]}
        if peers is None:  # open to every source: only the OpenAI port
            assert opened == {8000}
        elif opened & RAY_PORTS:  # the dashboard: only for the KubeRay operator
            assert mode == "kuberay" and peers == [
                {
                    "namespaceSelector": {},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
                }
            ]
    monitoring = next(r for r in policy["ingress"] if {"port": "metrics", "protocol": "TCP"} in r.get("ports", []))
    assert {"port": "rep-metrics-0", "protocol": "TCP"} in monitoring["ports"]

    restricted = objects(mode, {"networkPolicy": {"servingFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}})
    serving = next(
        r
        for r in only(restricted, "NetworkPolicy")["spec"]["ingress"]
        if r.get("ports") == [{"port": "serve", "protocol": "TCP"}]
    )
    assert serving["from"] == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    assert "NetworkPolicy" not in {o["kind"] for o in objects(mode, {"networkPolicy": {"enabled": False}})}
    with pytest.raises(helm.HelmValuesError, match="servingFrom"):
        objects(mode, {"networkPolicy": {"servingFrom": [{"cidr": "10.0.0.0/8"}]}})  # an ipBlock without its key


def _serving_templates(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    templates = [t for o in objs if o["kind"] in ("RayService", "LeaderWorkerSet") for _, t in _templates(o)]
    return [t for t in templates if "serve" in {p["name"] for c in containers(t).values() for p in c.get("ports", [])}]
