"""Routing benchmark over real vLLM engines: Flotilla's policies against the peers, side by side.

Four engines of ``bench-llama`` (prefill-heavy on CPU), each with ``--blocks`` KV blocks so the
shared prefixes of a workload do not all fit one engine (KV pressure). Arms:

* ``flotilla-rr`` / ``flotilla-ca``: Flotilla, 4 groups, ``round_robin`` / ``cache_aware`` (KV events);
* ``flotilla-ca-2ingress``: the same with 2 ingress replicas (HAProxy spreads requests over them);
* ``direct-rr`` / ``oracle``: 4 vLLM OpenAI servers, the client routing round-robin / by the
  workload's own prefix group (a router that knows every engine's cache and keeps them balanced);
* ``sglang``: SGLang's gateway (``sglang-router``, ``cache_aware``) in front of the same 4 servers;
* ``ray``: Ray Serve LLM, 4 replicas, ``PrefixCacheAffinityRouter``.

Engine-side hit rate is what the engines report per request (``usage.prompt_tokens_details.
cached_tokens``), not any router's belief. Caches are reset between arms where the stack allows
it (Flotilla, vLLM servers); Ray Serve LLM runs each workload once on fresh content.

    python -m bench.route_bench --arms flotilla,direct,sglang,ray --workloads gsp,hot,multiturn,nosharing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    ENGINE_ENV,
    RESULTS,
    Process,
    percentile,
    ray_serve_llm_script,
    wait_ready,
    wait_replicas_running,
    write_docs_section,
)
from bench.workloads import hot_prefix, multi_turn, no_sharing, shared_prefix
from devtools import REPO, wait_for
from flotilla.cluster.engine import cpu_compilation_config
from flotilla.config import ServeConfig
from flotilla.router.sim_cluster import Session

MODEL = REPO / "models" / "bench-llama"
MODEL_NAME = "bench-llama"
SECTION = "route_bench"
ADMIN_TOKEN = "bench-admin"
BASE_PORT = 18800


# --- workloads ------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    concurrency: int
    oracle_key: list[int]
    """Per session, the shared-prefix group it belongs to (the oracle routes by it)."""


def word_vocab() -> tuple[list[int], Callable[[list[int]], str]]:
    """Token ids that are single whole words: their text re-encodes to exactly those ids."""
    from transformers import AutoTokenizer

    from flotilla.cluster.tiny_models import WORDS

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    ids = sorted({t[0] for w in WORDS if len(t := tokenizer.encode(" " + w, add_special_tokens=False)) == 1})

    def text(tokens: list[int]) -> str:
        return tokenizer.decode(tokens)

    return ids, text


def workloads(names: list[str], vocab: list[int], seed: int) -> list[Workload]:
    made = []
    for name in names:
        if name == "gsp":
            sessions = shared_prefix(vocab, 8, 8, 1024, 64, 16, seed=seed)
            groups = {tuple(s.turns[0].prompt[:32]): i for i, s in enumerate(sessions)}
            keys = [groups.setdefault(tuple(s.turns[0].prompt[:32]), len(groups)) for s in sessions]
            firsts = list(dict.fromkeys(keys))
            made.append(Workload("gsp", sessions, 4, [firsts.index(k) for k in keys]))
        elif name == "hot":
            sessions = hot_prefix(vocab, 48, 1024, 64, 32, seed=seed + 1)
            made.append(Workload("hot", sessions, 8, list(range(len(sessions)))))
        elif name == "multiturn":
            sessions = multi_turn(vocab, 8, 4, 256, 96, 32, seed=seed + 2)
            made.append(Workload("multiturn", sessions, 4, list(range(len(sessions)))))
        elif name == "nosharing":
            sessions = no_sharing(vocab, 32, 1088, 16, seed=seed + 3)
            made.append(Workload("nosharing", sessions, 4, list(range(len(sessions)))))
        else:
            raise SystemExit(f"unknown workload {name}")
    return made


# --- the client --------------------------------------------------------------------------------------


@dataclass
class Sample:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    target: str


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[Sample, str]:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft, usage, text = None, {}, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                ttft = ttft or time.perf_counter() - started
                text.append(event["choices"][0].get("text") or "")
            usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    sample = Sample(
        ttft or float("nan"), usage["prompt_tokens"], details.get("cached_tokens") or 0, usage["completion_tokens"], url
    )
    return sample, "".join(text)


async def run_sessions(
    workload: Workload, text: Callable[[list[int]], str], route: Callable[[int, int], str]
) -> tuple[list[Sample], float]:
    """Each session's turns in order (a turn's prompt = history + new user text); ``concurrency`` at once."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(workload.sessions)):
        queue.put_nowait(index)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                history = ""
                previous: list[int] = []
                for turn_index, turn in enumerate(workload.sessions[index].turns):
                    new = turn.prompt[len(previous) :] if turn_index else turn.prompt
                    prompt = history + text(new)
                    sample, output = await _stream(client, route(index, turn_index), prompt, len(turn.output))
                    samples.append(sample)
                    history, previous = prompt + output, turn.prompt + turn.output

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
        return samples, time.perf_counter() - started


@dataclass
class RunResult:
    arm: str
    workload: str
    requests: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens_per_s: float
    load_max: int | None
    load_mean: float | None
    per_target: dict[str, int] = field(default_factory=dict)


def summarize(
    arm: str, workload: str, samples: list[Sample], wall_s: float, per_group: dict[str, int] | None
) -> RunResult:
    ttfts = sorted(s.ttft_s for s in samples)
    loads = per_group if per_group is not None else None
    return RunResult(
        arm=arm,
        workload=workload,
        requests=len(samples),
        hit_rate=sum(s.cached_tokens for s in samples) / max(1, sum(s.prompt_tokens for s in samples)),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        output_tokens_per_s=sum(s.completion_tokens for s in samples) / wall_s,
        load_max=max(loads.values()) if loads else None,
        load_mean=statistics.fmean(loads.values()) if loads else None,
        per_target=loads or {},
    )


# --- stacks --------------------------------------------------------------------------------------------


def metric_sum(text: str, name: str, label: str | None = None) -> dict[str, float]:
    """Sum of a Prometheus counter's samples, per value of ``label`` (or under "" when None)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                totals[sample.labels.get(label, "") if label else ""] += sample.value
    return dict(totals)


def prefix_cache_counters(text: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) in vLLM's prefix-cache counters in a Prometheus text, summed over every
    engine: ``vllm:prefix_cache_hits_total`` as vLLM exports it, under a prefix (``ray_vllm_…``) through
    Ray's metrics agent."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"hits": 0.0, "queries": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for kind in totals:
                if sample.name.endswith(f"vllm:prefix_cache_{kind}_total") or sample.name.endswith(
                    f"vllm_prefix_cache_{kind}_total"
                ):
                    totals[kind] += sample.value
    return totals["hits"], totals["queries"]


class FlotillaStack:
    def __init__(
        self, blocks: int, ingress_replicas: int, port: int, groups: int = 4, max_model_len: int = 4096
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        config = Path(tempfile.mkdtemp()) / "route-bench.yaml"
        config.write_text(
            f"model: {MODEL}\nserved_model_name: {MODEL_NAME}\ngroups: {groups}\nport: {port}\n"
            f"engine_args: {{num_gpu_blocks_override: {blocks}, max_model_len: {max_model_len}}}\n"
            f"cpu: {{threads_per_worker: 1}}\ningress: {{replicas: {ingress_replicas}}}\n"
        )
        # Routing counters are each replica's own: with several, read every replica's metrics port.
        metrics_port = ServeConfig.from_yaml(config).replica_metrics_port
        self.metrics_urls = (
            [f"http://127.0.0.1:{metrics_port + rank}/metrics" for rank in range(ingress_replicas)]
            if metrics_port is not None
            else [f"{self.url}/metrics"]
        )
        self.process = Process(
            f"flotilla-{ingress_replicas}ingress",
            [sys.executable, "-m", "flotilla.cli", "serve", "--config", str(config)],
            {"FLOTILLA_ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONUNBUFFERED": "1"},
            RESULTS,
        )
        wait_ready(self.url, self.process)

    def _admin(self, method: str, path: str, body: dict | None = None) -> None:
        response = httpx.request(
            method, f"{self.url}{path}", json=body, timeout=60, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        response.raise_for_status()

    def prepare(self, policy: str, params: dict[str, float] | None = None) -> None:
        """Route by ``policy`` from now on, every engine's prefix cache empty."""
        self._admin("PUT", "/admin/routing", {"policy": policy, "params": params or {}})
        self._admin("POST", "/admin/reset_prefix_cache")

    def engine_prefix_cache(self) -> tuple[float, float]:
        """(hit tokens, queried tokens) so far, summed over every group's engine (their own counters)."""
        return prefix_cache_counters(httpx.get(f"{self.url}/metrics", params={"scope": "cluster"}, timeout=30).text)

    def per_group(self) -> dict[str, float]:
        texts = [httpx.get(url, timeout=30).text for url in self.metrics_urls]
        return metric_sum("\n".join(texts), "flotilla_routing_decisions_total", "group")

    def stop(self) -> None:
        self.process.stop()


class VllmServers:
    def __init__(self, blocks: int, base_port: int, count: int = 4, max_model_len: int = 4096) -> None:
        self.urls = [f"http://127.0.0.1:{base_port + i}" for i in range(count)]
        self.processes = []
        for i in range(len(self.urls)):
            command = [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(MODEL),
                "--served-model-name",
                MODEL_NAME,
                "--host",
                "127.0.0.1",
                "--port",
                str(base_port + i),
                "--dtype",
                "float32",
                "--kv-cache-memory-bytes",
                str(512 << 20),
                "--enable-prefix-caching",
                "--num-gpu-blocks-override",
                str(blocks),
                "--max-model-len",
                str(max_model_len),
                "--compilation-config",
                json.dumps(cpu_compilation_config(1, 1)),
                "--enable-prompt-tokens-details",
            ]
            self.processes.append(Process(f"vllm-{i}", command, ENGINE_ENV | {"VLLM_SERVER_DEV_MODE": "1"}, RESULTS))
        for url, process in zip(self.urls, self.processes, strict=True):
            wait_ready(url, process)

    def reset(self) -> None:
        for url in self.urls:
            httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()

    def engine_prefix_cache(self) -> tuple[float, float]:
        """(hit tokens, queried tokens) so far, summed over the servers' engines (their own counters)."""
        texts = [httpx.get(f"{url}/metrics", timeout=30).text for url in self.urls]
        return prefix_cache_counters("\n".join(texts))

    def requests_served(self) -> dict[str, float]:
        return {
            url: sum(metric_sum(httpx.get(f"{url}/metrics", timeout=30).text, "vllm:request_success_total").values())
            for url in self.urls
        }

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def sglang_router_python() -> Path:
    """The Python of the venv holding SGLang's gateway; an error naming how to make it where there is none (a
    benchmark checks before its first arm, not after the ones before it have run)."""
    binary = REPO / ".bench-venvs" / "sglang" / "bin" / "python"
    if not binary.exists():
        raise RuntimeError(
            "sglang-router is not installed: python3 -m venv .bench-venvs/sglang && "
            ".bench-venvs/sglang/bin/pip install sglang-router==0.3.2"
        )
    return binary


class SglangRouter:
    def __init__(self, servers: VllmServers, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        binary = sglang_router_python()
        command = [
            str(binary),
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *servers.urls,
            "--policy",
            "cache_aware",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(port + 100),
        ]
        self.process = Process("sglang-router", command, {}, RESULTS)
        # Its /v1/models answers "unknown" for vLLM workers: probe a completion instead.
        if not wait_for(self._completes, 120, 1):
            raise TimeoutError("sglang-router did not become ready")

    def _completes(self) -> bool:
        try:
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}
            return httpx.post(f"{self.url}/v1/completions", json=body, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.process.stop()


class RayServeLlm:
    """Ray Serve LLM with its prefix-cache affinity router; Ray's dev ingress for ``/reset_prefix_cache``, and
    the engines' vLLM counters on Ray's metrics port (``port + 2``)."""

    def __init__(self, blocks: int, port: int, replicas: int = 4, max_model_len: int = 4096) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{port + 2}/metrics"
        script = ray_serve_llm_script(
            name=MODEL_NAME,
            model=MODEL,
            kv=512 << 20,
            blocks=blocks,
            max_model_len=max_model_len,
            port=port,
            replicas=replicas,
            deployment_extra=', "request_router_config": {"request_router_class": PrefixCacheAffinityRouter}',
            dashboard_port=port + 1,
            metrics_export_port=port + 2,
            dev_endpoints=True,
        )
        env = ENGINE_ENV | {"RAY_AUTH_MODE": "disabled", "FLOTILLA_CPU_RAY_PLUGIN": "0"}
        self.process = Process("ray-serve-llm", [sys.executable, "-c", script], env, RESULTS)
        wait_ready(self.url, self.process, timeout_s=1200)
        wait_replicas_running(f"http://127.0.0.1:{port + 1}", replicas, self.process)

    def reset(self) -> None:
        httpx.post(f"{self.url}/reset_prefix_cache", json={"model": MODEL_NAME}, timeout=60).raise_for_status()

    def engine_prefix_cache(self) -> tuple[float, float]:
        """(hit tokens, queried tokens) so far, summed over the replicas' engines, once Ray's metrics agent
        has them all: it exports what the replicas pushed at their last report (every few seconds), so
        the reading is taken when it stops changing."""
        readings: list[tuple[float, float]] = []

        def settled() -> bool:
            readings.append(prefix_cache_counters(httpx.get(self.metrics_url, timeout=30).text))
            return len(readings) >= 2 and readings[-1] == readings[-2]

        if not wait_for(settled, 120, 12):
            raise RuntimeError(f"Ray's engine counters did not settle: {readings[-3:]}")
        return readings[-1]

    def stop(self) -> None:
        self.process.stop()


# --- the run ---------------------------------------------------------------------------------------------


def measure_arm(
    arm: str,
    workload: Workload,
    text: Callable[[list[int]], str],
    route: Callable[[int, int], str],
    per_group: Callable[[], dict[str, float]] | None,
) -> RunResult:
    before = per_group() if per_group else None
    samples, wall = asyncio.run(run_sessions(workload, text, route))
    loads = None
    if per_group and before is not None:
        after = per_group()
        loads = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    elif not per_group:
        loads = dict(Counter(s.target for s in samples))
    result = summarize(arm, workload.name, samples, wall, loads)
    print(
        f"  {arm:22s} {workload.name:10s} hit={result.hit_rate:.3f} ttft50={result.ttft_p50_s * 1e3:7.0f}ms "
        f"p99={result.ttft_p99_s * 1e3:7.0f}ms tok/s={result.output_tokens_per_s:6.1f} load={result.per_target}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="flotilla,direct,sglang,ray", help="flotilla, flotilla2, direct, sglang, ray")
    parser.add_argument("--workloads", default="gsp,hot,multiturn,nosharing")
    parser.add_argument(
        "--two-ingress-workloads", default="gsp", help="workloads the flotilla2 arm (2 ingress replicas) runs"
    )
    parser.add_argument("--blocks", type=int, default=48, help="KV blocks (128 tokens) per engine")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument(
        "--resume", action="store_true", help="keep the arms already in bench/results/route_bench.json, run the rest"
    )
    args = parser.parse_args()
    arms = args.arms.split(",")
    if "sglang" in arms:
        sglang_router_python()
    subprocess.run([sys.executable, "-m", "flotilla.cli", "make-model", "bench-llama"], cwd=REPO, check=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    vocab, text = word_vocab()
    loads = workloads(args.workloads.split(","), vocab, args.seed)
    saved = RESULTS / f"{SECTION}.json"
    results: list[RunResult] = (
        [RunResult(**r) for r in json.loads(saved.read_text())] if args.resume and saved.exists() else []
    )

    def todo(arm: str, workload: Workload) -> bool:
        return not any((r.arm, r.workload) == (arm, workload.name) for r in results)

    def run_arm(arm: str, workload: Workload, *rest: Any) -> None:
        """One arm on one workload, unless already measured (``--resume``); saved at once."""
        if todo(arm, workload):
            results.append(measure_arm(arm, workload, *rest))
            saved.write_text(json.dumps([asdict(r) for r in results], indent=2))

    two_ingress = args.two_ingress_workloads.split(",")
    for replicas, enabled in ((1, "flotilla" in arms), (2, "flotilla2" in arms)):
        policies = ["round_robin", "cache_aware"] if replicas == 1 else ["cache_aware"]
        suffix = "-2ingress" if replicas == 2 else ""
        plan = [
            (f"flotilla-{'rr' if policy == 'round_robin' else 'ca'}{suffix}", policy, workload)
            for workload in (loads if replicas == 1 else [w for w in loads if w.name in two_ingress])
            for policy in policies
        ]
        plan = [(arm, policy, workload) for arm, policy, workload in plan if todo(arm, workload)]
        if not enabled or not plan:
            continue
        print(f"flotilla, {replicas} ingress replica(s)", flush=True)
        stack = FlotillaStack(args.blocks, replicas, BASE_PORT)
        try:
            for arm, policy, workload in plan:
                stack.prepare(policy)
                run_arm(arm, workload, text, lambda s, t, url=stack.url: url, stack.per_group)
        finally:
            stack.stop()

    peers = [(a, w) for w in loads for a in ("direct-rr", "oracle", "sglang") if a.split("-")[0] in arms]
    if any(todo(a, w) for a, w in peers):
        print("vLLM OpenAI servers", flush=True)
        servers = VllmServers(args.blocks, BASE_PORT + 10)
        try:
            for workload in loads:
                if "direct" in arms and todo("direct-rr", workload):
                    servers.reset()
                    turn = iter(range(10**9))
                    run_arm("direct-rr", workload, text, lambda s, t, turn=turn: servers.urls[next(turn) % 4], None)
                if "direct" in arms and todo("oracle", workload):
                    servers.reset()
                    run_arm("oracle", workload, text, lambda s, t, w=workload: servers.urls[w.oracle_key[s] % 4], None)
                if "sglang" in arms and todo("sglang", workload):
                    servers.reset()
                    router = SglangRouter(servers, BASE_PORT + 20)
                    try:
                        run_arm("sglang", workload, text, lambda s, t, url=router.url: url, servers.requests_served)
                    finally:
                        router.stop()
        finally:
            servers.stop()

    if "ray" in arms:
        for workload in [w for w in loads if todo("ray", w)]:  # fresh deployment per workload: no cache reset
            print("Ray Serve LLM", flush=True)
            stack = RayServeLlm(args.blocks, BASE_PORT + 30)
            try:
                run_arm("ray", workload, text, lambda s, t, url=stack.url: url, None)
            finally:
                stack.stop()

    report = render(results, args, "python -m bench.route_bench " + " ".join(sys.argv[1:]))
    saved.write_text(json.dumps([asdict(r) for r in results], indent=2))
    (RESULTS / f"{SECTION}.md").write_text(report + "\n")
    if not args.no_docs:
        write_docs_section(
            SECTION, report, "Routing on real vLLM engines: Flotilla vs SGLang's gateway and Ray Serve LLM"
        )
    print(report)


def render(results: list[RunResult], args: argparse.Namespace, command: str) -> str:
    lines = [
        f"Date: {date.today().isoformat()}. Command: `{command.strip()}`.",
        f"4 engines of `bench-llama` (float32, CPU, 1 thread each, {args.blocks} KV blocks × 128 tokens each), "
        "all on this 2-core machine. Hit rate = engine-reported cached prompt tokens / prompt tokens.",
        "",
        "| workload | arm | hit rate | TTFT p50 | TTFT p99 | output tok/s | requests per engine |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per = "/".join(str(v) for v in sorted(r.per_target.values(), reverse=True)) if r.per_target else "n/a"
        lines.append(
            f"| {r.workload} | {r.arm} | {r.hit_rate:.3f} | {r.ttft_p50_s * 1e3:.0f} ms | "
            f"{r.ttft_p99_s * 1e3:.0f} ms | {r.output_tokens_per_s:.1f} | {per} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
