"""deploy/ray: `ray up` cluster YAMLs checked by Ray's own autoscaler schema and config preparation."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from flotilla.config import ServeConfig
from flotilla.router.settings import IngressConfig

RAY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "ray"
CLUSTERS = {"gpu-cluster.yaml": "flotilla-gpu.yaml", "onprem-cluster.yaml": "flotilla-onprem.yaml"}


RAY_SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def load(name: str) -> dict:
    return yaml.safe_load((RAY_DIR / name).read_text())


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_yaml_validates_against_rays_schema(name: str) -> None:
    config = load(name)
    jsonschema.validate(config, RAY_SCHEMA)  # the file as written
    prepared = prepare_config(copy.deepcopy(config))  # what `ray up` does: defaults merged, local node type
    validate_config(prepared)  # ray-schema.json again, plus Ray's own consistency checks


def test_schema_check_catches_a_typo() -> None:
    config = load("gpu-cluster.yaml") | {"head_start_commands": ["ray start --head"]}
    with pytest.raises(jsonschema.ValidationError, match="head_start_commands"):
        jsonschema.validate(config, RAY_SCHEMA)


def test_cloud_head_has_no_gpus_and_a_gpu_worker_type() -> None:
    config = load("gpu-cluster.yaml")
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["GPU"] == 0
    assert any(t["resources"].get("GPU", 0) > 0 and t["min_workers"] > 0 for t in types.values())
    assert any("--num-gpus=0" in c for c in config["head_start_ray_commands"])


@pytest.mark.parametrize(("name", "serve_config"), CLUSTERS.items())
def test_head_starts_flotilla_with_a_valid_config_once_slots_joined(name: str, serve_config: str) -> None:
    config = load(name)
    start = " ".join(config["head_start_ray_commands"])
    mounted = {Path(local).name: remote for remote, local in config["file_mounts"].items()}
    assert serve_config in mounted, "the Flotilla config is copied to the head"
    assert re.search(rf"flotilla serve --config {re.escape(mounted[serve_config])}", start)
    flotilla = ServeConfig.from_yaml(RAY_DIR / serve_config)
    assert flotilla.cluster.address == "auto" and flotilla.host == "0.0.0.0"
    slots = int(re.search(r"wait_for_slots.py (\d+) ", start).group(1))
    assert slots == flotilla.groups * flotilla.slots_per_group


@pytest.mark.parametrize("name", CLUSTERS)
def test_every_ray_process_gets_the_ingress_environment(name: str) -> None:
    config = load(name)
    text = yaml.safe_dump(
        {k: config.get(k) for k in ("docker", "head_start_ray_commands", "worker_start_ray_commands")}
    )
    for key, value in IngressConfig().ray_env().items():
        assert f"{key}={value}" in text


def test_onprem_setup_installs_flotilla_from_the_synced_repository() -> None:
    config = load("onprem-cluster.yaml")
    assert config["file_mounts"]["~/flotilla-src"] == "."
    assert any('pip install --quiet -e "$HOME/flotilla-src[gpu]"' in c for c in config["setup_commands"])
    assert any(c.endswith("flotilla --help > /dev/null") for c in config["setup_commands"])


DLAMI = re.compile(r"resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-2[24]\.04/")


def test_aws_nodes_name_their_ami() -> None:
    """Without ImageId, Ray launches its built-in default: an old CUDA 11 Deep Learning AMI."""
    config = load("gpu-cluster.yaml")
    for name, node_type in config["available_node_types"].items():
        image = node_type["node_config"].get("ImageId", "")
        assert re.fullmatch(r"ami-[0-9a-f]{8,17}", image) or DLAMI.match(image), (name, image)


def test_cloud_image_is_pinned() -> None:
    image = load("gpu-cluster.yaml")["docker"]["image"]
    repository, _, digest = image.partition("@")
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-cuda", repository), image  # a release tag, never latest
    assert digest == "" or re.fullmatch(r"sha256:[0-9a-f]{64}", digest)


@pytest.mark.parametrize(("name", "serve_config"), CLUSTERS.items())
def test_workers_are_exactly_what_the_groups_need(name: str, serve_config: str) -> None:
    config = load(name)
    flotilla = ServeConfig.from_yaml(RAY_DIR / serve_config)
    types = config["available_node_types"] if "available_node_types" in config else {}
    if types:
        head = types[config["head_node_type"]]["resources"].get("GPU", 0)
        workers = {n: t for n, t in types.items() if n != config["head_node_type"]}
        gpus = {t["resources"]["GPU"] for t in workers.values()}
        (per_node,) = gpus
    else:  # local provider: the head holds accelerators too (flotilla-onprem.yaml's comment: 8 each)
        per_node = head = 8
    needed = (flotilla.groups * flotilla.slots_per_group - head) // per_node
    assert config["max_workers"] == needed
    if types:
        assert sum(t["min_workers"] for t in workers.values()) == needed
        assert sum(t["max_workers"] for t in workers.values()) == needed
    else:
        assert len(config["provider"]["worker_ips"]) == needed


@pytest.mark.parametrize("name", CLUSTERS)
def test_flotilla_serve_is_supervised(name: str) -> None:
    config = load(name)
    start = config["head_start_ray_commands"]
    (serve,) = [c for c in start if "flotilla serve" in c]
    assert re.search(r"(^|; )setsid nohup bash \S*supervise\.sh \S+flotilla-serve\.pid bash -c '", serve), serve
    assert "< /dev/null &" in serve
    # A re-run of `ray up` stops the previous supervisor (and its flotilla serve) first.
    assert any('kill -- -"$(cat' in c and "flotilla-serve.pid" in c for c in start)
    synced = {Path(local).name for local in config["file_mounts"].values()} | (
        {"supervise.sh"} if config["file_mounts"].get("~/flotilla-src") == "." else set()
    )
    assert "supervise.sh" in synced


def test_supervisor_starts_the_command_again_when_it_exits(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import time

    runs, pidfile = tmp_path / "runs", tmp_path / "pid"
    process = subprocess.Popen(
        ["bash", str(RAY_DIR / "supervise.sh"), str(pidfile), "bash", "-c", f"echo run >> {runs}; exit 3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while (not runs.exists() or len(runs.read_text().split()) < 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(runs.read_text().split()) >= 2  # ran, exited 3, ran again after the back-off
        assert int(pidfile.read_text()) == process.pid
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        output = process.communicate(timeout=10)[0]
    assert "exited with status 3; starting again in 5 s" in output


def test_model_download_is_pinned_token_from_a_file_and_writable() -> None:
    config = load("gpu-cluster.yaml")
    text = (RAY_DIR / "gpu-cluster.yaml").read_text()
    assert not re.search(r"\bhf_[A-Za-z0-9]{10,}", text)  # no token in the file
    assert config["file_mounts"]["/home/ray/.cache/huggingface/token"] == "~/.cache/huggingface/token"
    (download,) = [c for c in config["setup_commands"] if "hf download" in c]
    assert '--revision "$MODEL_REVISION"' in download and "^[0-9a-f]{40}$" in download
    model_env = dict(
        line.split("=", 1)
        for line in (RAY_DIR / "model.env").read_text().splitlines()
        if "=" in line and line[0] != "#"
    )
    assert "MODEL_REPO" in model_env and "MODEL_REVISION" in model_env
    assert config["file_mounts"]["/home/ray/model.env"] == "deploy/ray/model.env"
    # Weights live in a host folder the container user (uid 1000) owns, mounted at /models.
    assert "--volume /home/ubuntu/models:/models" in config["docker"]["run_options"]
    assert any("chown 1000:1000 /home/ubuntu/models" in c for c in config["initialization_commands"])
    flotilla = ServeConfig.from_yaml(RAY_DIR / "flotilla-gpu.yaml")
    assert flotilla.model == f"/models/{model_env['MODEL_REPO'].rsplit('/', 1)[1]}"


@pytest.mark.parametrize("serve_config", CLUSTERS.values())
def test_ray_up_configs_use_gpu_recovery_deadlines(serve_config: str) -> None:
    recovery = ServeConfig.from_yaml(RAY_DIR / serve_config).coordinator
    assert recovery.health_timeout_s >= 30 and recovery.hang_timeout_s >= 120
