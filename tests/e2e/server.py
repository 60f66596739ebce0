"""Run `flotilla serve` as a subprocess, exactly as `make serve` does (only the port differs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from devtools import REPO, stop_gracefully, wait_serving
from flotilla.cluster.ports import free_port

STARTUP_TIMEOUT_S = 600
SHUTDOWN_TIMEOUT_S = 90


@dataclass
class Server:
    url: str
    ray_address: str
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "\n".join(self.lines)


@contextmanager
def flotilla_serve(
    config: str = "examples/local-cpu.yaml", env: dict[str, str] | None = None, port: int | None = None
) -> Iterator[Server]:
    port = port or free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "flotilla.cli", "serve", "--config", config, "--port", str(port)],
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


# vLLM's own server with the engine settings Flotilla gives its CPU groups (cluster/engine.py).
VLLM_CPU_ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--kv-cache-memory-bytes",
    str(512 << 20),
    "--enable-prefix-caching",
    "--compilation-config",
    '{"mode": 2, "backend": "eager"}',
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
