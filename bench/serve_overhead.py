"""Flotilla (1 group) against vLLM's own OpenAI server, same engine settings, same prompts.

Targets, each started fresh, alternated over rounds so machine noise hits all alike:

* ``flotilla``  — ``flotilla serve``: Serve proxy → ingress → group leader → vLLM (Ray executor)
* ``vllm-uni``  — ``python -m vllm.entrypoints.openai.api_server`` with its default executor
* ``vllm-ray``  — the same server with ``--distributed-executor-backend ray`` on a local Ray
  head, i.e. the same engine processes as a Flotilla group; the difference is the front end

Phases per target: warm-up, then ``latency`` (concurrency 1: TTFT without queueing), then
``throughput`` (concurrency N: output tokens/s). Results: bench/results/serve_overhead.{json,md}
and the "Serving overhead" section of docs/benchmarks.md.

    python -m bench.serve_overhead --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

import httpx

from bench.common import RESULTS, write_docs_section
from bench.loadgen import run_load
from devtools import REPO, stop_gracefully, wait_serving
from flotilla.cluster.tiny_models import WORDS

SECTION = "serve_overhead"
MODEL_NAME = "bench-model"
KV_CACHE_BYTES = 512 << 20
ENGINE_ENV = {"TORCHDYNAMO_DISABLE": "1", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
VLLM_ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--kv-cache-memory-bytes",
    str(KV_CACHE_BYTES),
    "--enable-prefix-caching",
    "--compilation-config",
    '{"mode": 2, "backend": "eager"}',
]


def make_prompts(model_dir: Path, count: int, prompt_tokens: int, seed: int) -> list[str]:
    """Distinct word prompts, each cut to exactly ``prompt_tokens`` tokens of the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [f"#{i}"] + rng.choices(WORDS, k=prompt_tokens)
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:prompt_tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


class Target:
    """A server process (and its helpers) that can be started and stopped."""

    name: str

    def __init__(self, model_dir: Path, port: int, log_dir: Path, threads: int) -> None:
        self.model_dir = model_dir
        self.threads = threads
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return os.environ | ENGINE_ENV | {"OMP_NUM_THREADS": str(self.threads)}

    def start(self, timeout_s: float = 600) -> float:
        began = time.monotonic()
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.command(), cwd=REPO, env=self.env(), stdout=log, stderr=log)
        wait_serving(f"{self.url}/v1/models", self.process, timeout_s, f"{self.name} (log: {self.log_path})")
        return time.monotonic() - began

    def stop(self) -> None:
        if self.process:
            stop_gracefully(self.process)


class FlotillaTarget(Target):
    name = "flotilla"

    def command(self) -> list[str]:
        config = Path(tempfile.mkdtemp()) / "bench.yaml"
        config.write_text(
            f"model: {self.model_dir}\nserved_model_name: {MODEL_NAME}\ngroups: 1\n"
            f"cpu: {{kv_cache_memory_bytes: {KV_CACHE_BYTES}, threads_per_worker: {self.threads}}}\n"
            f"port: {self.port}\n"
        )
        return [sys.executable, "-m", "flotilla.cli", "serve", "--config", str(config)]

    def env(self) -> dict[str, str]:
        env = super().env()
        env.pop("RAY_AUTH_MODE")  # flotilla manages its own local cluster
        return env


class VllmTarget(Target):
    name = "vllm-uni"
    executor_flags: list[str] = []

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *VLLM_ENGINE_FLAGS,
            *self.executor_flags,
        ]


class VllmRayTarget(VllmTarget):
    name = "vllm-ray"
    executor_flags = ["--distributed-executor-backend", "ray"]
    ray_port = 6391

    def env(self) -> dict[str, str]:
        return super().env() | {"RAY_ADDRESS": f"127.0.0.1:{self.ray_port}"}

    def start(self, timeout_s: float = 600) -> float:
        subprocess.run(
            [
                str(Path(sys.executable).parent / "ray"),
                "start",
                "--head",
                f"--port={self.ray_port}",
                "--num-gpus=1",
                f"--num-cpus={os.cpu_count()}",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            env=self.env(),
            check=True,
            capture_output=True,
        )
        return super().start(timeout_s)

    def stop(self) -> None:
        super().stop()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)


TARGETS = {cls.name: cls for cls in (FlotillaTarget, VllmTarget, VllmRayTarget)}


def engine_ttft_totals(url: str) -> tuple[float, float]:
    """(sum, count) of vLLM's own TTFT histogram, over every engine behind ``url``."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"_sum": 0.0, "_count": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name == "vllm:time_to_first_token_seconds":
            for sample in family.samples:
                for suffix in totals:
                    if sample.name.endswith(suffix):
                        totals[suffix] += sample.value
    return totals["_sum"], totals["_count"]


def bodies(prompts: list[str], max_tokens: int) -> list[dict]:
    return [
        {"model": MODEL_NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]


def measure(target: Target, args: argparse.Namespace, round_index: int) -> dict:
    startup_s = target.start()
    try:
        seed = 1000 * round_index
        warm = make_prompts(args.model, 4, args.prompt_tokens, seed + 1)
        asyncio.run(run_load(target.url, bodies(warm, 8), 2))
        latency_prompts = make_prompts(args.model, args.latency_requests, args.prompt_tokens, seed + 2)
        engine_before = engine_ttft_totals(target.url)
        latency = asyncio.run(run_load(target.url, bodies(latency_prompts, args.max_tokens), 1))
        engine_after = engine_ttft_totals(target.url)
        engine_ttft_mean_s = (engine_after[0] - engine_before[0]) / max(1.0, engine_after[1] - engine_before[1])
        throughput = asyncio.run(
            run_load(
                target.url,
                bodies(make_prompts(args.model, args.requests, args.prompt_tokens, seed + 3), args.max_tokens),
                args.concurrency,
            )
        )
    finally:
        target.stop()
    return {
        "target": target.name,
        "round": round_index,
        "startup_s": startup_s,
        "engine_ttft_mean_c1_s": engine_ttft_mean_s,
        "latency": asdict(latency),
        "throughput": asdict(throughput),
    }


def median_of(runs: list[dict], phase: str, field: str) -> float:
    return statistics.median(run[phase][field] for run in runs)


def summarize(runs: list[dict], targets: list[str]) -> list[dict]:
    rows = []
    for name in targets:
        mine = [r for r in runs if r["target"] == name]
        rows.append(
            {
                "target": name,
                "rounds": len(mine),
                "tokens_per_s": median_of(mine, "throughput", "output_tokens_per_s"),
                "ttft_p50_c1_ms": 1000 * median_of(mine, "latency", "ttft_p50_s"),
                "ttft_p99_c1_ms": 1000 * median_of(mine, "latency", "ttft_p99_s"),
                "ttft_p50_cN_ms": 1000 * median_of(mine, "throughput", "ttft_p50_s"),
                "ttft_p99_cN_ms": 1000 * median_of(mine, "throughput", "ttft_p99_s"),
                "startup_s": statistics.median(r["startup_s"] for r in mine),
                "front_end_ttft_ms": 1000
                * statistics.median(r["latency"]["ttft_mean_s"] - r["engine_ttft_mean_c1_s"] for r in mine),
            }
        )
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    by_name = {row["target"]: row for row in rows}
    lines = [
        f"Date: {date.today().isoformat()}. Command: `{command}`.",
        f"Model `{args.model.name}` (float32, CPU), 1 group / 1 engine, TP=1, {args.threads} thread(s), "
        f"KV cache {KV_CACHE_BYTES >> 20} MiB, prefix caching on. Prompts: {args.prompt_tokens} tokens, distinct; "
        f"{args.max_tokens} output tokens "
        f"(ignore_eos); latency phase {args.latency_requests} requests at concurrency 1, throughput phase "
        f"{args.requests} requests at concurrency {args.concurrency}. Medians over {args.rounds} alternating rounds.",
        "",
        "| target | output tok/s (conc N) | TTFT p50 conc 1 | TTFT p99 conc 1 | TTFT p50 conc N | TTFT p99 conc N "
        "| TTFT outside the engine (conc 1, mean) | startup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['target']} | {row['tokens_per_s']:.1f} | {row['ttft_p50_c1_ms']:.1f} ms | "
            f"{row['ttft_p99_c1_ms']:.1f} ms | {row['ttft_p50_cN_ms']:.1f} ms | {row['ttft_p99_cN_ms']:.1f} ms | "
            f"{row['front_end_ttft_ms']:.1f} ms | {row['startup_s']:.0f} s |"
        )
    flotilla = by_name.get("flotilla")
    if flotilla:
        lines.append("")
        for peer in ("vllm-uni", "vllm-ray"):
            if peer in by_name:
                other = by_name[peer]
                ratio = flotilla["tokens_per_s"] / other["tokens_per_s"]
                lines.append(
                    f"- Flotilla vs {peer}: throughput ratio **{ratio:.3f}×**; "
                    f"TTFT p50 at concurrency 1 **{flotilla['ttft_p50_c1_ms'] - other['ttft_p50_c1_ms']:+.1f} ms**; "
                    f"at concurrency {args.concurrency} {flotilla['ttft_p50_cN_ms'] - other['ttft_p50_cN_ms']:+.1f} ms."
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama")
    parser.add_argument("--targets", default="vllm-uni,flotilla,vllm-ray")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--latency-requests", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of the (one) model worker")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    args.model = args.model.resolve()
    targets = args.targets.split(",")
    unknown = set(targets) - TARGETS.keys()
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; choose from {sorted(TARGETS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_index in range(args.rounds):
        for name in targets:
            target = TARGETS[name](args.model, args.port, RESULTS, args.threads)
            print(f"round {round_index + 1}/{args.rounds}: {name} …", flush=True)
            runs.append(measure(target, args, round_index))
            t = runs[-1]["throughput"]
            print(
                f"  {t['output_tokens_per_s']:.1f} tok/s, TTFT p50 c1 "
                f"{1000 * runs[-1]['latency']['ttft_p50_s']:.1f} ms",
                flush=True,
            )
    rows = summarize(runs, targets)
    command = "python -m bench.serve_overhead " + " ".join(sys.argv[1:])
    report = markdown(rows, args, command.strip())
    (RESULTS / f"{SECTION}.json").write_text(
        json.dumps({"args": vars(args) | {"model": str(args.model)}, "runs": runs, "summary": rows}, indent=2)
    )
    (RESULTS / f"{SECTION}.md").write_text(report + "\n")
    if not args.no_docs:
        write_docs_section(SECTION, report, "Serving overhead: Flotilla vs vLLM's own server")
    print(report)


if __name__ == "__main__":
    main()
