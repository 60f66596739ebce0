"""Rules a TP × PP (× EP) layout must satisfy for a model, checked before anything starts.

Each rule has a stable name so that errors, tests and the planner can refer to it. Rules about
the cluster's shape and memory live with the planner (``cluster.planner``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.cluster.model_spec import ModelSpec


@dataclass(frozen=True, slots=True)
class LayoutViolation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> list[LayoutViolation]:
    """Every model rule that ``tp`` × ``pp`` (× ``ep``) breaks; empty when the layout is valid."""
    violations = []
    if spec.num_attention_heads % tp:
        violations.append(
            LayoutViolation(
                "heads-divisible-by-tp",
                f"{spec.num_attention_heads} attention heads cannot be split evenly over TP={tp}",
            )
        )
    kv = spec.num_key_value_heads
    if spec.mla is None and kv % tp and tp % kv:
        violations.append(
            LayoutViolation(
                "kv-heads-vs-tp",
                f"{kv} KV heads and TP={tp}: one must divide the other "
                "(KV heads are split when TP ≤ KV heads, replicated when TP is a multiple of them)",
            )
        )
    for what, size in _tp_split_sizes(spec, ep):
        if size % tp:
            violations.append(
                LayoutViolation("intermediate-divisible-by-tp", f"{what} {size} cannot be split evenly over TP={tp}")
            )
    if pp > spec.num_hidden_layers:
        violations.append(
            LayoutViolation(
                "layers-vs-pp",
                f"{spec.num_hidden_layers} layers cannot fill PP={pp} stages (each stage needs at least one)",
            )
        )
    if ep > 1:
        violations += _expert_violations(spec, ep)
    return violations


def _tp_split_sizes(spec: ModelSpec, ep: int) -> list[tuple[str, int]]:
    """Intermediate sizes that TP shards: dense MLPs, and experts unless EP holds them whole."""
    sizes = []
    if spec.num_moe_layers < spec.num_hidden_layers:
        sizes.append(("intermediate size", spec.intermediate_size))
    if spec.moe is not None and (ep == 1 or spec.moe.num_shared_experts):
        sizes.append(("expert intermediate size", spec.moe.expert_intermediate_size))
    return sizes


def _expert_violations(spec: ModelSpec, ep: int) -> list[LayoutViolation]:
    if spec.moe is None:
        return [
            LayoutViolation("ep-needs-moe", f"EP={ep} needs a mixture-of-experts model; {spec.architecture} is dense")
        ]
    if spec.moe.num_experts % ep:
        return [
            LayoutViolation(
                "experts-divisible-by-ep",
                f"{spec.moe.num_experts} experts cannot be spread evenly over EP={ep} ranks",
            )
        ]
    return []


def check_capacity(slots_needed: int, slots_available: int, what: str) -> list[LayoutViolation]:
    if slots_needed <= slots_available:
        return []
    return [
        LayoutViolation(
            "slots-available",
            f"{what} need {slots_needed} accelerator slots but the cluster has {slots_available}",
        )
    ]
