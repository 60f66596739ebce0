"""EPLB placement benchmark: Flotilla's placement vs DeepSeek's algorithm on synthetic load traces.

Each trace is a sequence of load windows (tokens per logical expert and layer, Poisson
sampled from the trace's expected load). At every window each algorithm plans a new
placement from that window's load and its own previous placement, as vLLM does at each
rearrangement. Reported per trace and algorithm:

- balancedness: mean/max per-rank load (vLLM's definition, summed over layers) of the plan on
  the window it was planned from; "next window" applies it to the following window.
- moved: fraction of physical slots whose new expert was not on that rank before (weights
  cross the network), averaged over the rebalances after the first.
- GB moved per rebalance: moved slots x one DeepSeek-V3 routed expert in FP8
  (3 x 7168 x 2048 bytes = 44 MB), summed over the cluster.
- planning time: CPU time of one plan (median over the trace's rebalances), one thread.

Run: ``python -m bench.eplb_bench`` (``--no-docs`` to leave docs/benchmarks.md alone).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from flotilla.cluster.eplb import deepseek
from flotilla.cluster.eplb.balance import balancedness, slots_needing_transfer
from flotilla.cluster.eplb.expert_placement import plan_placement

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DSV3_EXPERT_BYTES = 3 * 7168 * 2048
TOKENS_PER_WINDOW = 4_096_000
"""Routed token-expert assignments per layer and window: 1000 steps x 512 tokens x top-8."""

Planner = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    description: str
    layers: int
    logical: int
    physical: int
    groups: int
    nodes: int
    ranks: int
    windows: int
    expected_load: LoadModel


LoadModel = Callable[[np.random.Generator, int, int, int], np.ndarray]
"""``(rng, window, layers, logical) -> [layers, logical]`` expected share of tokens per expert."""


def zipf_shares(rng: np.random.Generator, layers: int, logical: int, alpha: float) -> np.ndarray:
    base = 1.0 / np.arange(1, logical + 1) ** alpha
    shares = np.stack([rng.permutation(base) for _ in range(layers)])
    return shares / shares.sum(axis=1, keepdims=True)


def zipf(alpha: float) -> LoadModel:
    """Stationary: the same Zipf shares (a random expert order per layer) in every window."""
    drawn: list[np.ndarray] = []

    def load(rng: np.random.Generator, window: int, layers: int, logical: int) -> np.ndarray:
        if not drawn:
            drawn.append(zipf_shares(rng, layers, logical, alpha))
        return drawn[0]

    return load


def drifting(alpha: float, hot_moves_per_window: int) -> LoadModel:
    """Zipf shares whose hottest experts swap load with random others every window."""
    drawn: list[np.ndarray] = []

    def load(rng: np.random.Generator, window: int, layers: int, logical: int) -> np.ndarray:
        if not drawn:
            drawn.append(zipf_shares(rng, layers, logical, alpha))
        shares = drawn[0]
        for layer in range(layers if window > 0 else 0):
            hot = np.argsort(-shares[layer])[:hot_moves_per_window]
            other = rng.choice(logical, size=hot.shape[0], replace=False)
            shares[layer, hot], shares[layer, other] = shares[layer, other].copy(), shares[layer, hot].copy()
        return shares

    return load


def dominant(share: float) -> LoadModel:
    """One expert per layer takes ``share`` of the tokens; the rest are mildly skewed."""
    drawn: list[np.ndarray] = []

    def load(rng: np.random.Generator, window: int, layers: int, logical: int) -> np.ndarray:
        if not drawn:
            shares = zipf_shares(rng, layers, logical, 0.3) * (1 - share)
            shares[np.arange(layers), rng.integers(0, logical, layers)] += share
            drawn.append(shares)
        return drawn[0]

    return load


TRACES = [
    Trace(
        "zipf0.8-stationary-ep32",
        "DeepSeek-V3 prefill layout, stationary Zipf(0.8)",
        61,
        256,
        288,
        8,
        4,
        32,
        5,
        zipf(0.8),
    ),
    Trace(
        "zipf1.0-stationary-ep144",
        "DeepSeek-V3 decode layout (EP144, 18 nodes), stationary Zipf(1.0)",
        61,
        256,
        288,
        8,
        18,
        144,
        4,
        zipf(1.0),
    ),
    Trace(
        "zipf0.6-1-group-per-node-ep64",
        "8 groups on 8 nodes (hierarchical can't move load across nodes)",
        58,
        256,
        320,
        8,
        8,
        64,
        4,
        zipf(0.6),
    ),
    Trace(
        "drifting-hot-ep32",
        "Zipf(1.0), the 8 hottest experts per layer swap with random ones each window",
        61,
        256,
        288,
        8,
        4,
        32,
        5,
        drifting(1.0, 8),
    ),
    Trace("dominant-expert-ep16", "one expert takes 30% of tokens", 24, 64, 80, 8, 2, 16, 4, dominant(0.3)),
    Trace(
        "qwen-like-ep16",
        "48 layers x 128 experts, 1 group, 2 nodes, stationary Zipf(0.8)",
        48,
        128,
        160,
        1,
        2,
        16,
        4,
        zipf(0.8),
    ),
    Trace(
        "mixtral-like-ep4",
        "32 layers x 8 experts, 12 slots on 4 ranks, stationary Zipf(1.0)",
        32,
        8,
        12,
        1,
        1,
        4,
        4,
        zipf(1.0),
    ),
]


def planners(trace: Trace) -> dict[str, Planner]:
    shape = (trace.physical, trace.groups, trace.nodes, trace.ranks)
    return {
        "deepseek": lambda weight, old: deepseek.rebalance_experts(weight, *shape),
        "flotilla": lambda weight, old: plan_placement(weight, *shape, old),
    }


def run_trace(trace: Trace, seed: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    windows = [
        rng.poisson(trace.expected_load(rng, window, trace.layers, trace.logical) * TOKENS_PER_WINDOW).astype(float)
        for window in range(trace.windows + 1)
    ]
    results = {}
    for name, planner in planners(trace).items():
        previous: np.ndarray | None = None
        planned, realised, moved, cpu_s = [], [], [], []
        for window in range(trace.windows):
            started = time.process_time()
            placement = planner(windows[window], previous)
            cpu_s.append(time.process_time() - started)
            planned.append(balancedness(placement, windows[window], trace.ranks))
            realised.append(balancedness(placement, windows[window + 1], trace.ranks))
            if previous is not None:
                moved.append(float(slots_needing_transfer(previous, placement, trace.ranks).mean()))
            previous = placement
        results[name] = {
            "balancedness": float(np.mean(planned)),
            "balancedness_min": float(np.min(planned)),
            "balancedness_next_window": float(np.mean(realised)),
            "moved_fraction": float(np.mean(moved)),
            "gb_moved_per_rebalance": float(np.mean(moved)) * trace.layers * trace.physical * DSV3_EXPERT_BYTES / 1e9,
            "plan_cpu_ms_median": 1000 * float(np.median(cpu_s)),
            "plan_cpu_ms_max": 1000 * float(np.max(cpu_s)),
        }
    return results


def render_markdown(runs: list[dict], command: str) -> str:
    lines = [
        f"Date: {time.strftime('%Y-%m-%d')}. Command: `{command}`. One run; each trace's windows are "
        f"Poisson samples of {TOKENS_PER_WINDOW:,} routed tokens per layer; the two algorithms see the same windows.",
        "",
        "| trace | layers × experts → slots, groups/nodes/ranks | balancedness DeepSeek → Flotilla | next window "
        "| slots moved per rebalance DeepSeek → Flotilla | DSV3-FP8 GB moved per rebalance | plan CPU ms (median, max) "
        "DeepSeek / Flotilla |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        t, ds, ours = run["trace"], run["results"]["deepseek"], run["results"]["flotilla"]
        lines.append(
            f"| {t['name']} | {t['layers']} × {t['logical']} → {t['physical']}, "
            f"{t['groups']}/{t['nodes']}/{t['ranks']} "
            f"| {ds['balancedness']:.3f} → **{ours['balancedness']:.3f}** "
            f"| {ds['balancedness_next_window']:.3f} → {ours['balancedness_next_window']:.3f} "
            f"| {100 * ds['moved_fraction']:.1f}% → **{100 * ours['moved_fraction']:.1f}%** "
            f"| {ds['gb_moved_per_rebalance']:.0f} → {ours['gb_moved_per_rebalance']:.0f} "
            f"| {ds['plan_cpu_ms_median']:.0f} ({ds['plan_cpu_ms_max']:.0f}) / "
            f"{ours['plan_cpu_ms_median']:.0f} ({ours['plan_cpu_ms_max']:.0f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traces", help="comma-separated trace names (default: all)")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    selected = [t for t in TRACES if args.traces is None or t.name in args.traces.split(",")]
    runs = []
    for trace in selected:
        results = run_trace(trace, args.seed)
        trace_info = {k: v for k, v in asdict(trace).items() if k != "expected_load"}
        runs.append({"trace": trace_info, "results": results})
        ds, ours = results["deepseek"], results["flotilla"]
        print(
            f"{trace.name}: balancedness {ds['balancedness']:.3f} -> {ours['balancedness']:.3f}, "
            f"moved {100 * ds['moved_fraction']:.1f}% -> {100 * ours['moved_fraction']:.1f}%, "
            f"plan {ours['plan_cpu_ms_median']:.0f} ms",
            flush=True,
        )
    command = "python -m bench.eplb_bench" + (f" --traces {args.traces}" if args.traces else "")
    markdown = render_markdown(runs, command)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "eplb_bench.json").write_text(json.dumps(runs, indent=2))
    (RESULTS / "eplb_bench.md").write_text(markdown + "\n")
    print(markdown)
    if not args.no_docs:
        from bench.common import write_docs_section

        write_docs_section("eplb_placement", markdown, "EPLB placement: Flotilla vs DeepSeek's algorithm")


if __name__ == "__main__":
    main()
