"""Fault recovery benchmark: Flotilla's coordinator next to Ray Serve LLM, same engine, same faults.

Every stack serves ``tiny-llama`` with 2 replicas (Flotilla: 2 groups, TP=1, every default; Ray
Serve LLM: 2 replicas, once with Serve's default health checks (every 10 s, 30 s timeout) and once
tuned to Flotilla's: every 0.5 s, 3 s timeout) under a steady load of non-streaming completions (4
at a time). Each fault is injected once, and the run waits for recovery:

* ``worker``: SIGKILL the process that runs the model (Flotilla: the group's rank process as
  ``flotilla status`` lists it, with one rank its vLLM EngineCore, ``cpu.rank_in_engine_core``;
  Ray Serve LLM: the replica's vLLM EngineCore process, which hosts its model executor);
* ``leader``: SIGKILL the process that owns the engine (Flotilla: the group leader actor;
  Ray Serve LLM: the replica actor);
* ``hang``: SIGSTOP the model process (it stops answering without dying);
* ``coordinator`` (Flotilla only): kill the coordinator actor.

One poller times every stack the same way: every 0.2 s it reads the stack's own list of replicas
in routing (Flotilla: the groups ``/admin/groups`` lists ready, with their generation; Ray Serve:
the replicas its REST API lists RUNNING) and keeps the timeline. Detection = the victim leaves
that list; back in routing = the list is as long as before again, without the victim. Flotilla's
own event time is reported beside it. Failed requests and requests still in flight are the load's.

    python -m bench.fault_bench [--stacks flotilla,ray,ray-tuned] [--faults worker,leader,hang,coordinator]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any, Protocol

import httpx
import psutil

from bench.common import (
    ENGINE_ENV,
    RESULTS,
    Process,
    ray_serve_llm_script,
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
# Ray Serve LLM's health check asks the engine client, which does not reach a frozen EngineCore
# (measured: still RUNNING after 600 s); waiting that long per run proves nothing more.
HANG_DETECTION_WAIT_S = 120
POLL_S = 0.2
# Flotilla's RecoveryConfig defaults (health_period_s, health_timeout_s), given to Serve's health checks.
TUNED_HEALTH_CHECK = ', "health_check_period_s": 0.5, "health_check_timeout_s": 3.0'


@dataclass
class FaultResult:
    stack: str
    fault: str
    detection_s: float | None
    back_in_routing_s: float | None
    own_detection_s: float | None
    engine_start_s: float | None
    failed_requests: int
    requests: int
    note: str = ""


@dataclass(frozen=True)
class Victim:
    member: str
    """The victim's entry in the stack's list of replicas in routing."""
    pid: int
    fault_signal: signal.Signals


class RoutingPoller:
    """Reads one stack's replicas in routing every ``POLL_S`` on a thread of its own, keeping the timeline."""

    def __init__(self, read: Callable[[], frozenset[str] | None]) -> None:
        self._read = read
        self.timeline: list[tuple[float, frozenset[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            members = self._read()
            if members is not None:  # no answer this time (busy machine): no sample, not an empty list
                self.timeline.append((time.time(), members))
            self._stop.wait(POLL_S)

    def current(self) -> frozenset[str]:
        if not wait_for(lambda: self.timeline, 60, POLL_S):
            raise RuntimeError("the stack never listed its replicas")
        return self.timeline[-1][1]

    def left_at(self, victim: str, t0: float) -> float | None:
        return next((t for t, members in list(self.timeline) if t >= t0 and victim not in members), None)

    def back_at(self, size: int, victim: str, t0: float) -> float | None:
        left = self.left_at(victim, t0)
        if left is None:
            return None
        timeline = list(self.timeline)
        return next((t for t, m in timeline if t >= left and len(m) >= size and victim not in m), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Stack(Protocol):
    name: str
    url: str

    def members(self) -> frozenset[str] | None: ...
    def victim(self, fault: str) -> Victim: ...
    def after(self, fault: str, t0: float, back: bool) -> tuple[float | None, float | None, str]: ...
    def stop(self) -> None: ...


# --- Flotilla --------------------------------------------------------------------------------------------


class Flotilla:
    name = "flotilla"

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        config = Path(tempfile.mkdtemp()) / "fault-bench.yaml"
        config.write_text(
            f"model: {MODEL}\nserved_model_name: tiny-llama\ngroups: 2\nport: {port}\ncpu: {{threads_per_worker: 1}}\n"
            # the progress deadline this benchmark's figures were measured with (the default was 4 s until
            # 2026-12-05, now 30 s); tiny-llama's steps take milliseconds
            "coordinator: {hang_timeout_s: 4}\n"
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
        self._known_events = 0

    def groups(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/admin/groups", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
        response.raise_for_status()
        return dict(response.json())

    def members(self) -> frozenset[str] | None:
        try:
            groups = self.groups()["groups"]
        except httpx.HTTPError:
            return None
        return frozenset(f"{g['name']}#{g['generation']}" for g in groups if g["state"] == "ready")

    def victim(self, fault: str) -> Victim:
        # Alternate groups; the third fault is group-0's second restart (its 2 s backoff included).
        name = "group-1" if fault == "leader" else "group-0"
        out = subprocess.run(
            [sys.executable, "-m", "flotilla.cli", "status", "--json", "--address", self.address],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        group = next(g for g in json.loads(out)["groups"] if g["name"] == name)
        groups = self.groups()
        generation = next(g["generation"] for g in groups["groups"] if g["name"] == name)
        self._known_events = len(groups["events"])
        pid = int(group["leader"]["pid"] if fault == "leader" else group["ranks"][0]["worker"]["pid"])
        return Victim(f"{name}#{generation}", pid, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)

    def after(self, fault: str, t0: float, back: bool) -> tuple[float | None, float | None, str]:
        """(the coordinator's own detection time, the engine start time, a note)."""
        groups = self.groups()
        events = groups["events"][self._known_events :]
        if not events:
            return None, None, "no coordinator event"
        event = events[0]
        name = event["group"]
        detail = next(g["detail"] for g in groups["groups"] if g["name"] == name)
        engine = float(detail.split("ready in ", 1)[1].split(" s", 1)[0]) if back and "ready in" in detail else None
        return event["detected_at"] - t0, engine, f"detected as {event['kind']}"

    def kill_coordinator(self) -> float | None:
        """Kill the coordinator actor; seconds until a new one serves the admin API."""
        started_at = self.groups()["coordinator_started_at"]
        t0 = time.time()
        subprocess.run(
            [sys.executable, "-c", _KILL_COORDINATOR, self.address], check=True, capture_output=True, timeout=120
        )
        back = wait_for(lambda: self.groups()["coordinator_started_at"] != started_at, RECOVERY_TIMEOUT_S, POLL_S)
        return time.time() - t0 if back else None

    def stop(self) -> None:
        self.process.stop()


_KILL_COORDINATOR = """
import sys, ray
from flotilla.cluster.ray_connect import connect
from flotilla.cluster.contract import COORDINATOR_NAME, DEFAULT_NAMESPACE
connect(sys.argv[1], DEFAULT_NAMESPACE)
ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=DEFAULT_NAMESPACE), no_restart=False)
"""


# --- Ray Serve LLM --------------------------------------------------------------------------------------


class RayServe:
    def __init__(self, port: int, tuned: bool) -> None:
        self.name = "ray-serve-llm, health checks 0.5 s / 3 s" if tuned else "ray-serve-llm, defaults"
        self.url = f"http://127.0.0.1:{port}"
        self.dashboard = f"http://127.0.0.1:{port + 1}"
        script = ray_serve_llm_script(
            name="tiny-llama",
            model=MODEL,
            kv=256 << 20,
            blocks=1024,
            max_model_len=2048,  # tiny-llama's max_position_embeddings (vLLM refuses more)
            port=port,
            replicas=2,
            deployment_extra=TUNED_HEALTH_CHECK if tuned else "",
            dashboard_port=port + 1,
        )
        env = ENGINE_ENV | {"RAY_AUTH_MODE": "disabled", "FLOTILLA_CPU_RAY_PLUGIN": "0"}
        self.process = Process("fault-ray-serve", [sys.executable, "-c", script], env, RESULTS)
        wait_ready(self.url, self.process, timeout_s=1200)
        wait_replicas_running(self.dashboard, 2, self.process)

    def members(self) -> frozenset[str] | None:
        running = serve_running_replicas(self.dashboard)
        return None if running is None else frozenset(running)

    def victim(self, fault: str) -> Victim:
        replica_id, replica_pid = sorted((serve_running_replicas(self.dashboard) or {}).items())[0]
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
        return Victim(replica_id, pid, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)

    def after(self, fault: str, t0: float, back: bool) -> tuple[float | None, float | None, str]:
        return None, None, ""

    def stop(self) -> None:
        self.process.stop()


# --- the run -------------------------------------------------------------------------------------------------


def inject(stack: Stack, poller: RoutingPoller, fault: str, load: Load) -> FaultResult:
    before = poller.current()
    victim = stack.victim(fault)
    t0 = time.time()
    os.kill(victim.pid, victim.fault_signal)
    detection_wait = HANG_DETECTION_WAIT_S if fault == "hang" and isinstance(stack, RayServe) else RECOVERY_TIMEOUT_S
    left = wait_for(lambda: poller.left_at(victim.member, t0), detection_wait, POLL_S)
    back = (
        wait_for(lambda: poller.back_at(len(before), victim.member, t0), RECOVERY_TIMEOUT_S, POLL_S) if left else None
    )
    if victim.fault_signal is signal.SIGSTOP:
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    own_detection, engine_start, note = stack.after(fault, t0, back is not None)
    if left is None:
        note = f"not detected within {detection_wait} s"
    return FaultResult(
        stack.name,
        fault,
        left - t0 if left else None,
        back - t0 if back else None,
        own_detection,
        engine_start,
        load.failed_since(t0),
        load.answered_since(t0),
        note,
    )


def run_stack(stack: Stack, faults: list[str]) -> tuple[list[FaultResult], int]:
    """The stack's results, and the load's requests still unanswered once it stopped."""
    results = []
    poller = RoutingPoller(stack.members)
    load = Load(stack.url)
    load.start()
    try:
        for fault in faults:
            if fault == "coordinator" and not isinstance(stack, Flotilla):
                continue
            time.sleep(3)  # steady load before the fault
            if fault == "coordinator":
                assert isinstance(stack, Flotilla)
                t0 = time.time()
                recovered = stack.kill_coordinator()
                time.sleep(5)  # keep the load running a little after the new coordinator took over
                result = FaultResult(
                    stack.name, fault, None, recovered, None, None, load.failed_since(t0), load.answered_since(t0),
                    "no group restarts; back in routing = coordinator back",
                )  # fmt: skip
            else:
                result = inject(stack, poller, fault, load)
            print(f"  {result}", flush=True)
            results.append(result)
    finally:
        load.stop()
        poller.stop()
    return results, load.in_flight()


def render(results: list[FaultResult], in_flight: dict[str, int], command: str) -> str:
    def s(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f} s"

    lines = [
        f"Date: {date.today().isoformat()}. Command: `{command.strip()}`.",
        "Every stack: `tiny-llama`, 2 replicas (Flotilla: 2 groups × TP=1), CPU, this 2-core machine, load = "
        f"non-streaming completions 4 at a time. Times are from the fault; detection and back in routing come from "
        f"one poller reading each stack's own list of replicas in routing every {POLL_S} s.",
        "",
        "| stack | fault | detection | back in routing | own event | engine start | failed / requests | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.stack} | {r.fault} | {s(r.detection_s)} | {s(r.back_in_routing_s)} | {s(r.own_detection_s)} | "
            f"{s(r.engine_start_s)} | {r.failed_requests} / {r.requests} | {r.note} |"
        )
    lines += ["", "Requests still unanswered when each stack's load stopped: "]
    lines[-1] += ", ".join(f"{name}: {count}" for name, count in in_flight.items()) + "."
    return "\n".join(lines)


def start_stack(name: str, port: int) -> Stack:
    if name == "flotilla":
        return Flotilla(port)
    if name in ("ray", "ray-tuned"):
        return RayServe(port + 1, tuned=name == "ray-tuned")
    raise SystemExit(f"unknown stack {name!r}: flotilla, ray or ray-tuned")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default="flotilla,ray,ray-tuned")
    parser.add_argument("--faults", default="worker,leader,hang,coordinator")
    parser.add_argument("--port", type=int, default=18900)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    faults = args.faults.split(",")
    results: list[FaultResult] = []
    in_flight: dict[str, int] = {}
    for name in args.stacks.split(","):
        print(name, flush=True)
        stack = start_stack(name, args.port)
        try:
            stack_results, in_flight[stack.name] = run_stack(stack, faults)
            results += stack_results
        finally:
            stack.stop()
    report = render(results, in_flight, "python -m bench.fault_bench " + " ".join(sys.argv[1:]))
    (RESULTS / f"{SECTION}.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    if not args.no_docs:
        write_docs_section(SECTION, report, "Fault recovery: Flotilla's coordinator vs Ray Serve LLM")
    print(report)


if __name__ == "__main__":
    main()
