from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import safe_open
from transformers import AutoTokenizer

from flotilla.cluster.tiny_models import EOT, TINY_MODELS, make_model


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_build_is_deterministic_and_skips_when_up_to_date(tmp_path) -> None:
    spec = TINY_MODELS["tiny-llama"]
    assert make_model(spec, tmp_path / "a") is True
    assert make_model(spec, tmp_path / "a") is False
    assert make_model(spec, tmp_path / "b") is True
    assert digest(tmp_path / "a") == digest(tmp_path / "b")


def test_dense_model_folder(tiny_llama: Path) -> None:
    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(tiny_llama / "model.safetensors"), "np") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("lm_head.weight").shape == (config["vocab_size"], config["hidden_size"])
    assert "model.layers.3.mlp.gate_proj.weight" in names
    assert len(names) == 3 + 9 * config["num_hidden_layers"]


def test_moe_model_uses_mixtral_expert_names(tiny_mixtral: Path) -> None:
    config = json.loads((tiny_mixtral / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    with safe_open(str(tiny_mixtral / "model.safetensors"), "np") as weights:
        names = set(weights.keys())
    for expert in range(8):
        assert f"model.layers.0.block_sparse_moe.experts.{expert}.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_tokenizer_matches_vocab_and_has_a_chat_template(tiny_llama: Path) -> None:
    config = json.loads((tiny_llama / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert len(tokenizer) == config["vocab_size"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello world"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello world" + EOT)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tokenizer.decode(tokenizer.encode("The river 42.", add_special_tokens=False)) == "The river 42."


def test_shape_only_model_has_real_shapes_and_no_weight_file(tmp_path) -> None:
    """llama3-8b-shape is served with load_format dummy: a config with Llama-3-8B's shapes, a small
    tokenizer whose ids all fall inside the embedding table, and no multi-GB weight file."""
    assert make_model(TINY_MODELS["llama3-8b-shape"], tmp_path) is True
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (4096, 32, 128256)
    assert not list(tmp_path.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert max(tokenizer.get_vocab().values()) < config["vocab_size"]
