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
