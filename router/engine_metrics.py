"""Re-export each group's vLLM metrics on the ingress, with a ``group`` label added.

Every leader exposes its engine's ``vllm:*`` metrics; the ingress merges them into one valid
exposition (one HELP/TYPE per family, samples of all groups beneath it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

ENGINE_METRIC_PREFIX = "vllm:"


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_group_metrics(texts: Mapping[str, str]) -> bytes:
    """Exposition text of every ``vllm:`` family of every group, each sample labelled with its group."""
    merged: dict[str, Metric] = {}
    for group, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(ENGINE_METRIC_PREFIX):
                continue
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                target.samples.append(sample._replace(labels={**sample.labels, "group": group}))
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
