"""What a model's Hugging Face ``config.json`` says about memory and parallelism.

Families read: Llama, Qwen2 (dense, GQA), Mixtral (MoE: every layer routes top-k of E experts)
and DeepSeek-V3 (MLA attention, shared experts, the first layers dense). Parameter counts are
exact for these layouts; byte counts use the checkpoint dtype, and FP8 checkpoints
(``quantization_config.quant_method == "fp8"``) store linear weights in one byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


class UnsupportedModelError(ValueError):
    """The config names an architecture the planner cannot reason about."""


@dataclass(frozen=True, slots=True)
class MoeSpec:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    first_dense_layers: int = 0


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """DeepSeek multi-head latent attention: the KV cache holds one compressed latent per token."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    family: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype_bytes: int
    """Bytes per element of activations and the KV cache (the checkpoint's torch_dtype)."""
    linear_weight_bytes: float
    """Bytes per parameter of linear layers (1 for FP8 checkpoints, else dtype_bytes)."""
    qkv_bias: bool = False
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None

    # --- reading -----------------------------------------------------------------------------
    @classmethod
    def from_path(cls, path: str | Path, strict: bool = True) -> ModelSpec:
        """A model folder or a config.json file; see ``from_config`` for ``strict``."""
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json at {path} (build the tiny models with `flotilla make-model`)")
        return cls.from_config(json.loads(config_file.read_text()), strict)

    @classmethod
    def from_config(cls, config: dict[str, Any], strict: bool = True) -> ModelSpec:
        """``strict``: unknown architectures are errors (the planner needs exact layouts); otherwise
        they are read as a generic dense decoder, enough for the divisibility rules."""
        config = config.get("text_config", config)
        architecture = (config.get("architectures") or ["unknown"])[0]
        family = FAMILIES.get(architecture)
        if family is None:
            if strict:
                raise UnsupportedModelError(
                    f"architecture {architecture!r} is not supported; the planner knows {sorted(FAMILIES)}"
                )
            family = "generic"
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        dtype_bytes = DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
        quant = config.get("quantization_config") or {}
        linear_bytes = 1 if quant.get("quant_method") == "fp8" else dtype_bytes
        moe = mla = None
        if family == "mixtral":
            moe = MoeSpec(
                int(config["num_local_experts"]), int(config["num_experts_per_tok"]), int(config["intermediate_size"])
            )
        if family == "deepseek_v3":
            moe = MoeSpec(
                num_experts=int(config["n_routed_experts"]),
                experts_per_token=int(config["num_experts_per_tok"]),
                expert_intermediate_size=int(config["moe_intermediate_size"]),
                num_shared_experts=int(config.get("n_shared_experts") or 0),
                first_dense_layers=int(config.get("first_k_dense_replace") or 0),
            )
            mla = MlaSpec(
                q_lora_rank=config.get("q_lora_rank"),
                kv_lora_rank=int(config["kv_lora_rank"]),
                qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                v_head_dim=int(config["v_head_dim"]),
            )
        return cls(
            architecture=architecture,
            family=family,
            hidden_size=hidden,
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype_bytes=dtype_bytes,
            linear_weight_bytes=linear_bytes,
            qkv_bias=family == "qwen2",
            moe=moe,
            mla=mla,
        )

    # --- layer structure ---------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.first_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    # --- parameters (counts, not bytes) --------------------------------------------------------
    def attention_params(self, tp: int = 1) -> float:
        """Attention parameters held by one TP rank in one layer."""
        h, heads = self.hidden_size, self.num_attention_heads
        if self.mla is not None:
            m = self.mla
            q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = (h * m.q_lora_rank + m.q_lora_rank * heads * q_head) if m.q_lora_rank else h * heads * q_head
            replicated = h * (m.kv_lora_rank + m.qk_rope_head_dim)  # kv_a_proj_with_mqa
            split = q + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h
            if m.q_lora_rank:  # q_a_proj is replicated, q_b_proj split
                return h * m.q_lora_rank + replicated + (split - h * m.q_lora_rank) / tp
            return replicated + split / tp
        d = self.head_dim
        kv_heads_per_rank = max(1, self.num_key_value_heads // tp)
        q_and_o = 2 * h * heads * d / tp
        k_and_v = 2 * h * kv_heads_per_rank * d
        bias = (heads * d / tp + 2 * kv_heads_per_rank * d) if self.qkv_bias else 0
        return q_and_o + k_and_v + bias

    def dense_mlp_params(self, tp: int = 1) -> float:
        return 3 * self.hidden_size * self.intermediate_size / tp

    def expert_params(self) -> int:
        """One routed expert (gate, up, down projections)."""
        assert self.moe is not None
        return 3 * self.hidden_size * self.moe.expert_intermediate_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> float:
        return self.layer_params_sum(range(self.num_hidden_layers), tp=1, experts_per_rank=None) + (
            self.embedding_params() * (1 if self.tie_word_embeddings else 2)
        )

    def layer_params_sum(self, layers: range, tp: int, experts_per_rank: int | None) -> float:
        """Linear-layer parameters one rank holds for ``layers``.

        ``experts_per_rank`` None: experts are TP-sharded (no EP); otherwise each rank holds
        that many whole experts (EP).
        """
        total = 0.0
        for layer in layers:
            total += self.attention_params(tp) + 2 * self.hidden_size  # + 2 RMSNorms
            if not self.is_moe_layer(layer):
                total += self.dense_mlp_params(tp)
                continue
            assert self.moe is not None
            total += self.hidden_size * self.moe.num_experts  # router gate, replicated
            total += self.moe.num_shared_experts * self.expert_params() / tp
            if experts_per_rank is None:
                total += self.moe.num_experts * self.expert_params() / tp
            else:
                total += experts_per_rank * self.expert_params()
        return total

    # --- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_token(self, layers: int, tp: int) -> int:
        """KV cache bytes one rank stores per token for ``layers`` layers.

        GQA: layers × KV heads per rank × head_dim × 2 (K and V) × dtype bytes, where KV heads are
        replicated once TP exceeds them. MLA: every rank keeps the whole compressed latent,
        layers × (kv_lora_rank + rope dim) × dtype bytes.
        """
        if self.mla is not None:
            return layers * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) * self.dtype_bytes
        kv_heads_per_rank = max(1, self.num_key_value_heads // tp)
        return layers * kv_heads_per_rank * self.head_dim * 2 * self.dtype_bytes


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Layers of each pipeline stage, split as vLLM's ``get_pp_indices`` does.

    An even split; the remainder goes one layer each to the stages before the last one,
    walking backwards (the last stage also holds the final norm and LM head).
    """
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:stage]) for stage in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]
