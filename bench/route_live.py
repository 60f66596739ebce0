"""Routing policies switched live on one Flotilla, and the peers on the same engines, load from vLLM's
`bench serve` `prefix_repetition` dataset.

One `flotilla serve` with 2 groups of ``bench-llama`` whose KV caches (``--blocks`` each) together
hold a workload's prefixes but neither alone does. For each workload, every policy in turn: switch
it with ``PUT /admin/routing``, empty every engine's prefix cache, then run vLLM's own benchmark
client (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``) with the same seed, so
each policy sees the same prompts in the same order. Hit rate comes from the engines' own
prefix-cache counters (``vllm:prefix_cache_hits_total`` / ``queries_total`` in ``/metrics``),
not from the router's belief. Workloads ``c4``, ``c8`` and ``short`` run closed-loop at their concurrency;
``rate`` sends requests open-loop, at 2 per second (Poisson), at most 16 in flight.
``cache_aware (previous)`` is the policy as it was before it kept a
prefix on the groups owning it (``keep_prefix_owners: false``). With ``--rounds N`` every arm runs N
times, a seed per round (Flotilla's policies in a rotated order, so none always runs first), and the table
shows medians, the rounds' TTFT p50s beside them: one run of 72–96 requests moves by more than the
policies differ.

The peers, in the same run, on engines with the same settings (2 engines, ``--blocks`` each, one
OpenMP thread): ``sglang``, SGLang's gateway (``cache_aware``) in front of 2 vLLM OpenAI servers;
``ray``, Ray Serve LLM with 2 replicas and its ``PrefixCacheAffinityRouter``. Their prefix caches
are emptied before each workload too, and their hit rates are the engines' counters as well.

    python -m bench.route_live [--blocks 48] [--rounds 3] [--workloads c4,c8,short,rate] [--arms flotilla,sglang,ray]
        [--policies prefix_only,cache_aware] [--prompts 768]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import date
from functools import partial
from statistics import median
from typing import Any, Protocol

from bench.common import RESULTS, publish
from bench.route_bench import (
    MODEL,
    MODEL_NAME,
    FlotillaStack,
    RayServeLlm,
    SglangRouter,
    VllmServers,
    sglang_router_python,
)
from devtools import REPO

SECTION = "route_live"
PORT = 18700
MAX_MODEL_LEN = 2048
"""vLLM wants one request of max_model_len to fit the KV cache: few blocks, shorter limit (prompts < 2048)."""
POLICIES: list[tuple[str, str, dict[str, float]]] = [
    ("round_robin", "round_robin", {}),
    ("prefix_only", "prefix_only", {}),
    ("cache_aware", "cache_aware", {}),
    ("cache_aware (previous)", "cache_aware", {"keep_prefix_owners": 0.0}),
]


@dataclass(frozen=True)
class Workload:
    name: str
    prefix_len: int
    suffix_len: int
    prefixes: int
    output_len: int
    prompts: int
    concurrency: int
    """At most this many requests in flight (``--max-concurrency``)."""
    request_rate: float | None = None
    """Open loop: requests sent at this Poisson rate per second (``--request-rate``), still capped by concurrency."""


WORKLOADS = {
    "c4": Workload("6 × 1024-token prefixes + 64, 16 out, c4", 1024, 64, 6, 16, 72, 4),
    "c8": Workload("6 × 1024-token prefixes + 64, 16 out, c8", 1024, 64, 6, 16, 96, 8),
    "short": Workload("12 × 512-token prefixes + 128, 32 out, c4", 512, 128, 12, 32, 72, 4),
    "rate": Workload("6 × 1024-token prefixes + 64, 16 out, 2 req/s, ≤ 16", 1024, 64, 6, 16, 96, 16, 2.0),
}


@dataclass(frozen=True)
class Run:
    workload: str
    policy: str
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tokens_per_s: float
    round: int = 1


def bench_serve(url: str, workload: Workload, seed: int) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", MODEL_NAME, "--tokenizer", str(MODEL), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(workload.prefix_len),
        "--prefix-repetition-suffix-len", str(workload.suffix_len),
        "--prefix-repetition-num-prefixes", str(workload.prefixes),
        "--prefix-repetition-output-len", str(workload.output_len), "--ignore-eos",
        "--num-prompts", str(workload.prompts), "--max-concurrency", str(workload.concurrency),
        *(["--request-rate", str(workload.request_rate)] if workload.request_rate else []),
        "--seed", str(seed), "--percentile-metrics", "ttft", "--metric-percentiles", "50,99", "--disable-tqdm",
    ]  # fmt: skip
    result: dict[str, Any] = main(parser.parse_args(argv))
    if result["completed"] != workload.prompts:
        raise RuntimeError(f"{result['completed']} of {workload.prompts} requests completed")
    return result


class Stack(Protocol):
    url: str

    def engine_prefix_cache(self) -> tuple[float, float]: ...


def warm_up(stack: Stack, workload: Workload) -> None:
    """The workload's shape with other prompts (another seed): compiled paths, tokenizer, connections."""
    bench_serve(stack.url, workload, seed=1)


def measure(stack: Stack, workload: Workload, label: str, reset: Callable[[], None], round_number: int) -> Run:
    """One measured run: every engine's prefix cache emptied (``reset``), then the workload's prompts (each
    round its own seed, every arm the same)."""
    reset()
    hits_before, queries_before = stack.engine_prefix_cache()
    result = bench_serve(stack.url, workload, seed=6 + round_number)
    hits, queries = stack.engine_prefix_cache()
    run = Run(
        workload.name,
        label,
        (hits - hits_before) / max(1.0, queries - queries_before),
        result["median_ttft_ms"],
        result["p99_ttft_ms"],
        result["output_throughput"],
        round_number,
    )
    print(f"  {run}", flush=True)
    return run


def render(runs: list[Run], args: argparse.Namespace, command: str) -> str:
    rounds = (
        f" Medians over {args.rounds} rounds (Flotilla's policies in a rotated order each round)."
        if args.rounds > 1
        else ""
    )
    per_round = " TTFT p50 per round |" if args.rounds > 1 else ""
    lines = [
        f"Date: {date.today().isoformat()}. Command: `{command.strip()}`. One `flotilla serve`, 2 groups of "
        f"`bench-llama` (float32, CPU, 1 thread each, {args.blocks} KV blocks × 128 tokens each), policies switched "
        "live with `PUT /admin/routing`; the peers on 2 engines with the same settings: `sglang` = SGLang's gateway "
        "(`cache_aware`) in front of 2 vLLM OpenAI servers, `ray` = Ray Serve LLM, 2 replicas, "
        "`PrefixCacheAffinityRouter`. Every engine's prefix cache emptied before each run; load: vLLM's `bench serve` "
        "client, `prefix_repetition` dataset, same seed for every arm (a seed per round). Hit rate: the engines' own "
        f"counters.{rounds}",
        "",
        "| workload | policy | hit rate | TTFT p50 | TTFT p99 | output tok/s |" + per_round,
        "|---|---|---|---|---|---|" + ("---|" if per_round else ""),
    ]
    arms: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        arms.setdefault((r.workload, r.policy), []).append(r)
    for (workload, policy), arm in arms.items():
        line = (
            f"| {workload} | {policy} | {median(r.hit_rate for r in arm):.3f} | "
            f"{median(r.ttft_p50_ms for r in arm):.0f} ms | {median(r.ttft_p99_ms for r in arm):.0f} ms | "
            f"{median(r.output_tokens_per_s for r in arm):.1f} |"
        )
        if per_round:
            line += " " + " · ".join(f"{r.ttft_p50_ms:.0f}" for r in sorted(arm, key=lambda r: r.round)) + " ms |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=48, help="KV blocks (128 tokens) per group")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {sorted(WORKLOADS)}")
    parser.add_argument("--arms", default="flotilla,sglang,ray", help="flotilla (its --policies), sglang, ray")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every arm and workload; the table shows medians")
    parser.add_argument(
        "--policies", default=",".join(label for label, _, _ in POLICIES), help="Flotilla's arms, by their labels"
    )
    parser.add_argument("--prompts", type=int, help="requests per run instead of each workload's own count")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    labels, chosen = [label for label, _, _ in POLICIES], args.policies.split(",")
    if unknown := sorted(set(chosen) - set(labels)):
        parser.error(f"unknown policies {unknown}: of {labels}")
    arms = args.arms.split(",")
    if "sglang" in arms:
        sglang_router_python()
    subprocess.run([sys.executable, "-m", "flotilla.cli", "make-model", "bench-llama"], cwd=REPO, check=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    workloads = [WORKLOADS[key] for key in args.workloads.split(",")]
    if args.prompts:
        workloads = [replace(w, name=f"{w.name}, {args.prompts} prompts", prompts=args.prompts) for w in workloads]
    policies = [arm for arm in POLICIES if arm[0] in chosen]
    runs = []
    if "flotilla" in arms:
        flotilla = FlotillaStack(args.blocks, 1, PORT, groups=2, max_model_len=MAX_MODEL_LEN)
        try:
            for workload in workloads:
                warm_up(flotilla, workload)
                for round_index in range(args.rounds):
                    turn = round_index % len(policies)
                    for label, policy, params in policies[turn:] + policies[:turn]:
                        prepare = partial(flotilla.prepare, policy, params)
                        runs.append(measure(flotilla, workload, label, prepare, round_index + 1))
        finally:
            flotilla.stop()
    if "sglang" in arms:
        servers = VllmServers(args.blocks, PORT + 10, count=2, max_model_len=MAX_MODEL_LEN)
        try:
            router = SglangRouter(servers, PORT + 20)
            try:
                sglang = PeerStack(router.url, servers)
                for workload in workloads:
                    warm_up(sglang, workload)
                    for round_index in range(args.rounds):
                        runs.append(measure(sglang, workload, "sglang", servers.reset, round_index + 1))
            finally:
                router.stop()
        finally:
            servers.stop()
    if "ray" in arms:
        ray_llm = RayServeLlm(args.blocks, PORT + 30, replicas=2, max_model_len=MAX_MODEL_LEN)
        try:
            for workload in workloads:
                warm_up(ray_llm, workload)
                for round_index in range(args.rounds):
                    runs.append(measure(ray_llm, workload, "ray", ray_llm.reset, round_index + 1))
        finally:
            ray_llm.stop()
    report = render(runs, args, "python -m bench.route_live " + " ".join(sys.argv[1:]))
    publish(
        SECTION,
        "Routing policies switched live, load from vLLM's bench serve",
        report,
        {"runs": [asdict(r) for r in runs]},
        not args.no_docs,
    )


@dataclass(frozen=True)
class PeerStack:
    """A router's URL, and the engines behind it whose counters give the hit rate."""

    url: str
    servers: VllmServers

    def engine_prefix_cache(self) -> tuple[float, float]:
        return self.servers.engine_prefix_cache()


if __name__ == "__main__":
    main()
