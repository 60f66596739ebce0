"""Rules a TP×PP layout must satisfy for a model, checked before anything starts.

Each rule has a stable name so that errors, tests and the planner can refer to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The fields of a Hugging Face ``config.json`` that parallel layouts depend on."""

    architecture: str
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    intermediate_size: int
    max_position_embeddings: int
    num_experts: int = 0

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelShape:
        config_file = model_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir} (build the tiny models with `flotilla make-model`)")
        config = json.loads(config_file.read_text())
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        return cls(
            architecture=(config.get("architectures") or ["unknown"])[0],
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            num_hidden_layers=int(config["num_hidden_layers"]),
            intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 0)),
            num_experts=int(config.get("num_local_experts") or config.get("n_routed_experts") or 0),
        )


@dataclass(frozen=True, slots=True)
class LayoutViolation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def check_layout(shape: ModelShape, tp: int, pp: int) -> list[LayoutViolation]:
    """Every rule that ``tp`` × ``pp`` breaks for ``shape``; empty when the layout is valid."""
    violations = []
    if shape.num_attention_heads % tp:
        violations.append(
            LayoutViolation(
                "heads-divisible-by-tp",
                f"{shape.num_attention_heads} attention heads cannot be split evenly over TP={tp}",
            )
        )
    kv = shape.num_key_value_heads
    if kv % tp and tp % kv:
        violations.append(
            LayoutViolation(
                "kv-heads-vs-tp",
                f"{kv} KV heads and TP={tp}: one must divide the other "
                "(KV heads are split when TP ≤ KV heads, replicated when TP is a multiple of them)",
            )
        )
    if shape.intermediate_size % tp:
        violations.append(
            LayoutViolation(
                "intermediate-divisible-by-tp",
                f"intermediate size {shape.intermediate_size} cannot be split evenly over TP={tp}",
            )
        )
    if pp > shape.num_hidden_layers:
        violations.append(
            LayoutViolation(
                "layers-vs-pp",
                f"{shape.num_hidden_layers} layers cannot fill PP={pp} stages (each stage needs at least one)",
            )
        )
    return violations


def check_capacity(slots_needed: int, slots_available: int, what: str) -> list[LayoutViolation]:
    if slots_needed <= slots_available:
        return []
    return [
        LayoutViolation(
            "slots-available",
            f"{what} need {slots_needed} accelerator slots but the cluster has {slots_available}",
        )
    ]
