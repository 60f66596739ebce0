"""Parallelism planner: rank TP × PP × DP (× EP) layouts for a model on a cluster, and say why.

Arithmetic (per token unless stated; H hidden size, L layers, b dtype bytes):

* weights per rank — each stage's layers, attention and dense MLPs split by TP, routed experts
  split by TP or held whole by EP ranks, embeddings on the first stage and the LM head on the
  last (vocab-parallel over TP);
* KV bytes per rank — layers per stage × KV heads per rank × head_dim × 2 × b (MLA: the
  compressed latent, kv_lora_rank + rope dim, unsplit by TP);
* communication — TP: 2 all-reduces per layer of H × b; PP: one point-to-point of H × b per
  stage boundary; EP: 2 all-to-alls per MoE layer of top_k × H × b;
* PP bubble — (P − 1) / (M + P − 1) with M the sequences in flight per group.

Speed figures are estimates for ranking, not predictions. One decode step of a group takes
the larger of its memory time (weights plus the batch's KV cache, half a context per sequence
on average, read at ``hbm_gbps``) and its compute time (2 FLOPs per active parameter per
token at ``peak_tflops`` × ``mfu``), plus communication (latency + bytes / bandwidth with the
link constants below) and the engine's host time per step (fixed, plus per sequence).
Benchmarks are the ground truth.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from flotilla.cluster.layout import LayoutViolation, check_layout
from flotilla.cluster.model_spec import ModelSpec, stage_layers

GIB = 1 << 30
KIB = 1 << 10
MAX_SEQS_PER_GROUP = 256  # vLLM's default max_num_seqs
NEAR_TIE = 0.10


class LinkKind(StrEnum):
    NVLINK = "nvlink"
    PCIE = "pcie"
    RDMA = "rdma"
    ETHERNET = "ethernet"


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth_gbps: float  # GB/s, one direction, per accelerator
    latency_us: float  # fixed cost of one collective or transfer


# H100 NVLink 4 ≈ 450 GB/s each way; PCIe Gen5 x16 ≈ 64 GB/s; 400 Gb/s InfiniBand ≈ 50 GB/s;
# 100 GbE ≈ 12.5 GB/s. Latencies: ~10 µs per NCCL collective inside a node, 100+ µs across.
LINKS = {
    LinkKind.NVLINK: Link(450.0, 10.0),
    LinkKind.PCIE: Link(64.0, 20.0),
    LinkKind.RDMA: Link(50.0, 100.0),
    LinkKind.ETHERNET: Link(12.5, 200.0),
}


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    nodes: int
    accelerators_per_node: int
    memory_gib: float
    intra_link: LinkKind = LinkKind.NVLINK
    inter_link: LinkKind = LinkKind.RDMA
    hbm_gbps: float = 3350.0  # H100 SXM
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.5
    host_overhead_ms: float = 2.0  # CPU time of one engine step (vLLM scheduler)
    host_overhead_per_seq_ms: float = 0.03  # and per sequence in it (sampling, detokenizing, output)
    memory_utilization: float = 0.9  # vLLM's gpu_memory_utilization
    activation_reserve_gib: float | None = None  # default: 5% of memory

    @property
    def total_accelerators(self) -> int:
        return self.nodes * self.accelerators_per_node

    @property
    def usable_gib(self) -> float:
        reserve = self.activation_reserve_gib
        if reserve is None:
            reserve = 0.05 * self.memory_gib
        return self.memory_gib * self.memory_utilization - reserve


@dataclass(frozen=True, slots=True)
class Workload:
    context_len: int
    concurrency: int = 64
    latency_sensitive: bool = False


@dataclass(frozen=True, slots=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1
    """Expert-parallel size; 1 = experts sharded by TP. ep == tp: EP inside each group; ep == tp × dp: wide EP."""

    @property
    def group_size(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        text = f"TP={self.tp} PP={self.pp} DP={self.dp}"
        return text + (f" EP={self.ep}" if self.ep > 1 else "")


@dataclass(slots=True)
class Communication:
    tp_bytes: int = 0
    pp_bytes: int = 0
    ep_bytes: int = 0
    time_us: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.tp_bytes + self.pp_bytes + self.ep_bytes


@dataclass(slots=True)
class Estimate:
    layout: Layout
    weights_gib_per_rank: float
    kv_gib_per_rank: float
    kv_tokens_per_group: int
    sequences_per_group: int
    communication: Communication
    pp_bubble: float
    token_latency_ms: float
    throughput_tokens_s: float
    experts_per_rank: int | None = None
    suggested_redundant_experts: int | None = None
    reasons: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Rejection:
    layout: Layout
    violations: list[LayoutViolation]


@dataclass(slots=True)
class Plan:
    model: str
    cluster: ClusterSpec
    workload: Workload
    decisions: list[str]
    ranked: list[Estimate]
    rejected: list[Rejection]

    def to_dict(self) -> dict:
        return asdict(self)


# --- arithmetic ------------------------------------------------------------------------------


def pp_bubble(pp: int, micro_batches: int) -> float:
    """Idle fraction of a PP pipeline: (P − 1) / (M + P − 1)."""
    return (pp - 1) / (max(micro_batches, 1) + pp - 1)


def communication_per_token(spec: ModelSpec, layout: Layout, cluster: ClusterSpec) -> Communication:
    """Payload bytes one token sends through each kind of collective in one forward pass."""
    h_bytes = spec.hidden_size * spec.dtype_bytes
    intra, inter = LINKS[cluster.intra_link], LINKS[cluster.inter_link]
    comm = Communication()
    if layout.tp > 1:
        count = 2 * spec.num_hidden_layers
        comm.tp_bytes = count * h_bytes
        ring = 2 * (layout.tp - 1) / layout.tp
        comm.time_us += count * (intra.latency_us + h_bytes * ring / intra.bandwidth_gbps / 1e3)
    if layout.pp > 1:
        comm.pp_bytes = (layout.pp - 1) * h_bytes
        crossings = _nodes_per_group(layout, cluster) - 1
        for boundary in range(layout.pp - 1):
            link = inter if boundary < crossings else intra
            comm.time_us += link.latency_us + h_bytes / link.bandwidth_gbps / 1e3
    if layout.ep > 1 and spec.moe is not None:
        count = 2 * spec.num_moe_layers
        per = spec.moe.experts_per_token * h_bytes
        comm.ep_bytes = count * per
        link = inter if layout.ep > cluster.accelerators_per_node else intra
        comm.time_us += count * (link.latency_us + per * (layout.ep - 1) / layout.ep / link.bandwidth_gbps / 1e3)
    return comm


def suggested_redundant_experts(num_experts: int, ep: int) -> int:
    """One spare slot per EP rank (DeepSeek-V3: 256 experts on EP=32 → 32 redundant, 288 physical)."""
    return ep if num_experts >= ep else 0


def experts_per_rank(spec: ModelSpec, layout: Layout) -> int | None:
    """Routed experts each EP rank holds, before any redundant copies (EPLB adds those)."""
    if spec.moe is None or layout.ep == 1:
        return None
    return math.ceil(spec.moe.num_experts / layout.ep)


def weight_bytes_per_stage(spec: ModelSpec, layout: Layout) -> list[float]:
    """Weights one rank of each pipeline stage holds."""
    per_rank_experts = experts_per_rank(spec, layout)
    embedding = spec.embedding_params() * spec.dtype_bytes / layout.tp
    stages = stage_layers(spec.num_hidden_layers, layout.pp)
    sizes = []
    for index, layers in enumerate(stages):
        size = spec.layer_params_sum(layers, layout.tp, per_rank_experts) * spec.linear_weight_bytes
        if index == 0:
            size += embedding
        if index == len(stages) - 1 and not (spec.tie_word_embeddings and layout.pp == 1):
            size += embedding
        sizes.append(size)
    return sizes


def kv_capacity_tokens(spec: ModelSpec, tp: int, pp: int, kv_bytes_per_rank: float, block_size: int = 1) -> int:
    """Tokens a group's KV cache holds when every rank has ``kv_bytes_per_rank`` for it.

    Each rank sizes its cache for its own layers; the group holds what its fullest stage holds,
    rounded down to whole blocks as vLLM allocates them.
    """
    per_token = max(spec.kv_bytes_per_token(len(layers), tp) for layers in stage_layers(spec.num_hidden_layers, pp))
    blocks = int(kv_bytes_per_rank // (per_token * block_size))
    return blocks * block_size


# --- the plan --------------------------------------------------------------------------------


def plan(spec: ModelSpec, cluster: ClusterSpec, workload: Workload, model_name: str = "") -> Plan:
    ranked: list[Estimate] = []
    rejected: list[Rejection] = []
    for layout in candidate_layouts(spec, cluster):
        violations = layout_violations(spec, layout, cluster, workload)
        if violations:
            rejected.append(Rejection(layout, violations))
        else:
            ranked.append(estimate(spec, layout, cluster, workload))
    ranked = rank(ranked, cluster, workload)
    return Plan(
        model_name or spec.architecture, cluster, workload, decisions(spec, cluster, workload), ranked, rejected
    )


def rank(estimates: list[Estimate], cluster: ClusterSpec, workload: Workload) -> list[Estimate]:
    """Best first by the workload's objective: per-token latency if latency-sensitive, else throughput.

    The estimates are rough, so layouts within ``NEAR_TIE`` of the best count as equal; among
    those, layouts that keep PP out of a single node come first (TP inside a node, PP across
    nodes), then those with more DP replicas (they isolate faults and need no cross-replica
    communication, which the estimate does not price).
    """
    valid = {e.layout for e in estimates}

    def objective(e: Estimate) -> float:
        return e.token_latency_ms if workload.latency_sensitive else -e.throughput_tokens_s

    ordered = sorted(estimates, key=objective)
    if not ordered:
        return ordered
    best = objective(ordered[0])
    near = [e for e in ordered if objective(e) <= best + NEAR_TIE * abs(best)]
    near.sort(key=lambda e: (_tier(e.layout, valid, cluster), -e.layout.dp, objective(e)))
    return near + [e for e in ordered if e not in near]


def choose_for_groups(spec: ModelSpec, cluster: ClusterSpec, workload: Workload, groups: int) -> Plan:
    """Plan TP × PP for a fixed number of DP groups, which may leave accelerators unused (no EP)."""
    ranked, rejected = [], []
    g = cluster.accelerators_per_node
    for tp in _divisors(g):
        for pp in range(1, cluster.total_accelerators // (tp * groups) + 1):
            layout = Layout(tp, pp, groups)
            violations = layout_violations(spec, layout, cluster, workload)
            if violations:
                rejected.append(Rejection(layout, violations))
            else:
                ranked.append(estimate(spec, layout, cluster, workload))
    return Plan(
        spec.architecture,
        cluster,
        workload,
        decisions(spec, cluster, workload),
        rank(ranked, cluster, workload),
        rejected,
    )


def candidate_layouts(spec: ModelSpec, cluster: ClusterSpec) -> list[Layout]:
    """Every TP × PP × DP that uses the whole cluster, with EP variants for MoE models."""
    total = cluster.total_accelerators
    layouts = []
    for tp in _divisors(total):
        for pp in _divisors(total // tp):
            dp = total // (tp * pp)
            layouts.append(Layout(tp, pp, dp))
            if spec.is_moe:
                for ep in sorted({tp, tp * dp} - {1}):
                    layouts.append(Layout(tp, pp, dp, ep))
    return layouts


def layout_violations(
    spec: ModelSpec, layout: Layout, cluster: ClusterSpec, workload: Workload
) -> list[LayoutViolation]:
    violations = check_layout(spec, layout.tp, layout.pp, layout.ep)
    g = cluster.accelerators_per_node
    if layout.tp > g or g % layout.tp:
        violations.append(
            LayoutViolation(
                "tp-within-node",
                f"TP={layout.tp} must divide the {g} accelerators of one node: "
                "TP all-reduces twice per layer and cannot cross the inter-node link",
            )
        )
    elif layout.group_size > g and layout.group_size % g:
        violations.append(
            LayoutViolation(
                "group-fits-nodes",
                f"a group of TP×PP={layout.group_size} must fit in one node or fill whole nodes of {g}",
            )
        )
    if layout.ep > g and cluster.inter_link is not LinkKind.RDMA:
        violations.append(
            LayoutViolation(
                "ep-across-nodes-needs-rdma",
                f"EP={layout.ep} spans nodes, whose {cluster.inter_link.value} link is too slow for "
                "two all-to-alls per MoE layer; keep EP inside a node",
            )
        )
    if violations:
        return violations
    return _memory_violations(spec, layout, cluster, workload)


def _memory_violations(
    spec: ModelSpec, layout: Layout, cluster: ClusterSpec, workload: Workload
) -> list[LayoutViolation]:
    usable = cluster.usable_gib * GIB
    weights = max(weight_bytes_per_stage(spec, layout))
    if weights > usable:
        return [
            LayoutViolation(
                "weights-fit-memory",
                f"weights need {weights / GIB:.1f} GiB per rank but {cluster.usable_gib:.1f} GiB is usable: "
                f"short by {(weights - usable) / GIB:.1f} GiB",
            )
        ]
    needed = max(spec.kv_bytes_per_token(len(s), layout.tp) for s in stage_layers(spec.num_hidden_layers, layout.pp))
    needed *= workload.context_len
    free = usable - weights
    if needed > free:
        return [
            LayoutViolation(
                "kv-fits-context",
                f"one {workload.context_len}-token sequence needs {needed / GIB:.2f} GiB of KV per rank but "
                f"{free / GIB:.2f} GiB is left after weights: short by {(needed - free) / GIB:.2f} GiB",
            )
        ]
    return []


def estimate(spec: ModelSpec, layout: Layout, cluster: ClusterSpec, workload: Workload) -> Estimate:
    stage_weights = weight_bytes_per_stage(spec, layout)
    weights = max(stage_weights)
    kv_bytes = cluster.usable_gib * GIB - weights
    kv_tokens = kv_capacity_tokens(spec, layout.tp, layout.pp, kv_bytes)
    sequences = kv_tokens // workload.context_len
    comm = communication_per_token(spec, layout, cluster)
    batch = max(1, min(math.ceil(workload.concurrency / layout.dp), sequences, MAX_SEQS_PER_GROUP))
    bubble = pp_bubble(layout.pp, batch)
    token_latency_s = sum(_stage_time_s(spec, layout, cluster, w, 1, workload) for w in stage_weights)
    token_latency_s += comm.time_us / 1e6 + _host_time_s(cluster, 1)
    # Pipelined stages overlap: a batch leaves the group every slowest-stage time, minus the bubble.
    stage_time_s = max(_stage_time_s(spec, layout, cluster, w, batch, workload) for w in stage_weights)
    step_time_s = stage_time_s + comm.time_us / 1e6 / layout.pp + _host_time_s(cluster, batch)
    throughput = layout.dp * batch * (1 - bubble) / step_time_s
    per_rank = experts_per_rank(spec, layout)
    result = Estimate(
        layout=layout,
        weights_gib_per_rank=weights / GIB,
        kv_gib_per_rank=kv_bytes / GIB,
        kv_tokens_per_group=kv_tokens,
        sequences_per_group=sequences,
        communication=comm,
        pp_bubble=bubble,
        token_latency_ms=token_latency_s * 1e3,
        throughput_tokens_s=throughput,
        experts_per_rank=per_rank,
        suggested_redundant_experts=(
            suggested_redundant_experts(spec.moe.num_experts, layout.ep) if spec.moe and layout.ep > 1 else None
        ),
    )
    result.reasons = _reasons(spec, result, cluster, workload, batch)
    return result


def _host_time_s(cluster: ClusterSpec, batch: int) -> float:
    return (cluster.host_overhead_ms + cluster.host_overhead_per_seq_ms * batch) / 1e3


def _stage_time_s(
    spec: ModelSpec, layout: Layout, cluster: ClusterSpec, stage_bytes: float, batch: int, workload: Workload
) -> float:
    """One decode step of one stage: memory time or compute time, whichever is larger."""
    weights_read = _weight_bytes_read(spec, layout, stage_bytes, batch)
    layers = math.ceil(spec.num_hidden_layers / layout.pp)
    kv_read = batch * workload.context_len / 2 * spec.kv_bytes_per_token(layers, layout.tp)
    memory_s = (weights_read + kv_read) / (cluster.hbm_gbps * 1e9)
    active_params = weights_read / spec.linear_weight_bytes
    compute_s = 2 * active_params * batch / (cluster.peak_tflops * 1e12 * cluster.mfu)
    return max(memory_s, compute_s)


def _weight_bytes_read(spec: ModelSpec, layout: Layout, stage_bytes: float, batch: int) -> float:
    """Weight bytes a rank streams per decode step: MoE ranks read only the experts the batch routes to."""
    if spec.moe is None:
        return stage_bytes
    moe = spec.moe
    expert_bytes = spec.expert_params() * spec.linear_weight_bytes
    held = experts_per_rank(spec, layout) or moe.num_experts
    routed = min(held, math.ceil(batch * moe.experts_per_token / max(layout.ep, 1)))
    shard = 1 if layout.ep > 1 else layout.tp
    moe_layers_here = spec.num_moe_layers / layout.pp
    return stage_bytes - moe_layers_here * (held - routed) * expert_bytes / shard


def _reasons(spec: ModelSpec, e: Estimate, cluster: ClusterSpec, workload: Workload, batch: int) -> list[str]:
    layout, comm = e.layout, e.communication
    reasons = [
        f"weights {e.weights_gib_per_rank:.1f} GiB per rank leave {e.kv_gib_per_rank:.1f} GiB of KV: "
        f"{e.kv_tokens_per_group:,} tokens = {e.sequences_per_group} sequence(s) of {workload.context_len} per group"
    ]
    if layout.tp > 1:
        reasons.append(
            f"TP={layout.tp} over {cluster.intra_link.value}: {2 * spec.num_hidden_layers} all-reduces × "
            f"{spec.hidden_size * spec.dtype_bytes / KIB:.0f} KiB per token = {comm.tp_bytes / KIB:,.0f} KiB"
        )
    if layout.pp > 1:
        crossings = _nodes_per_group(layout, cluster) - 1
        where = f", {crossings} of them over {cluster.inter_link.value} between nodes" if crossings else ""
        reasons.append(
            f"PP={layout.pp}: {layout.pp - 1} boundary send(s) of {spec.hidden_size * spec.dtype_bytes / KIB:.0f} KiB "
            f"per token{where}; bubble {e.pp_bubble:.0%} at {batch} sequence(s) in flight per group"
        )
    if layout.ep > 1 and spec.moe is not None:
        kind = "wide EP across groups" if layout.ep > layout.tp else "EP inside each group"
        redundant = e.suggested_redundant_experts or 0
        extra_gib = spec.num_moe_layers * spec.expert_params() * spec.linear_weight_bytes * redundant / layout.ep / GIB
        reasons.append(
            f"{kind}: EP={layout.ep}, {e.experts_per_rank} expert(s) per rank per MoE layer; 2 all-to-alls × "
            f"{spec.num_moe_layers} MoE layers = {comm.ep_bytes / KIB:,.0f} KiB per token; for EPLB, "
            f"{redundant} redundant expert(s) ({spec.moe.num_experts + redundant} physical) would add "
            f"{extra_gib:.1f} GiB per rank"
        )
    if layout.dp > 1:
        reasons.append(f"DP={layout.dp}: independent replicas scale throughput; their prefix caches are separate")
    reasons.append(
        f"estimated {e.token_latency_ms:.1f} ms per token for one sequence, "
        f"{e.throughput_tokens_s:,.0f} tokens/s at concurrency {workload.concurrency}"
    )
    return reasons


def decisions(spec: ModelSpec, cluster: ClusterSpec, workload: Workload) -> list[str]:
    """The decision tree's questions, answered for this model and cluster."""
    full = Layout(1, 1, 1)
    weights = max(weight_bytes_per_stage(spec, full)) / GIB
    usable = cluster.usable_gib
    node_usable = usable * cluster.accelerators_per_node
    lines = [f"model weights {weights:.1f} GiB; {usable:.1f} GiB usable per accelerator"]
    if weights <= usable:
        lines.append("fits one accelerator → plain DP replicas give the most throughput; TP only buys latency")
    elif spec.is_moe:
        wide = cluster.inter_link is LinkKind.RDMA and cluster.nodes > 1
        lines.append(
            "MoE that does not fit one accelerator → expert parallelism; "
            + (
                "RDMA between nodes allows wide EP (TP × DP ranks share the experts)"
                if wide
                else "keep EP inside a node"
            )
        )
    elif weights <= node_usable:
        lines.append(
            "fits one node → TP inside the node"
            + (
                " (latency-sensitive: larger TP)"
                if workload.latency_sensitive
                else ", DP across the rest for throughput"
            )
        )
    else:
        lines.append("does not fit one node → TP inside each node, PP across nodes (one send per stage boundary)")
    if workload.context_len > 32_768:
        lines.append(f"long context ({workload.context_len} tokens) → favour layouts with more KV capacity per group")
    return lines


def _tier(layout: Layout, valid: set[Layout], cluster: ClusterSpec) -> int:
    """0, or 1 for PP inside one node while a valid layout of the same group size uses TP instead.

    Rule of thumb: TP inside a node, PP across nodes. PP's light traffic pays off only across
    the slow inter-node link; inside a node it adds a bubble and per-token latency.
    """
    if layout.pp == 1 or layout.group_size > cluster.accelerators_per_node:
        return 0
    tp_instead = Layout(layout.group_size, 1, layout.dp, layout.ep)
    return 1 if tp_instead in valid else 0


def _nodes_per_group(layout: Layout, cluster: ClusterSpec) -> int:
    return max(1, math.ceil(layout.group_size / cluster.accelerators_per_node))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
