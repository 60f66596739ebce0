"""Text and JSON renderings of a :class:`cluster.planner.Plan` for ``flotilla plan``."""

from __future__ import annotations

import json

from flotilla.cluster.planner import KIB, Plan
from flotilla.cluster.text_table import format_table

TOP_WITH_REASONS = 3


def render_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2, default=str)


def render_text(plan: Plan, limit: int = 10) -> str:
    c, w = plan.cluster, plan.workload
    lines = [
        f"{plan.model} on {c.nodes} node(s) × {c.accelerators_per_node} accelerator(s) × {c.memory_gib:g} GiB "
        f"({c.intra_link.value} inside nodes, {c.inter_link.value} between); context {w.context_len}, "
        f"concurrency {w.concurrency}, objective: {'latency' if w.latency_sensitive else 'throughput'}",
        "",
        *[f"  • {decision}" for decision in plan.decisions],
        "",
    ]
    if plan.ranked:
        header = (
            "#",
            "layout",
            "weights/rank",
            "KV tokens/group",
            "seqs/group",
            "comm/token",
            "bubble",
            "ms/token",
            "tokens/s",
        )
        rows = [
            (
                str(i + 1),
                str(e.layout),
                f"{e.weights_gib_per_rank:.1f} GiB",
                f"{e.kv_tokens_per_group:,}",
                str(e.sequences_per_group),
                f"{e.communication.total_bytes / KIB:,.0f} KiB",
                f"{e.pp_bubble:.0%}",
                f"{e.token_latency_ms:.1f}",
                f"{e.throughput_tokens_s:,.0f}",
            )
            for i, e in enumerate(plan.ranked[:limit])
        ]
        lines += format_table(header, rows, right_aligned=set(range(len(header))) - {1})
        for i, e in enumerate(plan.ranked[:TOP_WITH_REASONS]):
            lines += ["", f"{i + 1}. {e.layout}", *[f"   - {reason}" for reason in e.reasons]]
    else:
        lines.append("no layout fits; see the rejected layouts below")
    if plan.rejected:
        lines += ["", "rejected:"]
        lines += [f"  {r.layout}: " + "; ".join(str(v) for v in r.violations) for r in plan.rejected]
    return "\n".join(lines)
