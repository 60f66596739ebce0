"""Faults under load against real vLLM groups: every group failure is a gang restart, and no
non-streaming request fails.

For each fault: the load (non-streaming completions, 4 at a time) sees zero failures, the other
group keeps serving, the failed group comes back into routing with a new engine, and
``flotilla status`` / ``/admin/groups`` say what happened. Timings (detection, back in routing)
are printed here and measured properly by ``bench/fault_bench.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from cluster.group_api import COORDINATOR_NAME, LEADER_NAMESPACE
from cluster.local_ray import LocalCluster, LocalClusterShape
from cluster.ray_connect import connect
from tests.e2e.server import REPO, Server, flotilla_serve, wait_until

pytestmark = pytest.mark.e2e
TOKEN = "failover-test-token"
RECOVERY_TIMEOUT_S = 300


# --- load and observation ------------------------------------------------------------------------------


@dataclass
class Load:
    """Non-streaming completions, ``concurrency`` at a time, until stopped; every outcome recorded."""

    url: str
    model: str
    concurrency: int = 4
    outcomes: list[tuple[int, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        def run() -> None:
            with httpx.Client(timeout=180) as client:
                while not self._stop.is_set():
                    body = {"model": self.model, "prompt": "The harbour at dawn", "max_tokens": 12}
                    try:
                        response = client.post(f"{self.url}/v1/completions", json=body)
                        self.outcomes.append((response.status_code, response.text[:300]))
                    except httpx.HTTPError as err:
                        self.outcomes.append((0, repr(err)))

        self._threads = [threading.Thread(target=run, daemon=True) for _ in range(self.concurrency)]
        for thread in self._threads:
            thread.start()
        assert wait_until(lambda: len(self.outcomes) >= 8, 120), "the load never got going"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(200)

    def failures(self) -> list[tuple[int, str]]:
        return [o for o in self.outcomes if o[0] != 200]


def admin(server: Server, method: str, path: str) -> Any:
    response = httpx.request(
        method, f"{server.url}/admin{path}", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def group(server: Server, name: str) -> dict[str, Any]:
    return next(g for g in admin(server, "GET", "/groups")["groups"] if g["name"] == name)


def wait_back_in_routing(server: Server, name: str, generation: int) -> dict[str, Any]:
    """Until the group is ready with a newer engine than ``generation``."""

    def back() -> bool:
        g = group(server, name)
        return g["state"] == "ready" and g["generation"] > generation

    assert wait_until(back, RECOVERY_TIMEOUT_S, interval_s=0.5), f"{name} not back: {group(server, name)}"
    return group(server, name)


def routed_to(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    prefix = "flotilla_routing_decisions_total{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and f'group="{name}"' in line
    )


def status(server: Server) -> list[dict[str, Any]]:
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "status", "--json", "--address", server.ray_address],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return list(json.loads(result.stdout))


def rank_pid(server: Server, name: str, rank: int) -> int:
    g = next(g for g in status(server) if g["name"] == name)
    return int(g["ranks"][rank]["actor"]["pid"])


def leader_pid(server: Server, name: str) -> int:
    g = next(g for g in status(server) if g["name"] == name)
    return int(g["leader"]["pid"])


def assert_recovered(server: Server, load: Load, name: str, before: dict[str, Any], kind: str) -> dict[str, Any]:
    after = wait_back_in_routing(server, name, before["generation"])
    routed = routed_to(server, name)
    assert wait_until(lambda: routed_to(server, name) > routed, 60), f"{name} is ready but gets no requests"
    assert after["restarts"].get(kind, 0) == before["restarts"].get(kind, 0) + 1, after
    assert after["last_failure"].startswith(kind)
    events = [e for e in admin(server, "GET", "/groups")["events"] if e["group"] == name and e["kind"] == kind]
    event = events[-1]
    print(
        f"\n{name} {kind}: detected {event['detected_at'] - event['last_healthy_at']:.2f} s after its last good "
        f"check, back in routing {event['back_in_routing_at'] - event['detected_at']:.1f} s after detection"
    )
    listed = next(g for g in status(server) if g["name"] == name)
    assert listed["state"] == "ready" and listed["restarts"].get(kind) == after["restarts"][kind]
    assert load.failures() == [], load.failures()[:3]
    return after


# --- one server: 2 groups × TP=2 ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("failover") / "tp2.yaml"
    config.write_text(
        f"model: {models_dir / 'tiny-llama'}\nserved_model_name: tiny-llama\ngroups: 2\ntensor_parallel_size: 2\n"
        "cpu: {threads_per_worker: 1}\n"
    )
    with flotilla_serve(str(config), env={"FLOTILLA_ADMIN_TOKEN": TOKEN}) as running:
        connect(running.ray_address)
        yield running
        ray.shutdown()


def long_streams(server: Server, count: int) -> tuple[list[threading.Thread], list[str]]:
    """Streaming completions long enough to be cut by a fault; returns their raw SSE bodies when done."""
    bodies: list[str] = []

    def run() -> None:
        body = {"model": "tiny-llama", "prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=300) as client, client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            bodies.append(r.read().decode())

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, bodies


def test_killed_tp_worker_restarts_its_group_and_loses_no_request(server: Server) -> None:
    before = group(server, "group-0")
    streams, bodies = long_streams(server, 4)
    with Load(server.url, "tiny-llama") as load:
        os.kill(rank_pid(server, "group-0", rank=1), signal.SIGKILL)
        assert wait_until(lambda: group(server, "group-0")["state"] != "ready", 10), "the death went unnoticed"
        assert group(server, "group-1")["state"] == "ready"
        assert_recovered(server, load, "group-0", before, "engine_dead")
    for thread in streams:
        thread.join(300)
    assert len(bodies) == 4 and all(b.rstrip().endswith("data: [DONE]") for b in bodies)
    broken = [b for b in bodies if '"error"' in b]
    assert broken, "no stream was on the killed group"  # they stop with an error event, then [DONE]
    assert all("group_unavailable" in b or "service_unavailable" in b for b in broken)


def test_killed_leader_restarts_its_group(server: Server) -> None:
    before = group(server, "group-1")
    with Load(server.url, "tiny-llama") as load:
        os.kill(leader_pid(server, "group-1"), signal.SIGKILL)
        assert_recovered(server, load, "group-1", before, "leader_died")


def test_frozen_worker_is_found_by_its_deadline(server: Server) -> None:
    before = group(server, "group-0")
    with Load(server.url, "tiny-llama") as load:
        pid = rank_pid(server, "group-0", rank=0)
        os.kill(pid, signal.SIGSTOP)
        try:
            assert_recovered(server, load, "group-0", before, "hang")
        finally:
            try:
                os.kill(pid, signal.SIGKILL)  # normally the restart killed it already
            except ProcessLookupError:
                pass


def test_killed_coordinator_comes_back_and_adopts_the_groups(server: Server) -> None:
    first = admin(server, "GET", "/groups")
    generations = {g["name"]: g["generation"] for g in first["groups"]}
    with Load(server.url, "tiny-llama") as load:
        ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=LEADER_NAMESPACE), no_restart=False)
        assert wait_until(
            lambda: admin(server, "GET", "/groups")["coordinator_started_at"] != first["coordinator_started_at"], 60
        )
        second = admin(server, "GET", "/groups")
        assert {g["name"]: g["state"] for g in second["groups"]} == {"group-0": "ready", "group-1": "ready"}
        assert all("adopted" in g["detail"] for g in second["groups"])
        for name in generations:  # the same engines: nothing restarted
            routed = routed_to(server, name)
            assert wait_until(lambda name=name, routed=routed: routed_to(server, name) > routed, 60)
    assert load.failures() == []


def test_drain_resume_and_no_ready_group(server: Server) -> None:
    cli = [sys.executable, "-m", "cluster.cli"]
    drained = subprocess.run(
        [*cli, "drain", "group-0", "--address", server.ray_address], capture_output=True, text=True, check=True
    )
    assert "group-0: draining" in drained.stdout
    routed = routed_to(server, "group-0")
    for _ in range(6):
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert routed_to(server, "group-0") == routed
    admin(server, "POST", "/groups/group-1/drain")
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi"}, timeout=60)
    assert response.status_code == 503 and response.headers["retry-after"]
    assert response.json()["error"]["code"] == "no_ready_group"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    unknown = httpx.post(
        f"{server.url}/admin/groups/group-9/drain", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "group_not_found"
    for name in ("group-0", "group-1"):
        subprocess.run([*cli, "resume", name, "--address", server.ray_address], check=True, capture_output=True)
    assert httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi"}).status_code == 200
    again = subprocess.run([*cli, "resume", "group-0", "--address", server.ray_address], capture_output=True, text=True)
    assert again.returncode == 1 and "only a draining group" in again.stderr


# --- node loss: 5 simulated nodes, 2 groups × PP=2, one node spare ---------------------------------------


@pytest.fixture(scope="module")
def pp_cluster(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Server]]:
    cluster = LocalCluster(
        LocalClusterShape(nodes=5, slots_per_node=1, cpus_per_node=4, object_store_bytes=150 << 20),
        namespace="failover-test",
        log_to_driver=False,
    )
    try:
        config = tmp_path_factory.mktemp("failover") / "pp2.yaml"
        config.write_text(
            f"model: {models_dir / 'tiny-llama'}\nserved_model_name: tiny-llama\ngroups: 2\n"
            f"pipeline_parallel_size: 2\ncpu: {{threads_per_worker: 1}}\ningress: {{proxy: serve}}\n"
            f"cluster: {{address: '{cluster.address}'}}\n"
        )
        with flotilla_serve(str(config), env={"FLOTILLA_ADMIN_TOKEN": TOKEN}) as running:
            yield cluster, running
    finally:
        cluster.shutdown()


def test_lost_node_with_a_pp_stage_restarts_the_group_elsewhere(pp_cluster: tuple[LocalCluster, Server]) -> None:
    cluster, server = pp_cluster
    target = next(g for g in status(server) if g["name"] == "group-0")
    stage_nodes = {r["pp_rank"]: r["node_id"] for r in target["ranks"]}
    assert stage_nodes[0] != stage_nodes[1]
    head = cluster.nodes()[0]
    victim = next(n for n in cluster.nodes() if n.node_id == stage_nodes[1])
    assert victim is not head
    before = group(server, "group-0")
    with Load(server.url, "tiny-llama") as load:
        cluster.remove_node(victim)
        after = wait_back_in_routing(server, "group-0", before["generation"])
        assert load.failures() == [], load.failures()[:3]
    assert sum(after["restarts"].values()) == 1
    moved = next(g for g in status(server) if g["name"] == "group-0")
    assert victim.node_id not in {r["node_id"] for r in moved["ranks"]}
    assert group(server, "group-1")["generation"] == 1  # the other group never restarted
