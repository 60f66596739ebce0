from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.cluster.layout import check_capacity, check_layout
from flotilla.cluster.model_spec import ModelSpec, UnsupportedModelError

CONFIGS = Path(__file__).parent / "model_configs"


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_path(CONFIGS / f"{name}.json")


def generic(heads: int, kv_heads: int, layers: int, intermediate: int) -> ModelSpec:
    return ModelSpec.from_config(
        {
            "architectures": ["SomeNewModel"],
            "hidden_size": 64 * heads,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers,
            "intermediate_size": intermediate,
            "vocab_size": 1000,
        },
        strict=False,
    )


@pytest.mark.parametrize(
    ("name", "model", "tp", "pp", "ep", "rules"),
    [
        ("llama70b tp8 pp1 valid", "llama-3-70b", 8, 1, 1, []),
        ("llama70b tp16 replicates its 8 kv heads", "llama-3-70b", 16, 1, 1, []),
        (
            "llama70b tp3 breaks heads, kv heads and intermediate",
            "llama-3-70b",
            3,
            1,
            1,
            ["heads-divisible-by-tp", "kv-heads-vs-tp", "intermediate-divisible-by-tp"],
        ),
        ("llama70b pp81 has too few layers", "llama-3-70b", 1, 81, 1, ["layers-vs-pp"]),
        ("qwen2-7b 28 heads break tp8", "qwen2-7b", 8, 1, 1, ["heads-divisible-by-tp"]),
        ("mixtral ep8 holds one expert per rank", "mixtral-8x7b", 1, 1, 8, []),
        ("mixtral 8 experts cannot spread over ep3", "mixtral-8x7b", 1, 1, 3, ["experts-divisible-by-ep"]),
        ("dense llama has no experts for ep", "llama-3-70b", 2, 1, 2, ["ep-needs-moe"]),
        ("deepseek mla ignores kv-head rule at tp16", "deepseek-v3", 16, 1, 16, []),
    ],
)
def test_layout_rules(name, model, tp, pp, ep, rules) -> None:
    assert [v.rule for v in check_layout(spec(model), tp, pp, ep)] == rules


def test_generic_models_get_the_divisibility_rules() -> None:
    assert [v.rule for v in check_layout(generic(24, 6, 4, 1024), 4, 1)] == ["kv-heads-vs-tp"]
    assert [v.rule for v in check_layout(generic(4, 2, 1, 512), 1, 2)] == ["layers-vs-pp"]


def test_violation_messages_name_the_numbers() -> None:
    (violation,) = check_layout(generic(4, 2, 1, 512), 1, 2)
    assert "1 layers" in violation.message and "PP=2" in violation.message
    assert str(violation).startswith("[layers-vs-pp]")


def test_capacity() -> None:
    assert check_capacity(4, 4, "groups") == []
    (violation,) = check_capacity(5, 4, "2 group(s)")
    assert violation.rule == "slots-available" and "need 5" in violation.message and "has 4" in violation.message


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-mixtral"])
def test_tiny_models_allow_tp2_and_pp2(models_dir, model: str) -> None:
    tiny = ModelSpec.from_path(models_dir / model)
    assert check_layout(tiny, 2, 1) == []
    assert check_layout(tiny, 1, 2) == []
    assert check_layout(tiny, 2, 2) == []


def test_missing_model_dir_says_how_to_build(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="flotilla make-model"):
        ModelSpec.from_path(tmp_path)


def test_unknown_architecture_is_a_clear_error_for_the_planner() -> None:
    with pytest.raises(UnsupportedModelError, match="'SomeNewModel' is not supported"):
        ModelSpec.from_config(
            {
                "architectures": ["SomeNewModel"],
                "hidden_size": 8,
                "num_attention_heads": 1,
                "num_hidden_layers": 1,
                "vocab_size": 8,
            }
        )
