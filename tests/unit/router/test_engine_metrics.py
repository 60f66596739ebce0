from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from flotilla.router.engine_metrics import merge_group_metrics

ENGINE_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""


def test_groups_are_labelled_and_families_merged() -> None:
    text = merge_group_metrics(
        {"group-1": ENGINE_TEXT.format(running=3, hits=7), "group-0": ENGINE_TEXT.format(running=1, hits=2)}
    ).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"vllm:num_requests_running", "vllm:prefix_cache_hits"}
    running = {s.labels["group"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"group-0": 1.0, "group-1": 3.0}
    hits = {s.labels["group"]: s.value for s in families["vllm:prefix_cache_hits"].samples if s.name.endswith("_total")}
    assert hits == {"group-0": 2.0, "group-1": 7.0}
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1


def test_no_groups_no_output() -> None:
    assert merge_group_metrics({}) == b""
