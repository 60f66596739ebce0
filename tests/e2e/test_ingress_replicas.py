"""Two ingress replicas behind HAProxy. Each serves its own series on a port of its own (labelled with
its replica), so Prometheus scrapes every replica and nothing interleaves; ``/metrics?scope=cluster`` on
the serving port has the rest. A routing change through the admin API reaches both replicas, and a
replica started later, and outlives a coordinator restart. API keys come from a file that both replicas
follow: a rotated key works, and the retired one stops working, with no restart. Killing one replica
under load fails at most the requests in flight on it; every request sent after the kill is answered
(HAProxy sends it to the other), and the engine aborts the dead replica's requests instead of finishing
them for nobody."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from devtools import Load, wait_for
from flotilla.cluster.config import LocalClusterConfig
from flotilla.cluster.contract import COORDINATOR_NAME, DEFAULT_NAMESPACE, leader_actor_name
from flotilla.cluster.ports import free_port_run
from flotilla.cluster.ray_connect import connect
from tests.e2e.faults import TOKEN, admin
from tests.e2e.server import Server, flotilla_serve

pytestmark = pytest.mark.e2e
REPLICAS = 2
KEY = "first-key"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEY + "\n")
    return path


@pytest.fixture(scope="module")
def replicas(
    models_dir: Path, key_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, list[int]]]:
    base = free_port_run(REPLICAS)
    config = tmp_path_factory.mktemp("replicas") / "two-ingress-replicas.yaml"
    config.write_text(
        f"model: {models_dir / 'tiny-llama'}\nserved_model_name: tiny-llama\ncpu: {{threads_per_worker: 1}}\n"
        f"ingress: {{replicas: {REPLICAS}}}\nserving: {{api_keys_file: '{key_file}'}}\n"
    )
    with flotilla_serve(str(config), env={"FLOTILLA_ADMIN_TOKEN": TOKEN}, metrics_port=base) as running:
        connect(running.ray_address)
        yield running, list(range(base, base + REPLICAS))
        ray.shutdown()


def samples(text: str, name: str, **labels: str) -> dict[str, float]:
    """replica → value of the samples called ``name`` with ``labels``, summed per replica."""
    per_replica: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                replica = sample.labels.get("replica", "")
                per_replica[replica] = per_replica.get(replica, 0.0) + sample.value
    return per_replica


def scrape(port: int) -> str:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
    assert response.status_code == 200
    return response.text


def complete(server: Server, count: int, tag: str, key: str = KEY, status: int = 200) -> None:
    for n in range(count):
        body = {"model": "tiny-llama", "prompt": f"{tag} request {n}", "max_tokens": 2}
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
        )
        assert response.status_code == status, response.text


def decisions(port: int, policy: str) -> float:
    return sum(samples(scrape(port), "flotilla_routing_decisions_total", policy=policy).values())


def test_every_replica_is_scraped_on_its_own_port_and_the_cluster_scope_has_the_rest(
    replicas: tuple[Server, list[int]],
) -> None:
    server, ports = replicas
    assert f"own metrics: http://127.0.0.1:{ports[0]}..{ports[-1]}/metrics" in server.output()
    before = [sum(samples(scrape(p), "flotilla_requests_total", endpoint="completions").values()) for p in ports]
    complete(server, 24, "scrape")
    answered = [samples(scrape(p), "flotilla_requests_total", endpoint="completions", status="200") for p in ports]
    labels = [set(a) for a in answered]
    assert all(len(replica) == 1 for replica in labels) and labels[0] != labels[1], labels  # one replica per port
    served = [sum(a.values()) - b for a, b in zip(answered, before, strict=True)]
    assert sum(served) == 24 and min(served) > 0, served  # HAProxy used both; together they saw every request

    cluster = httpx.get(f"{server.url}/metrics", params={"scope": "cluster"}, timeout=30)
    assert cluster.status_code == 200
    assert samples(cluster.text, "flotilla_requests_total") == {}  # the replicas' own series are not repeated
    assert samples(cluster.text, "flotilla_group_state", group="group-0", state="ready") == {"": 1.0}
    assert "vllm:" in cluster.text  # the engines'
    wrong = httpx.get(f"{server.url}/metrics", params={"scope": "mine"}, timeout=30)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "scope"


def test_a_routing_change_reaches_every_replica_and_outlives_restarts(replicas: tuple[Server, list[int]]) -> None:
    server, ports = replicas
    changed = httpx.put(
        f"{server.url}/admin/routing",
        json={"policy": "round_robin"},
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert changed.status_code == 200, changed.text
    cache_aware = [decisions(p, "cache_aware") for p in ports]
    complete(server, 24, "after the change")
    assert all(decisions(p, "round_robin") > 0 for p in ports)  # both replicas, though one took the PUT
    assert [decisions(p, "cache_aware") for p in ports] == cache_aware

    # The coordinator restarts (and keeps the choice); then an ingress replica is replaced by a new one.
    started_at = admin(server, "GET", "/groups")["coordinator_started_at"]
    ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=DEFAULT_NAMESPACE), no_restart=False)
    assert wait_for(lambda: admin(server, "GET", "/groups")["coordinator_started_at"] != started_at, 60)
    victim = scrape_replica_name(ports[0])
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{victim}", namespace="serve"), no_restart=True)
    wait_replaced(ports[0], victim)

    # Its metrics port listens before HAProxy lists it (CI sent 24 requests, all to the other replica).
    def new_replica_answers() -> bool:
        complete(server, 4, "after the restarts")
        return sum(samples(scrape(ports[0]), "flotilla_requests_total", endpoint="completions").values()) > 0

    assert wait_for(new_replica_answers, 120, interval_s=0.5), "no request reached the new replica"
    assert decisions(ports[0], "round_robin") > 0 and decisions(ports[0], "cache_aware") == 0


def test_serve_controller_loops_at_the_local_cluster_setting(replicas: tuple[Server, list[int]]) -> None:
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    health = ray.get(controller.get_health_metrics.remote(), timeout=30)
    assert health["expected_sleep_duration_s"] == LocalClusterConfig().serve_control_loop_s
    assert health["loops_per_second"] <= 1 / LocalClusterConfig().serve_control_loop_s  # Serve's default: about 10


def test_every_ingress_replica_runs_the_app_on_the_event_loop_of_serves_http_server(
    replicas: tuple[Server, list[int]],
) -> None:
    from ray.serve._private.constants import SERVE_NAMESPACE

    def app_loop_threads(replica: object) -> tuple[bool, list[str]]:  # runs in the replica (nested: sent by value)
        import threading

        from ray.serve._private import constants

        threads = [t.name for t in threading.enumerate() if "user_code_event_loop" in t.name]
        return constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, threads

    names = [a.name for a in alive_actors() if (a.name or "").startswith("SERVE_REPLICA::flotilla#OpenAIIngress")]
    assert len(names) == REPLICAS
    for name in names:
        replica = ray.get_actor(name, namespace=SERVE_NAMESPACE)
        assert ray.get(replica.__ray_call__.remote(app_loop_threads), timeout=30) == (False, [])


def wait_replaced(port: int, victim: str) -> None:
    """Until Ray Serve's replacement for the killed replica ``victim`` serves its metrics on ``port``."""

    def replaced() -> bool:
        try:
            return scrape_replica_name(port) != victim
        except (httpx.HTTPError, ValueError):  # not listening yet, or not yet listed alive by Ray
            return False

    assert wait_for(replaced, 120, interval_s=0.5), "no new ingress replica on the port"


def scrape_replica_name(port: int) -> str:
    """The Serve actor name of the replica serving ``port`` (its ``replica`` label is the unique id)."""
    (replica,) = samples(scrape(port), "flotilla_requests_retried_total")
    names = [a.name for a in alive_actors() if a.name]
    (name,) = [n.removeprefix("SERVE_REPLICA::") for n in names if n.startswith("SERVE_REPLICA::") and replica in n]
    return name


def test_a_rotated_api_key_file_reaches_every_replica_without_a_restart(
    replicas: tuple[Server, list[int]], key_file: Path
) -> None:
    server, ports = replicas
    complete(server, 2, "no key yet", key="second-key", status=401)
    unauthorized = [sum(samples(scrape(p), "flotilla_requests_total", status="401").values()) for p in ports]

    key_file.write_text(f"{KEY},second-key\n")  # both work while clients move to the new key

    def new_key_works() -> bool:
        body = {"model": "tiny-llama", "prompt": "rotation", "max_tokens": 2}
        headers = {"authorization": "Bearer second-key"}
        replies = [httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) for _ in range(8)]
        return all(r.status_code == 200 for r in replies)

    assert wait_for(new_key_works, 60, interval_s=0.5), "the added key is not accepted"
    complete(server, 4, "old key still", key=KEY)

    key_file.write_text("second-key\n")  # the old key is retired
    assert wait_for(lambda: all_refused(server, KEY), 60, interval_s=0.5), "the retired key still works"
    complete(server, 4, "new key", key="second-key")
    refused = [sum(samples(scrape(p), "flotilla_requests_total", status="401").values()) for p in ports]
    assert all(after > before for after, before in zip(refused, unauthorized, strict=True))  # both replicas refused


def all_refused(server: Server, key: str) -> bool:
    body = {"model": "tiny-llama", "prompt": "retired", "max_tokens": 2}
    headers = {"authorization": f"Bearer {key}"}
    replies = [httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) for _ in range(8)]
    return all(r.status_code == 401 for r in replies)


def test_killing_an_ingress_replica_under_load_fails_only_requests_in_flight_on_it(
    replicas: tuple[Server, list[int]], key_file: Path
) -> None:
    server, ports = replicas
    wait_every_replica(ports)
    key = key_file.read_text().split(",")[-1].strip()  # the key in force (an earlier test may have rotated it)
    victim = scrape_replica_name(ports[1])
    pid = next(a.pid for a in alive_actors() if a.name == f"SERVE_REPLICA::{victim}")
    with Load(server.url, concurrency=4, headers={"authorization": f"Bearer {key}"}) as load:
        assert wait_for(lambda: in_flight(ports[1]) >= 1, 60, interval_s=0.05), "no request on the victim"
        os.kill(pid, signal.SIGKILL)
        # A dying process still accepts connections for a few ms (CI saw a 500 sent 6 ms after the kill):
        # what it took then was in flight on it too. The load is counted from its death on.
        assert wait_for(lambda: dead(pid), 30, interval_s=0.005), "the replica outlived SIGKILL"
        killed_at = time.time()
        assert wait_for(lambda: load.served_after(killed_at) >= 40, 180), "the other replica did not carry the load"
    assert load.in_flight() == 0
    # Each client loses at most the one request it had on the victim. Known gap, not hidden: CI saw, in
    # two runs, one request sent just after the death answered 500 by HAProxy (Ray's 502/503 page) before
    # it took the dead replica out; so a request sent right after the death may be that lost one.
    lost = load.failures()
    assert len(lost) <= load.concurrency, lost
    wait_replaced(ports[1], victim)
    after = load.served_after(killed_at)
    print(f"ingress replica killed: {len(lost)} request(s) in flight on it failed, {after} sent after it answered")


def dead(pid: int) -> bool:
    """Gone, or a zombie (exited, not yet reaped by its raylet): its sockets are closed either way."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_every_replica(ports: list[int]) -> None:
    """Until a live replica serves metrics on every port (one an earlier test killed may be starting again)."""
    for port in ports:
        wait_replaced(port, victim="")


def in_flight(port: int) -> float:
    return sum(samples(scrape(port), "flotilla_group_in_flight_requests").values())


def alive_actors() -> list:
    from ray.util.state import list_actors

    # The driver's own cluster: with no address the state API takes the machine's latest one ("auto"),
    # which on CI was another test's, gone, and timed out waiting for its GCS.
    address = ray.get_runtime_context().gcs_address
    return list(list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=10_000, detail=True))


def test_the_requests_of_a_dead_ingress_replica_are_aborted_in_the_engine(
    replicas: tuple[Server, list[int]], key_file: Path
) -> None:
    from flotilla.cluster.output_channel import PEER_GRACE_S

    server, ports = replicas
    wait_every_replica(ports)
    key = key_file.read_text().split(",")[-1].strip()
    streams = LongStreams(server.url, key, count=4)
    try:
        assert wait_for(lambda: sum(in_flight(p) for p in ports) >= streams.count, 120, interval_s=0.1)
        victim_port = max(ports, key=in_flight)  # whichever replica HAProxy gave streams to
        on_victim = in_flight(victim_port)
        assert wait_for(lambda: unfinished() == streams.count, 30, interval_s=0.1), unfinished()
        victim = scrape_replica_name(victim_port)
        os.kill(next(a.pid for a in alive_actors() if a.name == f"SERVE_REPLICA::{victim}"), signal.SIGKILL)
        # Its streams would run for 1900 tokens each (far beyond this wait at this machine's speed); the
        # leader aborts them in the engine instead.
        assert wait_for(lambda: unfinished() <= streams.count - on_victim, PEER_GRACE_S + 10, interval_s=0.2), (
            f"{unfinished()} requests still in the engine; {on_victim} were the dead replica's"
        )
    finally:
        streams.stop()
    wait_replaced(victim_port, victim)


def unfinished() -> int:
    """Requests in group-0's engine, as its leader counts them."""
    leader = ray.get_actor(leader_actor_name("group-0"), namespace=DEFAULT_NAMESPACE)
    return int(ray.get(leader.num_unfinished_requests.remote(), timeout=30))


class LongStreams:
    """``count`` streamed completions of 1900 tokens each (far longer than the checks), read until stopped."""

    def __init__(self, url: str, key: str, count: int) -> None:
        self.count = count
        self._stop = threading.Event()
        body = {"model": "tiny-llama", "prompt": "a long story", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        headers = {"authorization": f"Bearer {key}"}

        def read() -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=300) as reply:
                    for _ in reply.iter_lines():
                        if self._stop.is_set():
                            return
            except httpx.HTTPError:
                pass  # the streams on the killed replica break

        self._threads = [threading.Thread(target=read, daemon=True) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
