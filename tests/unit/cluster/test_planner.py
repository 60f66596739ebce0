"""The planner against the seed documents' arithmetic and worked examples (numbers in the names)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.cluster.model_spec import ModelSpec
from flotilla.cluster.planner import (
    KIB,
    ClusterSpec,
    Layout,
    LinkKind,
    Workload,
    communication_per_token,
    kv_capacity_tokens,
    plan,
    pp_bubble,
    suggested_redundant_experts,
)

CONFIGS = Path(__file__).parent / "model_configs"
REPO = Path(__file__).resolve().parents[3]
H100 = dict(accelerators_per_node=8, memory_gib=80)
RULES = {
    "heads-divisible-by-tp",
    "kv-heads-vs-tp",
    "intermediate-divisible-by-tp",
    "layers-vs-pp",
    "experts-divisible-by-ep",
    "ep-needs-moe",
    "tp-within-node",
    "group-fits-nodes",
    "ep-across-nodes-needs-rdma",
    "weights-fit-memory",
    "kv-fits-context",
}


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_path(CONFIGS / f"{name}.json")


def rejection(result, layout: Layout):
    return next(r for r in result.rejected if r.layout == layout)


# --- arithmetic ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "billions"),
    [
        ("llama-3-70b", 70.55),
        ("llama-3.1-405b", 405.85),
        ("mixtral-8x7b", 46.70),
        ("deepseek-v3", 671.03),
        ("qwen2-7b", 7.62),
    ],
)
def test_parameter_counts_match_the_published_sizes(model: str, billions: float) -> None:
    assert spec(model).total_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_llama70b_tp8_sends_160_all_reduces_of_16KiB_2560KiB_per_token() -> None:
    comm = communication_per_token(spec("llama-3-70b"), Layout(8, 1, 1), ClusterSpec(1, **H100))
    assert comm.tp_bytes == 160 * 16 * KIB == 2560 * KIB


def test_llama70b_pp4_sends_3x16KiB_per_token_where_tp4_sends_2560KiB() -> None:
    llama, cluster = spec("llama-3-70b"), ClusterSpec(1, **H100)
    assert communication_per_token(llama, Layout(1, 4, 2), cluster).pp_bytes == 3 * 16 * KIB
    assert communication_per_token(llama, Layout(4, 1, 2), cluster).tp_bytes == 2560 * KIB


def test_mixtral_all_to_all_is_top2_x_4096_x_2B_16KiB_per_token_twice_per_moe_layer() -> None:
    comm = communication_per_token(spec("mixtral-8x7b"), Layout(1, 1, 4, ep=4), ClusterSpec(1, 4, 80))
    assert comm.ep_bytes == 2 * 32 * 16 * KIB


def test_pp4_with_4_micro_batches_idles_3_of_7_steps_42_86_percent() -> None:
    assert pp_bubble(4, 4) == pytest.approx(0.4286, abs=1e-4)


def test_pp4_needs_58_micro_batches_to_idle_under_5_percent() -> None:
    assert pp_bubble(4, 57) >= 0.05 > pp_bubble(4, 58)


def test_llama3_embedding_128256_x_8192_in_bf16_is_about_2GB() -> None:
    assert spec("llama-3-70b").embedding_params() * 2 == 2_101_346_304


def test_llama70b_kv_is_320KiB_per_token_and_40KiB_per_rank_at_tp8() -> None:
    llama = spec("llama-3-70b")
    assert llama.kv_bytes_per_token(80, tp=1) == 80 * 8 * 128 * 2 * 2 == 320 * KIB
    assert llama.kv_bytes_per_token(80, tp=8) == 40 * KIB
    assert llama.kv_bytes_per_token(80, tp=16) == 40 * KIB  # 8 KV heads: replicated beyond TP=8


def test_deepseek_v3_mla_caches_61_layers_x_576_x_2B_68_6KiB_per_token_whatever_the_tp() -> None:
    deepseek = spec("deepseek-v3")
    assert deepseek.kv_bytes_per_token(61, tp=1) == deepseek.kv_bytes_per_token(61, tp=8) == 61 * 576 * 2


def test_deepseek_v3_256_experts_on_ep32_get_32_redundant_288_physical() -> None:
    assert 256 + suggested_redundant_experts(256, 32) == 288


def test_kv_capacity_of_tiny_llama_in_512MiB_is_131072_tokens_as_vllm_reports(models_dir) -> None:
    tiny = ModelSpec.from_path(models_dir / "tiny-llama")
    assert kv_capacity_tokens(tiny, tp=1, pp=1, kv_bytes_per_rank=512 << 20, block_size=128) == 131_072
    assert kv_capacity_tokens(tiny, tp=2, pp=1, kv_bytes_per_rank=512 << 20, block_size=128) == 262_144


# --- worked examples -----------------------------------------------------------------------------


def test_llama70b_on_8xh100_cannot_run_tp1_short_by_63_4GiB() -> None:
    result = plan(spec("llama-3-70b"), ClusterSpec(1, **H100), Workload(8192))
    (violation,) = rejection(result, Layout(1, 1, 8)).violations
    assert violation.rule == "weights-fit-memory" and "short by 63.4 GiB" in violation.message


def test_llama70b_on_8xh100_latency_sensitive_picks_tp8() -> None:
    result = plan(spec("llama-3-70b"), ClusterSpec(1, **H100), Workload(2048, 256, latency_sensitive=True))
    assert result.ranked[0].layout == Layout(8, 1, 1)


def test_llama70b_on_8xh100_throughput_first_picks_tp4_x_dp2() -> None:
    result = plan(spec("llama-3-70b"), ClusterSpec(1, **H100), Workload(2048, 256))
    assert result.ranked[0].layout == Layout(4, 1, 2)


def test_llama405b_needs_two_8xh100_nodes_as_tp8_x_pp2_with_47_3GiB_per_rank() -> None:
    result = plan(spec("llama-3.1-405b"), ClusterSpec(2, **H100), Workload(8192, 256))
    best = result.ranked[0]
    assert best.layout == Layout(8, 2, 1)
    assert best.weights_gib_per_rank == pytest.approx(47.3, abs=0.05)
    assert any("1 of them over rdma between nodes" in reason for reason in best.reasons)
    assert rejection(result, Layout(16, 1, 1)).violations[0].rule == "tp-within-node"
    one_node = rejection(result, Layout(8, 1, 2)).violations[0]
    assert one_node.rule == "weights-fit-memory" and "short by 26.5 GiB" in one_node.message


def test_deepseek_v3_fp8_does_not_fit_8xh100_short_by_11_2GiB_per_rank_even_at_tp8() -> None:
    result = plan(spec("deepseek-v3"), ClusterSpec(1, **H100), Workload(8192, 256))
    assert result.ranked == []
    (violation,) = rejection(result, Layout(8, 1, 1, ep=8)).violations
    assert "need 79.2 GiB" in violation.message and "short by 11.2 GiB" in violation.message


def test_deepseek_v3_on_two_8xh100_nodes_uses_wide_ep_only_with_rdma() -> None:
    rdma = plan(spec("deepseek-v3"), ClusterSpec(2, **H100), Workload(8192, 256))
    assert rdma.ranked and all(e.layout.ep > 1 for e in rdma.ranked[:3])
    ethernet = plan(spec("deepseek-v3"), ClusterSpec(2, **H100, inter_link=LinkKind.ETHERNET), Workload(8192, 256))
    rules = {v.rule for r in ethernet.rejected for v in r.violations}
    assert "ep-across-nodes-needs-rdma" in rules


def test_mixtral_on_4xh100_prefers_expert_parallel_layouts_including_tp2_ep4() -> None:
    result = plan(spec("mixtral-8x7b"), ClusterSpec(1, 4, 80), Workload(4096, 256))
    top3 = [e.layout for e in result.ranked[:3]]
    assert all(layout.ep > 1 for layout in top3)
    assert Layout(2, 1, 2, ep=4) in top3  # the seeds' choice: TP=2 + EP=4 with DP=2
    assert "short by 19.0 GiB" in rejection(result, Layout(1, 1, 4)).violations[0].message


def test_every_rejected_layout_names_a_known_rule() -> None:
    for model, cluster in [
        ("llama-3-70b", ClusterSpec(1, **H100)),
        ("deepseek-v3", ClusterSpec(2, **H100)),
        ("qwen2-7b", ClusterSpec(1, **H100)),
        ("mixtral-8x7b", ClusterSpec(1, 4, 80)),
    ]:
        for rejected in plan(spec(model), cluster, Workload(8192, 64)).rejected:
            assert rejected.violations and {v.rule for v in rejected.violations} <= RULES


def test_a_context_that_does_not_fit_the_kv_cache_says_by_how_much() -> None:
    result = plan(spec("llama-3-70b"), ClusterSpec(1, **H100), Workload(131_072))
    (violation,) = rejection(result, Layout(2, 1, 4)).violations
    assert violation.rule == "kv-fits-context" and "short by" in violation.message


# --- the command ----------------------------------------------------------------------------------


def flotilla_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "plan", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_plan_command_prints_ranked_and_rejected_layouts() -> None:
    result = flotilla_plan(
        "--model",
        str(CONFIGS / "llama-3.1-405b.json"),
        "--nodes",
        "2",
        "--accelerators-per-node",
        "8",
        "--memory-gib",
        "80",
    )
    assert result.returncode == 0, result.stderr
    assert "1  TP=8 PP=2 DP=1" in result.stdout
    assert "rejected:" in result.stdout and "[tp-within-node]" in result.stdout


def test_plan_command_json_is_machine_readable() -> None:
    result = flotilla_plan(
        "--model",
        str(CONFIGS / "mixtral-8x7b.json"),
        "--nodes",
        "1",
        "--accelerators-per-node",
        "4",
        "--memory-gib",
        "80",
        "--json",
    )
    document = json.loads(result.stdout)
    assert document["ranked"][0]["layout"]["ep"] > 1
    assert document["ranked"][0]["suggested_redundant_experts"] is not None


def test_plan_command_refuses_unknown_architectures_clearly(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["GemmaForCausalLM"], "hidden_size": 8}))
    result = flotilla_plan("--model", str(config), "--nodes", "1", "--accelerators-per-node", "1", "--memory-gib", "8")
    assert result.returncode == 2
    assert "'GemmaForCausalLM' is not supported" in result.stderr
