"""Dashboards and alerts against a real Prometheus scraping a real Flotilla under load.

Debian's ``prometheus`` (installed by ``make test`` when missing) is started on loopback with
deploy/prometheus/flotilla-rules.yaml, scrapes the ingress's ``/metrics`` every 3 seconds while the
test sends traffic, and then:

- every panel query of every dashboard in deploy/grafana must return series, except queries
  that read only the metric families in ``NOT_EXPORTED_YET`` or dcgm-exporter's (GPU nodes only;
  reported as pending, checked as PromQL);
- every alert rule must load and evaluate without error, every alert expression must be
  valid PromQL, and one alert is provoked for real (KV cache near full, with its threshold
  lowered in the test's copy of the rules so that a tiny model can reach it);
- every PromQL snippet in runbooks/ must be valid PromQL;
- killing a group's leader actor (with requests in flight on it) must make the restart alert's
  expression true and retry those requests; killing it again while it restarts exhausts its
  restart budget (``coordinator.max_restarts: 1`` here) and makes the group-failed alert's
  expression true.

``flotilla eplb-demo --metrics-port`` runs beside Flotilla as a second scrape target, so the EPLB
dashboard's queries read real controller metrics.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devtools import REPO, stop_gracefully, wait_for
from flotilla.cluster.ports import free_port
from flotilla.config import ServeConfig
from scripts.dashboards import DASHBOARDS, to_grafana
from scripts.render_manifests import RULES
from tests.deploy.runbook_commands import promql_snippets
from tests.e2e.server import Server, flotilla_serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "tiny-llama"

# Metric families that Flotilla does not export yet: a query that reads only these is reported
# as pending instead of failing. Empty: the coordinator's (issue #4) and EPLB's (issue #5) metrics
# are exported, and this test provokes the events behind the event-only ones (a restart, a retry).
NOT_EXPORTED_YET: frozenset[str] = frozenset()
# Grafana variables as "All" selects them, and a window several scrapes wide.
GRAFANA_VARIABLES = {"$namespace": ".*", "$group": ".*", "$__rate_interval": "2m"}
# The provoked alert: the tiny model never fills 95 % of its KV cache, any request in flight does > 0.
PROVOKED = "FlotillaKVCacheNearFull"
METRIC_NAME = re.compile(r"\b(flotilla_[a-z0-9_]+|vllm:[a-z0-9_:]+|DCGM_[A-Z0-9_]+)")
# NVIDIA's dcgm-exporter runs on GPU nodes only: its panels are checked as PromQL here, with no series.
GPU_NODE_FAMILY = re.compile(r"DCGM_[A-Z0-9_]+")
SERIES_TIMEOUT_S = 60.0


def families(expr: str) -> set[str]:
    """Metric families an expression reads (histogram suffixes folded into their family)."""
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in METRIC_NAME.findall(expr)}


def is_pending(expr: str) -> bool:
    read = families(expr)
    return bool(read) and all(name in NOT_EXPORTED_YET or GPU_NODE_FAMILY.fullmatch(name) for name in read)


def grafana_queries() -> list[tuple[str, str]]:
    """(dashboard / panel / legend, PromQL) of every target of every dashboard, variables filled in."""
    queries = []
    for dashboard in DASHBOARDS:
        model = json.loads((REPO / "deploy" / "grafana" / dashboard.filename).read_text())
        assert model == to_grafana(dashboard), f"{dashboard.filename} is stale: python -m scripts.render_manifests"
        for panel in model["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for variable, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(variable, value)
                queries.append((f"{model['title']} / {panel['title']} / {target['legendFormat']}", expr))
    return queries


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def rules_for_test(tmp_path: Path) -> Path:
    """The rules file, with `for` removed and the provoked alert's threshold lowered."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
            if rule.get("alert") == PROVOKED:
                assert "> 0.95" in rule["expr"]
                rule["expr"] = rule["expr"].replace("> 0.95", "> 0")
            if rule.get("alert") == "FlotillaGroupRestartStorm":
                rule["expr"] = rule["expr"].replace("> 3", "> 0")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.provoked: list[dict[str, str]] = []  # labels of the provoked alert while it fired

    def get(self, path: str, **params: str) -> Any:
        reply = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = reply.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        reply = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = reply.json()
        if body["status"] != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def poll(self, expr: str, timeout_s: float) -> list[dict[str, Any]]:
        """The query's result as soon as it has series, or [] at the deadline."""
        return wait_for(lambda: self.query(expr), timeout_s, 0.5) or []

    def firing(self) -> dict[str, list[dict[str, str]]]:
        alerts: dict[str, list[dict[str, str]]] = {}
        for alert in self.get("/api/v1/alerts")["alerts"]:
            if alert["state"] == "firing":
                alerts.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
        return alerts


def server_config(tmp_path: Path) -> str:
    """examples/local-cpu.yaml with the tiny model, plus a one-restart budget."""
    raw = yaml.safe_load((REPO / "examples" / "local-cpu.yaml").read_text())
    if "coordinator" in ServeConfig.model_fields:
        raw["coordinator"] = {"max_restarts": 1}
    # The tiny model: this module is about metrics and alerts, and it serves a lot of tokens.
    raw["model"], raw["served_model_name"] = str(REPO / "models" / "tiny-llama"), MODEL
    path = tmp_path / "flotilla.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory) -> Iterator[Server]:
    # The product's default of several ingress replicas: each is scraped on its own port, as by the chart.
    with flotilla_serve(server_config(tmp_path_factory.mktemp("config")), ingress_replicas=None) as running:
        yield running


@pytest.fixture(scope="module")
def eplb_demo(models_dir) -> Iterator[str]:
    """`flotilla eplb-demo` serving its controller's metrics; yields host:port."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "flotilla.cli", "eplb-demo", "--ranks", "2", "--duration-s", "900"]
        + ["--metrics-port", str(port), "--model", str(models_dir / "tiny-mixtral")],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_gracefully(process, 60)


@pytest.fixture(scope="module")
def prometheus(server: Server, eplb_demo: str, prometheus_bin: Path, tmp_path_factory) -> Iterator[Prometheus]:
    workdir = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = {
        # /metrics gathers every group's engine metrics: give a busy machine a few seconds.
        "global": {"scrape_interval": "3s", "evaluation_interval": "1s", "scrape_timeout": "3s"},
        "rule_files": [str(rules_for_test(workdir))],
        "scrape_configs": [
            # As the chart's ServiceMonitor: every ingress replica on its own port, the rest from the serving
            # port (?scope=cluster), all under job="flotilla".
            {
                "job_name": "flotilla",
                "params": {"scope": ["cluster"]},
                "static_configs": [{"targets": [server.url.removeprefix("http://")]}],
            },
            {
                "job_name": "flotilla-ingress-replicas",
                "static_configs": [{"targets": server.replica_metrics_targets()}],
                "relabel_configs": [{"target_label": "job", "replacement": "flotilla"}],
            },
            {"job_name": "flotilla-eplb-demo", "static_configs": [{"targets": [eplb_demo]}]},
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            prometheus_bin,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 180  # the demo's Ray and ranks start beside a loading Flotilla
        while not _target_up(prom):
            if process.poll() is not None or time.monotonic() > deadline:
                targets = httpx.get(f"{prom.url}/api/v1/targets", timeout=10).text if process.poll() is None else ""
                raise RuntimeError(
                    f"Prometheus did not scrape Flotilla: {targets}\n"
                    f"flotilla serve exit code: {server.process.poll()}; its last lines:\n"
                    + "\n".join(server.lines[-40:])
                )
            time.sleep(0.5)
        yield prom
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _target_up(prom: Prometheus) -> bool:
    try:
        targets = prom.get("/api/v1/targets")["activeTargets"]
    except (httpx.HTTPError, json.JSONDecodeError, AssertionError):
        return False
    return bool(targets) and all(t["health"] == "up" for t in targets)


def _chat(url: str, content: str, max_tokens: int, stream: bool) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
        reply.read()
        return reply.status_code


def _disconnect_mid_stream(url: str) -> None:
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                break


class RepeatingCallers:
    """Callers that each send request after request until told to stop: traffic surely still in flight at the
    moment a test waits for (on a fast machine one round of long requests can end before it)."""

    def __init__(self, pool: ThreadPoolExecutor, callers: int, send: Callable[[int, int], int]) -> None:
        """``send(caller, n)`` sends caller's n-th request and returns its HTTP status."""
        self._stopping = threading.Event()
        self._callers = [pool.submit(self._repeat, caller, send) for caller in range(callers)]

    def _repeat(self, caller: int, send: Callable[[int, int], int]) -> list[int]:
        statuses = [send(caller, 0)]
        while not self._stopping.is_set():
            statuses.append(send(caller, len(statuses)))
        return statuses

    def stop(self) -> None:
        """Each caller ends with the request it is sending."""
        self._stopping.set()

    def statuses(self) -> list[int]:
        """Every request's status, once the callers have stopped."""
        return [status for caller in self._callers for status in caller.result()]


@pytest.fixture(scope="module")
def loaded(server: Server, prometheus: Prometheus) -> Prometheus:
    """Traffic of every kind a dashboard shows, sent while Prometheus scrapes."""
    url = server.url
    shared = "You are a helpful assistant for the river and mountain survey. " * 8
    with ThreadPoolExecutor(max_workers=6) as pool:
        # Long streams follow one another until the alert fires: one alone may end between two scrapes (3 s
        # apart) on a fast machine, and a finished request's blocks no longer count as used.
        streams = RepeatingCallers(pool, 4, lambda i, _: _chat(url, shared + f"Question {i}?", 200, True))
        futures = [pool.submit(_chat, url, shared + f"Short {i}", 8, i % 2 == 0) for i in range(8)]
        # While the long streams generate, the KV cache holds their blocks: the provoked alert fires.
        try:
            prometheus.provoked = prometheus_wait_firing(prometheus, PROVOKED, timeout_s=SERIES_TIMEOUT_S)
        finally:
            streams.stop()
        statuses = [f.result() for f in futures] + streams.statuses()
    assert statuses == [200] * len(statuses)
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}, timeout=60)
    httpx.post(f"{url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}, timeout=60)  # 404
    httpx.post(f"{url}/v1/chat/completions", content=b'{"model": ', timeout=60)  # 400
    _disconnect_mid_stream(url)
    return prometheus


def prometheus_wait_firing(prom: Prometheus, alert: str, timeout_s: float) -> list[dict[str, str]]:
    return wait_for(lambda: prom.firing().get(alert), timeout_s, 0.5) or []


def test_provoked_alert_fires_under_load(loaded: Prometheus) -> None:
    assert loaded.provoked, f"{PROVOKED} (threshold lowered to 0) did not fire while requests generated"
    assert all(re.fullmatch(r"group-\d+", labels["group"]) for labels in loaded.provoked)
    assert all(labels["severity"] == "warning" for labels in loaded.provoked)
    assert loaded.query("max by (group) (vllm:kv_cache_usage_perc) > 0.95") == []  # the real threshold


def test_every_alert_rule_loads_and_evaluates(loaded: Prometheus) -> None:
    rules = [r for g in loaded.get("/api/v1/rules")["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    for rule in alert_rules():
        loaded.query(rule["expr"])  # raises on invalid PromQL


def test_alerts_that_must_not_fire_stay_quiet(loaded: Prometheus) -> None:
    firing = loaded.firing()
    # 404s and 400s were sent: client errors are not server errors.
    assert "FlotillaHighErrorRate" not in firing
    assert "FlotillaMetricsMissing" not in firing
    assert loaded.query(next(r["expr"] for r in alert_rules() if r["alert"] == "FlotillaHighErrorRate")) == []


def test_runbook_promql_is_valid(loaded: Prometheus) -> None:
    snippets = promql_snippets()
    assert snippets
    errors = []
    for where, expr in snippets:
        try:
            loaded.query(expr)
        except ValueError as err:
            errors.append(f"{where}: {expr}: {err}")
    assert errors == []


KILL_LEADER = """
import sys, time
import ray
from flotilla.cluster.contract import DEFAULT_NAMESPACE, leader_actor_name
from flotilla.cluster.ray_connect import connect

address, group, busy = sys.argv[1], sys.argv[2], sys.argv[3] == "busy"
connect(address)
killed = set()
deadline = time.monotonic() + 120
while not killed and time.monotonic() < deadline:
    try:
        leader = ray.get_actor(leader_actor_name(group), namespace=DEFAULT_NAMESPACE)
    except ValueError:  # between incarnations
        time.sleep(0.2)
        continue
    if busy and ray.get(leader.num_unfinished_requests.remote()) == 0:
        time.sleep(0.05)
        continue
    if leader._actor_id.hex() not in killed:
        ray.kill(leader, no_restart=True)
        killed.add(leader._actor_id.hex())
        print("killed", leader._actor_id.hex(), flush=True)
    time.sleep(0.2)
sys.exit(0 if killed else 1)
"""


def kill_leader(server: Server, group: str, busy: bool = False) -> None:
    """Kill a group's current leader actor through Ray, as a crash would (waits for one to exist).

    ``busy``: kill it only once it reports a request in its engine, asked in the same script, so a
    request is certainly on the group when it dies (Prometheus's in-flight gauge may be seconds old).
    """
    result = subprocess.run(
        [sys.executable, "-c", KILL_LEADER, server.ray_address, group, "busy" if busy else "any"],
        cwd=REPO,
        timeout=180,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"could not kill {group}'s leader:\n{result.stdout}{result.stderr[-3000:]}"


def alert_expr(name: str, threshold: tuple[str, str] | None = None) -> str:
    expr = next(r["expr"] for r in alert_rules() if r["alert"] == name)
    return expr.replace(*threshold) if threshold else expr


@pytest.fixture(scope="module")
def restarted(loaded: Prometheus, server: Server) -> list[dict[str, Any]]:
    """group-1's leader killed while non-streaming requests run on both groups.

    Returns the restart alert's expression (threshold lowered to > 0) once it names a group.
    The requests that were on group-1 saw no token, so the ingress retries them on group-0.
    """
    # Four callers keep long requests going until the kill has landed: the killer connects to Ray
    # first (seconds), and on a fast machine one round of 600-token requests can end before that.
    body = {"model": MODEL, "max_tokens": 600, "ignore_eos": True}

    def complete(caller: int, n: int) -> int:
        reply = httpx.post(f"{server.url}/v1/completions", json=body | {"prompt": f"{caller} rivers {n}"}, timeout=300)
        return reply.status_code

    with ThreadPoolExecutor(max_workers=4) as pool:
        callers = RepeatingCallers(pool, 4, complete)
        try:
            kill_leader(server, "group-1", busy=True)
        finally:
            callers.stop()
        statuses = callers.statuses()
    assert statuses == [200] * len(statuses), "requests on the killed group must be retried elsewhere"
    return loaded.poll(alert_expr("FlotillaGroupRestartStorm", ("> 3", "> 0")), timeout_s=60)


def test_killed_leader_restarts_its_group_and_its_requests_are_retried(
    restarted: list[dict[str, Any]], loaded: Prometheus
) -> None:
    assert [r["metric"]["group"] for r in restarted] == ["group-1"]
    assert loaded.poll("sum(flotilla_requests_retried_total) > 0", timeout_s=30)


def test_every_dashboard_query_returns_series(loaded: Prometheus, restarted: list[dict[str, Any]]) -> None:
    queries = grafana_queries()
    pending, empty, answered = [], [], 0
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    for title, expr in queries:
        if is_pending(expr):
            if loaded.query(expr):
                answered += 1
            else:
                pending.append(title)
            continue
        if loaded.poll(expr, max(1.0, deadline - time.monotonic())):
            answered += 1
        else:
            empty.append(f"{title}: {expr}")
    print(
        f"{answered} of {len(queries)} dashboard queries returned series; "
        f"pending (GPU nodes only, or not exported yet): {pending}"
    )
    assert empty == []
    assert answered >= len(queries) - len(pending) > 0


def test_group_failed_alert_expression_becomes_true(loaded: Prometheus, server: Server, restarted) -> None:
    # group-1 is restarting (budget: one restart). Killing its new leader fails that start too.
    kill_leader(server, "group-1")
    failed = loaded.poll(alert_expr("FlotillaGroupFailed"), timeout_s=120)
    assert [r["metric"]["group"] for r in failed] == ["group-1"]
    assert loaded.query(alert_expr("FlotillaNoReadyGroup")) == []  # group-0 still serves
    assert prometheus_wait_firing(loaded, "FlotillaGroupFailed", timeout_s=30)
