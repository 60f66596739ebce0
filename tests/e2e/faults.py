"""Helpers for the fault tests: the admin API, ``flotilla status``, recovery checks (the load is ``devtools.Load``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from devtools import REPO, Load, wait_for
from tests.e2e.server import Server

TOKEN = "failover-test-token"
RECOVERY_TIMEOUT_S = 300


# --- load and observation ------------------------------------------------------------------------------


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

    assert wait_for(back, RECOVERY_TIMEOUT_S, interval_s=0.5), f"{name} not back: {group(server, name)}"
    return group(server, name)


def group_metric(server: Server, metric: str, name: str) -> float:
    """``metric`` summed over every series of the ingress replicas' metrics labelled with group ``name``."""
    text = server.metrics()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(metric + "{") and f'group="{name}"' in line
    )


def routed_to(server: Server, name: str) -> float:
    return group_metric(server, "flotilla_routing_decisions_total", name)


def in_flight_on(server: Server, name: str) -> float:
    return group_metric(server, "flotilla_group_in_flight_requests", name)


@contextmanager
def load_through(server: Server, victim: str | None, model: str = "tiny-llama") -> Iterator[Load]:
    """The load of a fault test. Yields once a request is in flight on ``victim`` (the fault must hit one);
    on exit, after the load stopped, every request it sent has come back and none failed."""
    with Load(server.url, model) as load:
        if victim is not None:
            assert wait_for(lambda: in_flight_on(server, victim) >= 1, 60, interval_s=0.05), f"nothing on {victim}"
        yield load
    assert load.in_flight() == 0, f"{load.in_flight()} request(s) never came back"
    assert load.failures() == [], load.failures()[:3]


def cluster_status(server: Server) -> dict[str, Any]:
    """``flotilla status --json``: {"groups": [...], "eplb": [...]}."""
    result = subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "status", "--json", "--address", server.ray_address],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(result.stdout))


def status(server: Server) -> list[dict[str, Any]]:
    return list(cluster_status(server)["groups"])


def rank_pid(server: Server, name: str, rank: int) -> int:
    """The rank's worker process, as ``flotilla status`` lists it (each rank reports its own pid to its leader)."""
    g = next(g for g in status(server) if g["name"] == name)
    worker = g["ranks"][rank]["worker"]
    assert worker and worker["pid"], f"flotilla status lists no worker for {name} rank {rank}: {g}"
    return int(worker["pid"])


def leader_pid(server: Server, name: str) -> int:
    g = next(g for g in status(server) if g["name"] == name)
    return int(g["leader"]["pid"])


def assert_recovered(
    server: Server, load: Load, name: str, before: dict[str, Any], kinds: str | tuple[str, ...]
) -> dict[str, Any]:
    """The group restarted exactly once, for one of ``kinds`` (a dead rank is found by vLLM as
    ``engine_dead`` or by the state API as ``worker_died``, whichever check runs first), and serves again."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    after = wait_back_in_routing(server, name, before["generation"])
    routed = routed_to(server, name)
    assert wait_for(lambda: routed_to(server, name) > routed, 60), f"{name} is ready but gets no requests"
    grown = {k: after["restarts"].get(k, 0) - before["restarts"].get(k, 0) for k in after["restarts"]}
    (kind,) = [k for k, n in grown.items() if n]
    assert kind in kinds and grown[kind] == 1, after
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
