from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flotilla.cluster.config import ConfigError
from flotilla.config import ServeConfig
from flotilla.launcher import validate

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_example_config_is_two_groups_of_tp1_on_localhost() -> None:
    config = ServeConfig.from_yaml(REPO / "examples/local-cpu.yaml")
    assert (config.groups, config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 1, 1)
    assert (config.host, config.port) == ("127.0.0.1", 8000)


def test_unknown_keys_are_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="tensor_paralel_size"):
        ServeConfig.from_yaml(write(tmp_path, "model: m\ntensor_paralel_size: 2\n"))


def test_reserved_engine_args_are_rejected(tmp_path) -> None:
    with pytest.raises(ConfigError, match="engine_args may not set"):
        ServeConfig.from_yaml(write(tmp_path, "model: m\nengine_args: {tensor_parallel_size: 2}\n"))


def test_overrides_win(tmp_path) -> None:
    config = ServeConfig.from_yaml(write(tmp_path, "model: m\nport: 8000\n"), {"port": 9001})
    assert config.port == 9001


def test_a_nested_override_keeps_the_sections_other_keys(tmp_path) -> None:
    config = ServeConfig.from_yaml(
        write(tmp_path, "model: m\ningress: {replicas: 3, metrics_port: 9500}\n"), {"ingress": {"metrics_port": 9600}}
    )
    assert (config.ingress.replicas, config.ingress.metrics_port) == (3, 9600)


def test_two_ingress_replicas_by_default_each_scraped_on_its_own_port(tmp_path) -> None:
    """One scrape of the serving port reaches one replica: with several, each gets a metrics port of its own."""
    config = ServeConfig.from_yaml(REPO / "examples/local-cpu.yaml")
    assert config.ingress.replicas == 2
    assert config.replica_metrics_port == config.port + 1
    chosen = ServeConfig.from_yaml(write(tmp_path, "model: m\nport: 8000\ningress: {metrics_port: 9500}\n"))
    assert chosen.replica_metrics_port == 9500
    single = ServeConfig.from_yaml(write(tmp_path, "model: m\ningress: {replicas: 1}\n"))
    assert single.replica_metrics_port is None  # its /metrics on the serving port has everything


@pytest.mark.parametrize(
    ("fields", "rule"),
    [
        ("tensor_parallel_size: 3", "heads-divisible-by-tp"),
        ("tensor_parallel_size: 8", "heads-divisible-by-tp"),
        ("pipeline_parallel_size: 5", "layers-vs-pp"),
        (
            "groups: 3\ntensor_parallel_size: 2\ncluster: {local: {slots_per_node: 2, nodes: 2}}",
            "slots-available",
        ),
    ],
)
def test_invalid_layouts_name_their_rule(tmp_path, tiny_llama, fields: str, rule: str) -> None:
    config = ServeConfig.from_yaml(write(tmp_path, f"model: {tiny_llama}\n{fields}\n"))
    with pytest.raises(ConfigError, match=rule):
        validate(config)


@pytest.mark.parametrize(
    ("model", "fields", "rule"),
    [
        ("tiny_llama", "data_parallel_size: 2", "ep-needs-moe"),
        ("tiny_mixtral", "data_parallel_size: 3", "experts-divisible-by-ep"),  # 8 experts over 3 ranks
        ("tiny_mixtral", "data_parallel_size: 2\npipeline_parallel_size: 2", "wide-ep-pp"),
        ("tiny_mixtral", "data_parallel_size: 2\nexecutor: ray", "wide-ep-executor"),
        ("tiny_mixtral", "data_parallel_size: 2\ncluster: {local: {slots_per_node: 1}}", "slots-available"),
    ],
)
def test_invalid_wide_ep_layouts_name_their_rule(tmp_path, request, model: str, fields: str, rule: str) -> None:
    path = request.getfixturevalue(model)
    with pytest.raises(ConfigError, match=rule):
        validate(ServeConfig.from_yaml(write(tmp_path, f"model: {path}\n{fields}\n")))


def test_the_wide_ep_example_is_one_group_of_two_dp_ranks_on_two_nodes(tiny_mixtral) -> None:
    example = ServeConfig.from_yaml(REPO / "examples/wide-ep-cpu.yaml", {"model": str(tiny_mixtral)})
    config, _, _ = validate(example)
    assert (config.groups, config.data_parallel_size, config.tp, config.cluster.local.nodes) == (1, 2, 1, 2)
    assert config.slots_per_group == 2 and config.layout_text == "1 group(s) × DP=2 (wide EP) × TP=1 × PP=1"


def test_unknown_engine_args_are_rejected_before_start(tmp_path, tiny_llama) -> None:
    config = ServeConfig.from_yaml(write(tmp_path, f"model: {tiny_llama}\nengine_args: {{max_modle_len: 9}}\n"))
    with pytest.raises(ConfigError, match="max_modle_len"):
        validate(config)


def test_missing_model_is_a_config_error(tmp_path) -> None:
    config = ServeConfig.from_yaml(write(tmp_path, f"model: {tmp_path / 'nope'}\n"))
    with pytest.raises(ConfigError, match="make-model"):
        validate(config)


def test_omitted_tp_and_pp_are_chosen_by_the_planner(tmp_path, tiny_llama) -> None:
    fields = "groups: 2\ntensor_parallel_size: null\npipeline_parallel_size: null"
    config, _, notes = validate(ServeConfig.from_yaml(write(tmp_path, f"model: {tiny_llama}\n{fields}\n")))
    assert (config.tp, config.pp) == (1, 1)  # fits one slot: plain DP replicas
    assert notes[0] == "planner chose TP=1 PP=1:"


def test_latency_sensitive_planning_uses_tp_inside_the_node(tmp_path) -> None:
    model = tmp_path / "llama-3-70b"
    model.mkdir()
    shutil.copy(REPO / "tests" / "unit" / "cluster" / "model_configs" / "llama-3-70b.json", model / "config.json")
    fields = (
        "tensor_parallel_size: null\npipeline_parallel_size: null\n"
        "plan: {accelerators_per_node: 8, memory_gib: 80, latency_sensitive: true, concurrency: 8}"
    )
    config, _, notes = validate(ServeConfig.from_yaml(write(tmp_path, f"model: {model}\n{fields}\n")))
    assert (config.tp, config.pp) == (8, 1)
    assert any("TP=8 over nvlink" in note for note in notes)


def test_a_fixed_tp_constrains_the_planner(tmp_path, tiny_llama) -> None:
    fields = "tensor_parallel_size: 2\npipeline_parallel_size: null\nplan: {accelerators_per_node: 2, memory_gib: 4}"
    config, _, _ = validate(ServeConfig.from_yaml(write(tmp_path, f"model: {tiny_llama}\n{fields}\n")))
    assert (config.tp, config.pp) == (2, 1)


def test_planning_needs_hardware_facts_for_an_existing_cluster(tmp_path, tiny_llama) -> None:
    fields = "tensor_parallel_size: null\ncluster: {address: auto}"
    with pytest.raises(ConfigError, match="plan.nodes"):
        validate(ServeConfig.from_yaml(write(tmp_path, f"model: {tiny_llama}\n{fields}\n")))


@pytest.mark.parametrize(
    ("serving", "message"),
    [
        ("{enable_auto_tool_choice: true}", "requires --tool-call-parser"),
        ("{tool_call_parser: no_such_parser}", "no_such_parser"),
        ("{reasoning_parser: no_such_parser}", "no_such_parser"),
        ("{tool_call_parser: mistral}", "mistral"),  # needs [TOOL_CALLS], which tiny-llama does not have
        ("{extra_args: {sse_keep_alive_intervall: 5}}", "sse_keep_alive_intervall"),
        ("{extra_args: {api_key: secret}}", "api_key"),  # keys come from api_keys_env
        ("{api_keys_env: FLOTILLA_TEST_UNSET_KEYS}", "holds no API key"),
    ],
)
def test_serving_flags_are_checked_by_vllms_rules_before_start(tmp_path, tiny_llama, serving: str, message) -> None:
    config = ServeConfig.from_yaml(write(tmp_path, f"model: {tiny_llama}\nserving: {serving}\n"))
    with pytest.raises(ConfigError, match=message):
        validate(config)


def test_a_tool_parser_that_fits_the_tokenizer_is_accepted(tmp_path, tiny_llama) -> None:
    serving = "{enable_auto_tool_choice: true, tool_call_parser: llama3_json, extra_args: {sse_keep_alive_interval: 5}}"
    config = ServeConfig.from_yaml(write(tmp_path, f"model: {tiny_llama}\nserving: {serving}\n"))
    validated, _, _ = validate(config)
    assert validated.serving.tool_call_parser == "llama3_json"


@pytest.mark.parametrize(
    ("fields", "executor"),
    [
        ("tensor_parallel_size: 2", "mp"),  # ranks share a node: vLLM's own executor
        ("pipeline_parallel_size: 2", "ray"),  # stages may span nodes
        ("executor: ray", "ray"),
        ("executor: mp\npipeline_parallel_size: 2", "mp"),
    ],
)
def test_executor_auto_takes_mp_where_a_group_is_on_one_node(tmp_path, fields: str, executor: str) -> None:
    from flotilla.launcher import executor_for

    assert executor_for(ServeConfig.from_yaml(write(tmp_path, f"model: m\n{fields}\n"))) == executor
