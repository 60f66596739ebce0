from __future__ import annotations

import pytest

from cluster.layout import ModelShape, check_capacity, check_layout

LLAMA_8B = ModelShape("LlamaForCausalLM", 32, 8, 32, 14336, 8192)


@pytest.mark.parametrize(
    ("name", "shape", "tp", "pp", "rules"),
    [
        ("llama8b tp8 pp1 valid", LLAMA_8B, 8, 1, []),
        ("llama8b tp16 replicates kv heads", LLAMA_8B, 16, 1, []),
        (
            "llama8b tp3 breaks heads, kv heads and intermediate",
            LLAMA_8B,
            3,
            1,
            ["heads-divisible-by-tp", "kv-heads-vs-tp", "intermediate-divisible-by-tp"],
        ),
        ("llama8b tp4 pp33 has too few layers", LLAMA_8B, 4, 33, ["layers-vs-pp"]),
        (
            "6 kv heads vs tp4: neither divides",
            ModelShape("X", 24, 6, 4, 1024, 512),
            4,
            1,
            ["kv-heads-vs-tp"],
        ),
    ],
)
def test_layout_rules(name: str, shape: ModelShape, tp: int, pp: int, rules: list[str]) -> None:
    assert [v.rule for v in check_layout(shape, tp, pp)] == rules


def test_every_violation_message_names_the_numbers() -> None:
    (violation,) = check_layout(ModelShape("X", 4, 2, 1, 512, 64), 1, 2)
    assert "1 layers" in violation.message and "PP=2" in violation.message
    assert str(violation).startswith("[layers-vs-pp]")


def test_capacity() -> None:
    assert check_capacity(4, 4, "groups") == []
    (violation,) = check_capacity(5, 4, "2 group(s)")
    assert violation.rule == "slots-available" and "need 5" in violation.message and "has 4" in violation.message


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-mixtral"])
def test_tiny_models_allow_tp2_and_pp2(models_dir, model: str) -> None:
    shape = ModelShape.from_model_dir(models_dir / model)
    assert check_layout(shape, 2, 1) == []
    assert check_layout(shape, 1, 2) == []
    assert check_layout(shape, 2, 2) == []


def test_missing_model_dir_says_how_to_build(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="flotilla make-model"):
        ModelShape.from_model_dir(tmp_path)
