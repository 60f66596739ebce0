"""An ingress replica's metrics: its own series carry its replica label; the cluster's do not repeat them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from flotilla.cluster.contract import GroupSnapshot, GroupState, Membership
from flotilla.router.metrics import IngressMetrics


def series(text: bytes) -> dict[str, list[dict[str, str]]]:
    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample.labels)
    return found


def test_own_series_are_labelled_with_the_replica_and_cluster_series_are_not() -> None:
    group = GroupSnapshot("group-0", GroupState.READY, 1, None, None, None, "", 0.0)
    stats = IngressMetrics(membership=lambda: Membership(3, 0.0, [group]), replica="abc123")
    stats.requests.labels("completions", "200").inc(2)
    stats.request_latency.labels("completions").observe(0.3)

    own = series(stats.render_replica())
    assert own["flotilla_requests_total"] == [{"endpoint": "completions", "status": "200", "replica": "abc123"}]
    assert {labels["replica"] for labels in own["flotilla_request_latency_seconds_bucket"]} == {"abc123"}
    assert "flotilla_group_state" not in own

    cluster = series(stats.render_cluster())
    assert "flotilla_requests_total" not in cluster
    assert {"group": "group-0", "state": "ready"} in cluster["flotilla_group_state"]
    assert all("replica" not in labels for family in cluster.values() for labels in family)

    assert series(stats.render()) == own | cluster


def test_without_a_replica_the_series_are_unlabelled() -> None:
    stats = IngressMetrics()
    stats.requests.labels("completions", "200").inc()
    assert series(stats.render_replica())["flotilla_requests_total"] == [{"endpoint": "completions", "status": "200"}]
