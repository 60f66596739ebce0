"""Fault recovery benchmark: Flotilla's coordinator next to Ray Serve LLM, same engine, same faults.

Both stacks serve ``tiny-llama`` with 2 replicas (Flotilla: 2 groups, TP=1; Ray Serve LLM: 2
replicas, its defaults) under a steady load of non-streaming completions (4 at a time). Each
fault is injected once, and the run waits for recovery:

* ``worker``: SIGKILL the process that runs the model (Flotilla: the group's vLLM worker actor;
  Ray Serve LLM: the replica's vLLM EngineCore process, which hosts its model executor);
* ``leader``: SIGKILL the process that owns the engine (Flotilla: the group leader actor;
  Ray Serve LLM: the replica actor);
* ``hang``: SIGSTOP the model process (it stops answering without dying);
* ``coordinator`` (Flotilla only): kill the coordinator actor.

Measured: detection (fault → the stack notices: Flotilla's coordinator event; Ray Serve: the
first moment its controller reports the replica not RUNNING), time out of routing, time back
in routing (Flotilla: the group is ready again; Ray Serve: the deployment has all replicas
RUNNING again), and the load's failed requests.

    python -m bench.fault_bench [--stacks flotilla,ray] [--faults worker,leader,hang,coordinator]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import (
    ENGINE_ENV,
    RAY_APP,
    RESULTS,
    Process,
    serve_running_replicas,
    wait_ready,
    wait_replicas_running,
    write_docs_section,
)
from devtools import REPO, Load, wait_for

MODEL = REPO / "models" / "tiny-llama"
TOKEN = "fault-bench"
SECTION = "fault_bench"
RECOVERY_TIMEOUT_S = 600


@dataclass
class FaultResult:
    stack: str
    fault: str
    detection_s: float | None
    out_of_routing_s: float | None
    back_in_routing_s: float | None
    engine_start_s: float | None
    failed_requests: int
    requests: int
    note: str = ""


# --- Flotilla --------------------------------------------------------------------------------------------


class Flotilla:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        config = Path(tempfile.mkdtemp()) / "fault-bench.yaml"
        config.write_text(
            f"model: {MODEL}\nserved_model_name: tiny-llama\ngroups: 2\nport: {port}\ncpu: {{threads_per_worker: 1}}\n"
        )
        self.process = Process(
            "fault-flotilla",
            [sys.executable, "-m", "flotilla.cli", "serve", "--config", str(config)],
            {"FLOTILLA_ADMIN_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"},
            RESULTS,
        )
        wait_ready(self.url, self.process)
        log = (RESULTS / "fault-flotilla.log").read_text()
        self.address = log.rsplit("local Ray cluster: ", 1)[1].split(" at ", 1)[1].split(" ", 1)[0]

    def groups(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/admin/groups", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        response.raise_for_status()
        return dict(response.json())

    def group(self, name: str) -> dict[str, Any]:
        return next(g for g in self.groups()["groups"] if g["name"] == name)

    def pids(self, name: str) -> tuple[int, int]:
        """(leader pid, rank-0 worker pid) from ``flotilla status``."""
        out = subprocess.run(
            [sys.executable, "-m", "flotilla.cli", "status", "--json", "--address", self.address],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        group = next(g for g in json.loads(out)["groups"] if g["name"] == name)
        return int(group["leader"]["pid"]), int(group["ranks"][0]["worker"]["pid"])

    def inject(self, fault: str, load: Load) -> FaultResult:
        # Alternate groups; the third fault is group-0's second restart (its 2 s backoff included).
        name = "group-1" if fault == "leader" else "group-0"
        before = self.group(name)
        leader, worker = self.pids(name)
        known_events = len(self.groups()["events"])
        started_at = self.groups()["coordinator_started_at"]
        t0 = time.time()
        if fault == "worker":
            os.kill(worker, signal.SIGKILL)
        elif fault == "leader":
            os.kill(leader, signal.SIGKILL)
        elif fault == "hang":
            os.kill(worker, signal.SIGSTOP)
        elif fault == "coordinator":
            subprocess.run(
                [sys.executable, "-c", _KILL_COORDINATOR, self.address], check=True, capture_output=True, timeout=120
            )
            back = wait_for(lambda: self.groups()["coordinator_started_at"] != started_at, RECOVERY_TIMEOUT_S, 0.2)
            recovered = time.time() - t0 if back else None
            time.sleep(5)  # keep the load running a little after the new coordinator took over
            return FaultResult(
                "flotilla",
                fault,
                None,
                None,
                recovered,
                None,
                load.failed_since(t0),
                load.answered_since(t0),
                "no group restarts; time = coordinator back",
            )
        event = wait_for(lambda: _new_event(self.groups(), known_events), 60, 0.05)
        back = wait_for(
            lambda: (g := self.group(name))["state"] == "ready" and g["generation"] > before["generation"],
            RECOVERY_TIMEOUT_S,
            0.2,
        )
        if fault == "hang":
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
        final = _new_event(self.groups(), known_events)
        detail = self.group(name)["detail"]
        engine_start = float(detail.split("ready in ", 1)[1].split(" s", 1)[0]) if "ready in" in detail else None
        return FaultResult(
            "flotilla",
            fault,
            event["detected_at"] - t0 if event else None,
            event["detected_at"] - t0 if event else None,  # published with the detection; ingress applies it
            final["back_in_routing_at"] - t0 if back and final and final["back_in_routing_at"] else None,
            engine_start,
            load.failed_since(t0),
            load.answered_since(t0),
            f"detected as {event['kind']}" if event else "not detected",
        )

    def stop(self) -> None:
        self.process.stop()


_KILL_COORDINATOR = """
import sys, ray
from flotilla.cluster.ray_connect import connect
from flotilla.cluster.contract import COORDINATOR_NAME, DEFAULT_NAMESPACE
connect(sys.argv[1], DEFAULT_NAMESPACE)
ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=DEFAULT_NAMESPACE), no_restart=False)
"""


def _new_event(groups: dict[str, Any], known: int) -> dict[str, Any] | None:
    events = groups["events"]
    return dict(events[known]) if len(events) > known else None


# --- Ray Serve LLM --------------------------------------------------------------------------------------


class RayServe:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.dashboard = f"http://127.0.0.1:{port + 1}"
        script = RAY_APP % {
            "name": "tiny-llama",
            "model": MODEL,
            "kv": 256 << 20,
            "blocks": 1024,
            "max_model_len": 2048,  # tiny-llama's max_position_embeddings (vLLM refuses more)
            "port": port,
            "replicas": 2,
            "router": "",
            "dashboard": True,
            "dashboard_port": port + 1,
        }
        env = ENGINE_ENV | {"RAY_AUTH_MODE": "disabled", "FLOTILLA_CPU_RAY_PLUGIN": "0"}
        self.process = Process("fault-ray-serve", [sys.executable, "-c", script], env, RESULTS)
        wait_ready(self.url, self.process, timeout_s=1200)
        wait_replicas_running(self.dashboard, 2, self.process)

    def running(self) -> dict[str, int]:
        return serve_running_replicas(self.dashboard)

    def inject(self, fault: str, load: Load) -> FaultResult:
        before = self.running()
        replica_id, replica_pid = sorted(before.items())[0]
        pid = replica_pid
        if fault != "leader":
            engines = [
                c
                for c in psutil.Process(replica_pid).children(recursive=True)
                if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())
            ]
            if not engines:
                raise RuntimeError(f"no vLLM EngineCore process under the Serve replica (pid {replica_pid})")
            pid = engines[0].pid
        t0 = time.time()
        os.kill(pid, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        detected = wait_for(lambda: replica_id not in self.running(), RECOVERY_TIMEOUT_S, 0.2)
        detection = time.time() - t0 if detected else None
        recovered = wait_for(
            lambda: len(self.running()) == len(before) and replica_id not in self.running(), RECOVERY_TIMEOUT_S, 0.5
        )
        back = time.time() - t0 if recovered else None
        if fault == "hang":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return FaultResult(
            "ray-serve-llm",
            fault,
            detection,
            detection,
            back,
            None,
            load.failed_since(t0),
            load.answered_since(t0),
            "detection = Serve stops listing the replica as RUNNING",
        )

    def stop(self) -> None:
        self.process.stop()


def _serves(url: str) -> bool:
    try:
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


# --- the run -------------------------------------------------------------------------------------------------


def run_stack(stack: Any, name: str, faults: list[str]) -> list[FaultResult]:
    results = []
    load = Load(stack.url)
    load.start()
    try:
        for fault in faults:
            if name == "ray" and fault == "coordinator":
                continue
            time.sleep(3)  # steady load before the fault
            result = stack.inject(fault, load)
            print(f"  {result}", flush=True)
            results.append(result)
    finally:
        load.stop()
    return results


def render(results: list[FaultResult], command: str) -> str:
    def s(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f} s"

    lines = [
        f"Date: {date.today().isoformat()}. Command: `{command.strip()}`.",
        "Both stacks: `tiny-llama`, 2 replicas (Flotilla: 2 groups × TP=1), CPU, this 2-core machine, load = "
        "non-streaming completions 4 at a time. Times are from the fault.",
        "",
        "| stack | fault | detection | out of routing | back in routing | engine start | failed / requests | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.stack} | {r.fault} | {s(r.detection_s)} | {s(r.out_of_routing_s)} | {s(r.back_in_routing_s)} | "
            f"{s(r.engine_start_s)} | {r.failed_requests} / {r.requests} | {r.note} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default="flotilla,ray")
    parser.add_argument("--faults", default="worker,leader,hang,coordinator")
    parser.add_argument("--port", type=int, default=18900)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    faults = args.faults.split(",")
    results: list[FaultResult] = []
    for name in args.stacks.split(","):
        print(name, flush=True)
        stack: Any = Flotilla(args.port) if name == "flotilla" else RayServe(args.port + 1)
        try:
            results += run_stack(stack, name, faults)
        finally:
            stack.stop()
    report = render(results, "python -m bench.fault_bench " + " ".join(sys.argv[1:]))
    (RESULTS / f"{SECTION}.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    if not args.no_docs:
        write_docs_section(SECTION, report, "Fault recovery: Flotilla's coordinator vs Ray Serve LLM")
    print(report)


if __name__ == "__main__":
    main()
