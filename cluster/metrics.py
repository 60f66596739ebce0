"""Prometheus families of the cluster's own state: EPLB balance and rebalances, duration histograms.

The ingress exports them with its membership (``flotilla.router.metrics``); ``flotilla eplb-demo``,
which runs an EP group without serving, exports them alone (:class:`EplbCollector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from flotilla.cluster.contract import DURATION_BUCKETS_S, DurationHistogram, EplbStatus


class EplbCollector(Collector):
    """Only the EPLB metrics, for a process that runs an EP group without serving (``flotilla eplb-demo``)."""

    def __init__(self, eplb: Callable[[], list[EplbStatus]]) -> None:
        self.eplb = eplb

    def collect(self) -> Iterator[Metric]:
        yield from eplb_metrics(self.eplb())

    def describe(self) -> Iterator[Metric]:
        return iter(())


def eplb_metrics(groups: Iterable[EplbStatus]) -> Iterator[Metric]:
    """Every expert-parallel group's balance and rebalances (its EPLB's view), labelled by EP group."""
    per_layer = GaugeMetricFamily(
        "flotilla_eplb_balancedness",
        "Mean/max per-rank expert load over the window, per layer",
        labels=["group", "layer"],
    )
    overall = GaugeMetricFamily(
        "flotilla_eplb_balancedness_overall", "Sum of mean over sum of max per-rank load, all layers", labels=["group"]
    )
    migrating = GaugeMetricFamily(
        "flotilla_eplb_migrating", "1 while a rebalance moves expert weights", labels=["group"]
    )
    rebalances = CounterMetricFamily("flotilla_eplb_rebalances", "Completed EPLB rebalances", labels=["group"])
    moved = CounterMetricFamily(
        "flotilla_eplb_experts_moved", "Expert replicas whose weights moved between ranks", labels=["group"]
    )
    moved_bytes = CounterMetricFamily(
        "flotilla_eplb_bytes_moved", "Expert weight bytes moved between ranks", labels=["group"]
    )
    steps = GaugeMetricFamily(
        "flotilla_eplb_steps_since_rebalance",
        "vLLM's EPLB: engine steps since the last rearrangement",
        labels=["group"],
    )
    window = GaugeMetricFamily(
        "flotilla_eplb_window_samples",
        "Load samples the balancedness covers (vLLM: engine steps recorded under the current placement)",
        labels=["group"],
    )
    durations = HistogramMetricFamily(
        "flotilla_eplb_rebalance_duration_seconds", "Rebalance, plan to last layer swapped", labels=["group"]
    )
    for eplb in groups:
        group = [eplb.group]
        for layer, value in enumerate(eplb.balancedness_per_layer):
            per_layer.add_metric([eplb.group, str(layer)], value)
        if eplb.balancedness is not None:
            overall.add_metric(group, eplb.balancedness)
        migrating.add_metric(group, float(eplb.state == "migrating"))
        rebalances.add_metric(group, eplb.rebalances)
        moved.add_metric(group, eplb.experts_moved_total)
        moved_bytes.add_metric(group, eplb.bytes_moved_total)
        durations.add_metric(group, _buckets(eplb.rebalance_duration), eplb.rebalance_duration.total)
        window.add_metric(group, eplb.window_ticks)
        if eplb.steps_since_rebalance is not None:
            steps.add_metric(group, eplb.steps_since_rebalance)
    yield from (per_layer, overall, migrating, rebalances, moved, moved_bytes, steps, window, durations)


def duration_histogram(name: str, documentation: str, histogram: DurationHistogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, buckets=_buckets(histogram), sum_value=histogram.total)


def _buckets(histogram: DurationHistogram) -> list[tuple[str, float]]:
    buckets = [(str(bound), float(count)) for bound, count in zip(DURATION_BUCKETS_S, histogram.counts, strict=True)]
    buckets.append(("+Inf", float(histogram.count)))
    return buckets
