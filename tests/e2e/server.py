"""Run `flotilla serve` as a subprocess, exactly as `make serve` does (only the port differs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from devtools import REPO, stop_gracefully, wait_serving
from flotilla.cluster.engine import cpu_compilation_config
from flotilla.cluster.ports import free_port, free_port_run

STARTUP_TIMEOUT_S = 600
SHUTDOWN_TIMEOUT_S = 90
REPLICA_METRICS_PORTS = 4  # a free run this long, for configs of up to 4 ingress replicas
REPLICA_METRICS = re.compile(r"each ingress replica's own metrics: http://([^:/]+):(\d+)(?:\.\.(\d+))?/metrics")


@dataclass
class Server:
    url: str
    ray_address: str
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "\n".join(self.lines)

    def replica_metrics_targets(self) -> list[str]:
        """host:port of every ingress replica's own metrics, as the launcher announced them."""
        found = REPLICA_METRICS.search(self.output())
        if found is None:
            return []
        first, last = int(found[2]), int(found[3] or found[2])
        return [f"{found[1]}:{port}" for port in range(first, last + 1)]

    def metrics(self) -> str:
        """Every ingress replica's own series (scraped from its metrics port, as the chart's ServiceMonitor does)
        and the cluster's (``/metrics?scope=cluster`` on the serving port): one scrape of the serving port
        reaches one replica only."""
        targets = self.replica_metrics_targets()
        if not targets:
            return httpx.get(f"{self.url}/metrics", timeout=30).text
        texts = [httpx.get(f"http://{target}/metrics", timeout=30).text for target in targets]
        texts.append(httpx.get(f"{self.url}/metrics", params={"scope": "cluster"}, timeout=30).text)
        return "\n".join(texts)


@contextmanager
def flotilla_serve(
    config: str = "examples/local-cpu.yaml",
    env: dict[str, str] | None = None,
    port: int | None = None,
    metrics_port: int | None = None,
    ingress_replicas: int | None = 1,
) -> Iterator[Server]:
    """``metrics_port``: the replicas' own metrics ports start there (default: a free run of ports, so a
    server started while another one runs never meets its ports).

    ``ingress_replicas``: how many ingress replicas where the config names no count; ``None`` keeps the
    product's default (2). One by default here: each replica costs about 15 s of CPU at every start on
    this 2-core machine; the modules about replicas and the default config (``test_ingress_replicas``,
    ``test_serve_openai``, ``test_prometheus``) run them as users do."""
    config = with_ingress_replicas(config, ingress_replicas)
    port = port or free_port()
    metrics_port = metrics_port or free_port_run(REPLICA_METRICS_PORTS)
    command = ["serve", "--config", config, "--port", str(port), "--metrics-port", str(metrics_port)]
    process = subprocess.Popen(
        [sys.executable, "-m", "flotilla.cli", *command],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}),
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "flotilla: serving" in line:
                ready.set()
        ready.set()  # process ended

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(STARTUP_TIMEOUT_S) or process.poll() is not None:
            raise RuntimeError("flotilla serve did not become ready:\n" + "\n".join(lines[-60:]))
        address = next(
            m.group(1) or m.group(2)
            for line in lines
            if (m := re.search(r"local Ray cluster: .* at (\S+) in|joined Ray cluster at (\S+)", line))
        )
        yield Server(f"http://127.0.0.1:{port}", address, process, lines)
    finally:
        stop_gracefully(process, SHUTDOWN_TIMEOUT_S)


def with_ingress_replicas(config: str, replicas: int | None) -> str:
    """``config``, or a copy that runs ``replicas`` ingress replicas when it names no count itself."""
    raw = yaml.safe_load((REPO / config).read_text()) or {}
    ingress = raw.get("ingress") or {}
    if replicas is None or "replicas" in ingress:
        return config
    raw["ingress"] = ingress | {"replicas": replicas}
    copy = Path(tempfile.mkdtemp(prefix="flotilla-config-")) / Path(config).name
    copy.write_text(yaml.safe_dump(raw))
    return str(copy)


# vLLM's own server with the engine settings Flotilla gives its CPU groups (cluster/engine.py).
VLLM_CPU_ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--kv-cache-memory-bytes",
    str(512 << 20),
    "--enable-prefix-caching",
    "--compilation-config",
    json.dumps(cpu_compilation_config(1, 1)),
]


@contextmanager
def vllm_serve(model: Path, served_name: str, flags: list[str]) -> Iterator[str]:
    """vLLM's OpenAI server (its default executor) on a free port; yields its URL once it answers."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
        *VLLM_CPU_ENGINE_FLAGS, *flags,
    ]  # fmt: skip
    env = os.environ | {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_serving(f"{url}/health", process, STARTUP_TIMEOUT_S, "vLLM's server")
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"{err}:\n" + "".join(lines[-60:])) from None
        yield url
    finally:
        stop_gracefully(process, SHUTDOWN_TIMEOUT_S)
