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
from pathlib import Path

import httpx
import pytest
import ray

from devtools import wait_for
from flotilla.cluster.contract import COORDINATOR_NAME, DEFAULT_NAMESPACE
from flotilla.cluster.ray_connect import connect
from flotilla.cluster.vllm_cpu_shm import SHM_DIR
from tests.e2e.faults import (
    TOKEN,
    admin,
    assert_recovered,
    group,
    in_flight_on,
    leader_pid,
    load_through,
    rank_pid,
    routed_to,
)
from tests.e2e.server import Server, flotilla_serve

pytestmark = pytest.mark.e2e


# --- one server: 2 groups × TP=2 ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("failover") / "tp2.yaml"
    config.write_text(
        f"model: {models_dir / 'tiny-llama'}\nserved_model_name: tiny-llama\ngroups: 2\ntensor_parallel_size: 2\n"
        "cpu: {threads_per_worker: 1}\n"
        # tiny-llama's steps take milliseconds: a 4 s progress deadline finds the frozen worker below quickly
        "coordinator: {hang_timeout_s: 4}\n"
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


def shared_memory_segments() -> set[str]:
    """The TP/PP shared-memory segments on this machine (vLLM's CPU communicator names them ``…-cpushm_<rank>``)."""
    return {path.name for path in SHM_DIR.glob("*-cpushm_*")}


def test_killed_tp_worker_restarts_its_group_and_loses_no_request(server: Server) -> None:
    before = group(server, "group-0")
    segments_before = shared_memory_segments()
    admin(server, "POST", "/groups/group-1/drain")  # the streams must be on the victim, whatever routing prefers
    try:
        streams, bodies = long_streams(server, 4)
        assert wait_for(lambda: in_flight_on(server, "group-0") >= 4, 60), "the streams never reached group-0"
    finally:
        admin(server, "POST", "/groups/group-1/resume")
    assert wait_for(lambda: group(server, "group-1")["state"] == "ready", 30)
    pid = rank_pid(server, "group-0", rank=1)
    with load_through(server, "group-0") as load:
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: group(server, "group-0")["state"] != "ready", 10), "the death went unnoticed"
        assert group(server, "group-1")["state"] == "ready"
        assert_recovered(server, load, "group-0", before, ("engine_dead", "worker_died"))
    for thread in streams:
        thread.join(300)
    assert len(bodies) == 4 and all(b.rstrip().endswith("data: [DONE]") for b in bodies)
    broken = [b for b in bodies if '"error"' in b]
    assert len(broken) == 4, "a stream on the killed group ended without an error event"
    for body in broken:  # vLLM's stream error event: the group's failure, as a retryable 503
        (error,) = [json.loads(e[6:])["error"] for e in body.splitlines() if e.startswith("data: {") and '"error"' in e]
        assert error["code"] == 503 and "group-0 could not serve the request" in error["message"]
    # Neither the killed group nor its replacement holds a named segment: a later group that gets the same
    # torch-distributed port (the names' first part) must not find one (it failed to start with EEXIST).
    assert shared_memory_segments() - segments_before == set()


@pytest.mark.slow  # a gang restart like the killed worker's above; tests/deploy/test_prometheus.py kills a leader too
def test_killed_leader_restarts_its_group(server: Server) -> None:
    before = group(server, "group-1")
    pid = leader_pid(server, "group-1")
    with load_through(server, "group-1") as load:
        os.kill(pid, signal.SIGKILL)
        assert_recovered(server, load, "group-1", before, "leader_died")


@pytest.mark.slow  # a rare path, and the unit tests (test_membership.py) check the deadline itself
def test_frozen_worker_is_found_by_its_deadline(server: Server) -> None:
    before = group(server, "group-0")
    pid = rank_pid(server, "group-0", rank=0)
    with load_through(server, "group-0") as load:
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
    with load_through(server, None):
        ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=DEFAULT_NAMESPACE), no_restart=False)
        assert wait_for(
            lambda: admin(server, "GET", "/groups")["coordinator_started_at"] != first["coordinator_started_at"], 60
        )
        second = admin(server, "GET", "/groups")
        assert {g["name"]: g["state"] for g in second["groups"]} == {"group-0": "ready", "group-1": "ready"}
        assert all("adopted" in g["detail"] for g in second["groups"])
        for name in generations:  # the same engines: nothing restarted
            routed = routed_to(server, name)
            assert wait_for(lambda name=name, routed=routed: routed_to(server, name) > routed, 60)


def test_drain_resume_and_no_ready_group(server: Server) -> None:
    cli = [sys.executable, "-m", "flotilla.cli"]
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
    assert response.json()["error"]["message"] == "no replica group is ready"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    unknown = httpx.post(
        f"{server.url}/admin/groups/group-9/drain", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "group"
    for name in ("group-0", "group-1"):
        subprocess.run([*cli, "resume", name, "--address", server.ray_address], check=True, capture_output=True)
    assert httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi"}).status_code == 200
    again = subprocess.run([*cli, "resume", "group-0", "--address", server.ray_address], capture_output=True, text=True)
    assert again.returncode == 1 and "only a draining group" in again.stderr
