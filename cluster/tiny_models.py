"""Tiny Hugging Face models that Flotilla builds itself (no model hub needed).

``flotilla make-model`` writes one folder per model with ``config.json``,
``generation_config.json``, a byte-level BPE tokenizer trained with ``tokenizers`` on a
seeded synthetic corpus (with a Llama-3-style chat template) and seeded random weights in
``model.safetensors`` using the tensor names of the real Llama and Mixtral checkpoints, so
vLLM's normal weight loader reads them.

Shapes allow TP=2 (4 query heads, 2 KV heads, even intermediate sizes) and PP=2 (4 layers).
Weights are scaled so greedy decoding has clear winners: logits have a spread of a few
units, far above float32 reduction-order noise, so TP=1, TP=2 and PP=2 agree token for token.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
    "<|python_tag|>",  # vLLM's llama3_json tool parser requires it
)
BOS, EOS, _, _, EOT, PAD, _ = SPECIAL_TOKENS
# Llama-3 headers; tools the Llama-3.1 JSON way (vLLM's `llama3_json` tool parser reads the calls back).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    'Call a function by answering with JSON {"name": function name, "parameters": its arguments}. Functions:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    '{"name": "{{ call[\'function\'][\'name\'] }}", "parameters": '
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}"
    "{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
STAMP_FILE = "flotilla-model.json"
WORDS = (
    "the a an of to in on at for with from by as is are was were be been it this that these those "
    "and or but if then else when while where why how what which who whom model token cache block "
    "router group node rank layer expert prefix request server cluster engine replica stream batch "
    "prompt answer question system user assistant hello world time data load queue memory tensor "
    "pipeline parallel speed fast slow small large first last next every many few more most other "
    "some any each all none one two three four five six seven eight nine ten hundred thousand "
    "river mountain city garden window paper music story light water stone cloud forest ocean "
    "green blue red yellow white black bright quiet loud warm cold early late good new old long "
    "make take give find keep send read write build serve route move run stop start wait open close"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of one tiny model; ``num_local_experts > 0`` makes it a Mixtral-style MoE."""

    name: str
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    seed: int = 0
    tokenizer_vocab_size: int | None = None
    """Default: ``vocab_size``. Smaller leaves embedding rows no token reaches, as padded vocabularies do."""
    weights: bool = True
    """False: config and tokenizer only, for engines started with ``load_format: dummy`` (real shapes,
    random weights made by vLLM on the device, no multi-GB file to write)."""

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    def fingerprint(self) -> str:
        payload = json.dumps(
            {"spec": asdict(self), "format": 1, "chat_template": CHAT_TEMPLATE, "special_tokens": SPECIAL_TOKENS},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


TINY_MODELS: dict[str, TinyModelSpec] = {
    "tiny-llama": TinyModelSpec(name="tiny-llama"),
    "tiny-mixtral": TinyModelSpec(
        name="tiny-mixtral", intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, seed=1
    ),
    # For routing benchmarks: big enough that a 1,000-token prefill costs ~0.5 s on one core,
    # so what the prefix cache saves shows in TTFT (27M parameters, 8 layers, 8 KV heads).
    "bench-llama": TinyModelSpec(
        name="bench-llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        seed=2,
    ),
    # Llama-3-8B's shapes, for speed checks on a GPU (bench/gpu_check.sh): serve with load_format dummy.
    "llama3-8b-shape": TinyModelSpec(
        name="llama3-8b-shape",
        vocab_size=128256,
        tokenizer_vocab_size=1024,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        weights=False,
    ),
}
DEFAULT_MODELS = ("tiny-llama", "tiny-mixtral")


def make_model(spec: TinyModelSpec, out_dir: Path) -> bool:
    """Write ``spec`` into ``out_dir``. Returns False when an identical model is already there."""
    stamp = out_dir / STAMP_FILE
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == spec.fingerprint():
        return False
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(spec.tokenizer_vocab_size or spec.vocab_size)
    _save_tokenizer(tokenizer, out_dir)
    token_ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    (out_dir / "config.json").write_text(json.dumps(_hf_config(spec, token_ids), indent=2))
    generation_config = {"bos_token_id": token_ids[BOS], "eos_token_id": [token_ids[EOS], token_ids[EOT]]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    if spec.weights:
        _save_weights(spec, out_dir / "model.safetensors")
    stamp.write_text(json.dumps({"fingerprint": spec.fingerprint(), "spec": asdict(spec)}, indent=2))
    return True


def _synthetic_corpus(seed: int, num_sentences: int = 4000) -> list[str]:
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = rng.choices(WORDS, k=rng.randint(4, 14))
        number = str(rng.randint(0, 9999)) if rng.random() < 0.3 else ""
        sentences.append(" ".join(words).capitalize() + (f" {number}" if number else "") + rng.choice(".?!,;:"))
    return sentences


def _build_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_synthetic_corpus(seed=0), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    return tokenizer


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOT, pad_token=PAD, model_max_length=1 << 30
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(str(out_dir))


def _hf_config(spec: TinyModelSpec, token_ids: dict[str, int]) -> dict:
    config = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": token_ids[BOS],
        "eos_token_id": token_ids[EOT],
        "pad_token_id": token_ids[PAD],
    }
    if spec.is_moe:
        config |= {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": spec.num_local_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "router_aux_loss_coef": 0.0,
        }
    else:
        config |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False}
    return config


def _save_weights(spec: TinyModelSpec, path: Path) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(spec.seed)

    def normal(std: float, *shape: int) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    h, q_dim, kv_dim = (
        spec.hidden_size,
        spec.num_attention_heads * spec.head_dim,
        spec.num_key_value_heads * spec.head_dim,
    )
    ffn = spec.intermediate_size
    proj_std = 1.0 / np.sqrt(h)
    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(1.0, spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[f"{prefix}.self_attn.q_proj.weight"] = normal(proj_std, q_dim, h)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = normal(proj_std, kv_dim, h)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = normal(proj_std, kv_dim, h)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal(1.0 / np.sqrt(q_dim), h, q_dim)
        if spec.is_moe:
            tensors[f"{prefix}.block_sparse_moe.gate.weight"] = normal(proj_std, spec.num_local_experts, h)
            for e in range(spec.num_local_experts):
                expert = f"{prefix}.block_sparse_moe.experts.{e}"
                tensors[f"{expert}.w1.weight"] = normal(proj_std, ffn, h)
                tensors[f"{expert}.w3.weight"] = normal(proj_std, ffn, h)
                tensors[f"{expert}.w2.weight"] = normal(1.0 / np.sqrt(ffn), h, ffn)
        else:
            tensors[f"{prefix}.mlp.gate_proj.weight"] = normal(proj_std, ffn, h)
            tensors[f"{prefix}.mlp.up_proj.weight"] = normal(proj_std, ffn, h)
            tensors[f"{prefix}.mlp.down_proj.weight"] = normal(1.0 / np.sqrt(ffn), h, ffn)
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    # Logit spread of ~3 units: decisive greedy choices that survive reduction-order noise.
    tensors["lm_head.weight"] = normal(3.0 / np.sqrt(h), spec.vocab_size, h)
    save_file(tensors, str(path), metadata={"format": "pt"})
