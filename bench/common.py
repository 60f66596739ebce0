"""What every benchmark shares: where results go, the docs section writer, server processes, Ray Serve LLM.

Benchmarks import this module (and ``devtools``), never each other.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from devtools import REPO, stop_gracefully, wait_for, wait_serving
from flotilla.cluster.engine import cpu_compilation_config
from flotilla.cluster.ports import free_port

RESULTS = REPO / "bench" / "results"
ENGINE_ENV = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""Environment of every engine process a benchmark starts (one OpenMP thread each on this small machine)."""
DOCS = REPO / "docs" / "benchmarks.md"


def write_docs_section(section: str, body: str, title: str) -> None:
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    block = f"{start}\n{body}\n{end}"
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"
    DOCS.write_text(text)


def publish(section: str, title: str, report: str, data: dict[str, Any], docs: bool) -> None:
    """A run's results: bench/results/SECTION.{json,md}, its docs/benchmarks.md section (``docs``), stdout."""
    (RESULTS / f"{section}.json").write_text(json.dumps(data, indent=2))
    (RESULTS / f"{section}.md").write_text(report + "\n")
    if docs:
        write_docs_section(section, report, title)
    print(report)


# --- server processes --------------------------------------------------------------------------------------


class Process:
    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log = (log_dir / f"{name}.log").open("ab")
        self.process = subprocess.Popen(command, cwd=REPO, env=os.environ | env, stdout=self.log, stderr=self.log)

    def stop(self) -> None:
        stop_gracefully(self.process)


def start_flotilla(name: str, model: str, groups: int, env: dict[str, str] | None = None) -> tuple[str, Process]:
    """``flotilla serve`` of ``models/MODEL`` with ``groups`` groups (one OpenMP thread per worker) on a free
    port; its URL and process (not ready yet: see :func:`wait_ready`)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = Path(tempfile.mkdtemp()) / f"{name}.yaml"
    config.write_text(
        f"model: {REPO / 'models' / model}\nserved_model_name: {model}\ngroups: {groups}\nport: {port}\n"
        "cpu: {threads_per_worker: 1}\n"
    )
    command = [sys.executable, "-m", "flotilla.cli", "serve", "--config", str(config)]
    return f"http://127.0.0.1:{port}", Process(name, command, env or {}, RESULTS)


def wait_ready(url: str, process: Process, timeout_s: float = 900) -> None:
    wait_serving(f"{url}/v1/models", process.process, timeout_s, f"{process.name} (log: {RESULTS})")


# --- Ray Serve LLM, the peer stack of the routing and fault benchmarks -----------------------------------


RAY_APP = """
import os, signal, sys, time
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app
from ray.serve.llm.request_router import PrefixCacheAffinityRouter
from ray.llm._internal.serve.core.ingress.dev_ingress import build_dev_openai_app
import ray
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # threads started below inherit it
ray.init(num_cpus=16, include_dashboard=%(dashboard)s, dashboard_host="127.0.0.1", dashboard_port=%(dashboard_port)d,
         _metrics_export_port=%(metrics_export_port)s)
config = LLMConfig(
    model_loading_config={"model_id": "%(name)s", "model_source": "%(model)s"},
    accelerator_config={"kind": "cpu"},
    placement_group_config={"bundles": [{"CPU": 1}]},
    engine_kwargs={"dtype": "float32", "kv_cache_memory_bytes": %(kv)d, "enable_prefix_caching": True,
                   "num_gpu_blocks_override": %(blocks)d, "max_model_len": %(max_model_len)d,
                   "enable_prompt_tokens_details": True,
                   "compilation_config": %(compilation_config)r},
    deployment_config={"num_replicas": %(replicas)d%(deployment_extra)s},
)
serve.start(http_options={"host": "127.0.0.1", "port": %(port)d})
serve.run((build_dev_openai_app if %(dev_endpoints)s else build_openai_app)({"llm_configs": [config]}), blocking=False)
signal.sigwait({signal.SIGINT, signal.SIGTERM})
serve.shutdown()
ray.shutdown()
"""


def ray_serve_llm_script(**fields: Any) -> str:
    """RAY_APP with ``fields``; unless given: no extra deployment options, a dashboard, Ray's own choice of
    metrics port, and the plain OpenAI app (``dev_endpoints``: Ray's dev ingress, with ``/reset_prefix_cache``)."""
    defaults = {
        "deployment_extra": "",
        "dashboard": True,
        "metrics_export_port": None,
        "dev_endpoints": False,
        "compilation_config": cpu_compilation_config(1, 1),  # Flotilla's CPU setting for one rank (cluster.engine)
    }
    return RAY_APP % (defaults | fields)


def serve_running_replicas(dashboard: str) -> dict[str, int] | None:
    """replica id → pid of the LLM deployment's RUNNING replicas, from Ray Serve's REST API; None: no answer."""
    try:
        apps = httpx.get(f"{dashboard}/api/serve/applications/", timeout=10).json()["applications"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return {
        replica["replica_id"]: int(replica.get("pid") or 0)
        for app in apps.values()
        for name, deployment in app["deployments"].items()
        if "LLM" in name
        for replica in deployment["replicas"]
        if replica["state"] == "RUNNING"
    }


def wait_replicas_running(dashboard: str, replicas: int, process: Process, timeout_s: float = 1200) -> None:
    """/v1/models answers as soon as one replica runs; measure only once every replica does."""

    def all_running() -> bool:
        if process.process.poll() is not None:
            raise RuntimeError(f"{process.name} exited; see its log in {RESULTS}")
        return len(serve_running_replicas(dashboard) or {}) >= replicas

    if not wait_for(all_running, timeout_s, 1):
        raise RuntimeError(f"{process.name}: {replicas} replicas not running; see its log in {RESULTS}")


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile."""
    if not sorted_values:
        return float("nan")
    rank = max(1, round(pct / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]
