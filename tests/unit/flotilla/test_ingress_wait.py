"""`flotilla serve` waits for its ingress with progress lines and a bound, never forever."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

from flotilla import launcher


def serve_status(app_status: ApplicationStatus, replicas: dict[ReplicaState, int]) -> ServeStatus:
    deployment = DeploymentStatusOverview(
        status=DeploymentStatus.UPDATING,
        status_trigger=DeploymentStatusTrigger.CONFIG_UPDATE_STARTED,
        replica_states=replicas,
        message="",
    )
    app = ApplicationStatusOverview(
        status=app_status, message="", last_deployed_time_s=0.0, deployments={"OpenAIIngress": deployment}
    )
    return ServeStatus(applications={launcher.SERVE_APP_NAME: app})


def deployment(startup_timeout_s: float) -> launcher.Deployment:
    config = SimpleNamespace(startup_timeout_s=startup_timeout_s, host="127.0.0.1", port=1)
    return launcher.Deployment(config=config, cluster=None)  # type: ignore[arg-type]


@pytest.fixture
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "PROGRESS_POLL_S", 0.01)
    monkeypatch.setattr(launcher, "HEARTBEAT_S", 0.05)


def test_a_replica_that_never_starts_ends_the_wait_with_its_state(
    monkeypatch: pytest.MonkeyPatch, fast_polls: None
) -> None:
    stuck = serve_status(ApplicationStatus.DEPLOYING, {ReplicaState.RUNNING: 1, ReplicaState.STARTING: 1})
    monkeypatch.setattr(launcher.serve, "status", lambda: stuck)
    said: list[str] = []
    with pytest.raises(
        RuntimeError, match=r"not running 0 s after the groups were ready \(replicas: 1 RUNNING, 1 STARTING"
    ):
        asyncio.run(asyncio.wait_for(launcher._wait_for_ingress(deployment(0.3), said.append), 10))
    assert said and all(line.startswith("[ingress] replicas: 1 RUNNING, 1 STARTING (") for line in said)


def test_a_running_ingress_is_waited_for_until_it_answers(monkeypatch: pytest.MonkeyPatch, fast_polls: None) -> None:
    statuses = iter(
        [serve_status(ApplicationStatus.DEPLOYING, {ReplicaState.STARTING: 2})] * 3
        + [serve_status(ApplicationStatus.RUNNING, {ReplicaState.RUNNING: 2})]
    )
    monkeypatch.setattr(launcher.serve, "status", lambda: next(statuses))
    reached: list[str] = []
    monkeypatch.setattr(launcher, "_wait_until_reachable", lambda url, timeout_s: reached.append(url))
    asyncio.run(asyncio.wait_for(launcher._wait_for_ingress(deployment(60), lambda line: None), 10))
    assert reached == ["http://127.0.0.1:1/health"]
