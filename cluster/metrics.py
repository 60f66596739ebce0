"""Prometheus families of the cluster's own state: EPLB balance and rebalances, duration histograms.

The ingress exports them with its membership (``flotilla.router.metrics``); ``flotilla eplb-demo``,
which runs an EP group without serving, exports them alone (:class:`EplbCollector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from flotilla.cluster.contract import DURATION_BUCKETS_S, DurationHistogram, EplbStatus


class EplbCollector(Collector):
    """Only the EPLB metrics, for a process that runs an EP group without serving (``flotilla eplb-demo``)."""

    def __init__(self, eplb: Callable[[], EplbStatus | None]) -> None:
        self.eplb = eplb

    def collect(self) -> Iterator[Metric]:
        status = self.eplb()
        if status is not None:
            yield from eplb_metrics(status)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def eplb_metrics(eplb: EplbStatus) -> Iterator[Metric]:
    """The expert-parallel group's balance and rebalances (its EPLB controller's view)."""
    per_layer = GaugeMetricFamily(
        "flotilla_eplb_balancedness", "Mean/max per-rank expert load over the window, per layer", labels=["layer"]
    )
    for layer, value in enumerate(eplb.balancedness_per_layer):
        per_layer.add_metric([str(layer)], value)
    yield per_layer
    if eplb.balancedness is not None:
        yield GaugeMetricFamily(
            "flotilla_eplb_balancedness_overall",
            "Sum of mean over sum of max per-rank load, all layers",
            value=eplb.balancedness,
        )
    yield GaugeMetricFamily(
        "flotilla_eplb_migrating", "1 while a rebalance moves expert weights", value=float(eplb.state == "migrating")
    )
    yield CounterMetricFamily("flotilla_eplb_rebalances", "Completed EPLB rebalances", value=eplb.rebalances)
    yield CounterMetricFamily(
        "flotilla_eplb_experts_moved",
        "Expert replicas whose weights moved between ranks",
        value=eplb.experts_moved_total,
    )
    yield CounterMetricFamily(
        "flotilla_eplb_bytes_moved", "Expert weight bytes moved between ranks", value=eplb.bytes_moved_total
    )
    yield duration_histogram(
        "flotilla_eplb_rebalance_duration_seconds", "Rebalance, plan to last layer swapped", eplb.rebalance_duration
    )


def duration_histogram(name: str, documentation: str, histogram: DurationHistogram) -> HistogramMetricFamily:
    buckets = [(str(bound), float(count)) for bound, count in zip(DURATION_BUCKETS_S, histogram.counts, strict=True)]
    buckets.append(("+Inf", float(histogram.count)))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=histogram.total)
