"""Wide EP through ``flotilla serve --config examples/wide-ep-cpu.yaml``: tiny-mixtral as one group of
DP = 2 vLLM engines × EP = 2 on two simulated nodes (real vLLM, Flotilla's CPU platform plugin).

Greedy answers, with both DP ranks busy at once, equal one vLLM engine's without EP; each DP rank is
its own routing target; vLLM's EPLB (on CPU through the plugin) rebalances the experts under a skewed
load, balancedness rises and the answers stay the same; a rank killed under load takes the whole EP
group out and brings it back as one gang, with 503 + ``Retry-After`` meanwhile (no other group can
serve), never a hang or a 500.

Without the plugin's two CPU pieces (``flotilla.cluster.vllm_cpu_ep``) the naive all-to-all raises
``NotImplementedError`` in ``all_gatherv`` and the experts read past their local weights.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from devtools import REPO, Load, wait_for
from tests.e2e.faults import TOKEN, cluster_status, group, rank_pid, routed_to, status, wait_back_in_routing
from tests.e2e.server import Server, flotilla_serve, vllm_serve

pytestmark = pytest.mark.e2e

MODEL = "tiny-mixtral"
RANKS = ("group-0-dp0", "group-0-dp1")
PROMPTS = [f"The {word} river and the mountain {i}" for i, word in enumerate(["red", "old", "long", "quiet"] * 2)]


EXAMPLE = "examples/wide-ep-cpu.yaml"
EP_GROUP = "group-0"


def greedy(url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def answers(url: str) -> list[str]:
    """Every prompt, sent concurrently (through Flotilla: both DP ranks busy at once)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda prompt: greedy(url, prompt), PROMPTS))


@pytest.fixture(scope="module")
def reference(tiny_mixtral: Path) -> list[str]:
    """One vLLM engine, no DP, no EP: what the wide-EP group must answer."""
    with vllm_serve(tiny_mixtral, MODEL, []) as url:
        return answers(url)


STEP_INTERVAL = 1024
"""vLLM starts 3/4 into its first interval and records load only in the last window's steps before each
rearrangement: with the example's 128 steps the module's earlier tests left no window of the skewed load
under the initial placement. Here the skewed load starts before step 896 and has 128 steps to itself."""
WINDOW = 128
"""vLLM's load window, in engine steps: the example's 32 steps are a second or two of load here, and two
such readings of one placement under one load differed by more than a rebalance gained (0.905, 0.891)."""
MIN_SAMPLES = WINDOW // 2
"""Steps recorded under one placement before its balancedness counts (the coordinator reads every 2 s)."""


@pytest.fixture(scope="module")
def server(reference: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # after the reference: one server at a time on 2 cores
    raw = yaml.safe_load((REPO / EXAMPLE).read_text())
    raw["engine_args"]["eplb_config"].update(step_interval=STEP_INTERVAL, window_size=WINDOW)
    config = tmp_path_factory.mktemp("wide-ep") / Path(EXAMPLE).name
    config.write_text(yaml.safe_dump(raw))
    with flotilla_serve(str(config), env={"FLOTILLA_ADMIN_TOKEN": TOKEN}) as running:
        yield running


def test_a_dp2_ep2_group_answers_like_one_engine_and_routes_to_each_rank(server: Server, reference) -> None:
    assert "1 group(s) × DP=2 (wide EP) × TP=1 × PP=1" in server.output()
    before = {rank: routed_to(server, rank) for rank in RANKS}
    assert answers(server.url) == reference
    assert all(routed_to(server, rank) > before[rank] for rank in RANKS), "a DP rank got no request"
    listed = {g["name"]: g for g in status(server)}
    assert sorted(listed) == list(RANKS) and all(g["state"] == "ready" for g in listed.values())
    nodes = {g["ranks"][0]["node_id"] for g in listed.values()}
    assert len(nodes) == 2, "both DP ranks on one node: the example asks for one per node"


def eplb_reading(server: Server) -> dict[str, float]:
    """The EP group's ``flotilla_eplb_*`` series, as the coordinator read them from the engines."""
    text = httpx.get(f"{server.url}/metrics", params={"scope": "cluster"}, timeout=30).text
    return {
        line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("flotilla_eplb_") and f'group="{EP_GROUP}"' in line and "layer=" not in line
    }


def settled_balance(server: Server, recorded_from: float = 0) -> tuple[int, float] | None:
    """(rebalances so far, balancedness) once the coordinator's balancedness covers ``MIN_SAMPLES`` steps
    recorded under the current placement, none of them before step ``recorded_from``."""
    reading = eplb_reading(server)
    samples = reading.get("flotilla_eplb_window_samples", 0)
    first_recorded = reading.get("flotilla_eplb_steps_since_rebalance", 0) - samples
    if samples < MIN_SAMPLES or first_recorded < recorded_from or "flotilla_eplb_balancedness_overall" not in reading:
        return None
    return int(reading["flotilla_eplb_rebalances_total"]), reading["flotilla_eplb_balancedness_overall"]


@pytest.mark.slow
def test_vllms_eplb_rebalances_the_skewed_ep_group_and_the_answers_stay_the_same(server: Server, reference) -> None:
    before_load = eplb_reading(server).get("flotilla_eplb_steps_since_rebalance", 0)
    assert before_load < STEP_INTERVAL - WINDOW, "the earlier tests' steps reached vLLM's first recorded window"
    # One prompt over and over, greedy: the same tokens each time, so a few experts get most of them.
    with Load(server.url, MODEL, sampling={"temperature": 0}):
        # The skewed load's own steps under the initial placement (not the earlier tests' load).
        initial = wait_for(lambda: settled_balance(server, recorded_from=before_load), 300)
        assert initial, "vLLM's EPLB state never reached the coordinator"
        assert initial[0] == 0, f"a rebalance before the skewed load: {initial}"
        # vLLM records the new placement's load in the last window before its next rearrangement only.
        rebalanced = wait_for(lambda: (b := settled_balance(server)) is not None and b[0] >= 1 and b, 600)
        assert rebalanced, "no rebalance under a skewed load"
    assert rebalanced[1] > initial[1], f"balancedness fell: {initial[1]:.3f} -> {rebalanced[1]:.3f}"
    assert answers(server.url) == reference, "the rebalanced experts answer differently"
    (eplb,) = cluster_status(server)["eplb"]  # flotilla status shows it too
    assert eplb["group"] == EP_GROUP and eplb["rebalances"] >= 1 and eplb["ranks"] == 2
    assert eplb["experts_moved_total"] > 0 and eplb["bytes_moved_total"] > 0


@pytest.mark.slow
def test_a_killed_rank_restarts_the_whole_ep_group_once(server: Server, reference) -> None:
    before = {rank: group(server, rank) for rank in RANKS}
    with Load(server.url, MODEL) as load:
        os.kill(rank_pid(server, "group-0-dp1", rank=0), signal.SIGKILL)
        assert wait_for(lambda: all(group(server, r)["state"] != "ready" for r in RANKS), 10), "death unnoticed"
        # No other group can serve meanwhile: a retryable 503 at once, never a hang.
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        after = {rank: wait_back_in_routing(server, rank, before[rank]["generation"]) for rank in RANKS}
        recovered = max(float(g["since"]) for g in after.values())

        def served_again() -> float | None:
            """When the first request sent after the recovery came back served: the ingress knew by then."""
            return next((o.ended for o in load.outcomes if o.started >= recovered and o.status == 200), None)

        first_served = wait_for(served_again, 120)
        assert first_served, "no request served after the group came back"
        assert wait_for(lambda: load.answered_since(first_served) >= 8, 120), "too few answers after recovery"
    assert load.in_flight() == 0, "requests never came back"
    assert {o.status for o in load.failures()} <= {503}, load.failures()[:3]
    for rank in RANKS:  # one gang restart, seen by both ranks; the next engine generation, and no other since
        now = group(server, rank)
        grown = {k: n - before[rank]["restarts"].get(k, 0) for k, n in now["restarts"].items()}
        assert sum(grown.values()) == 1 and now["generation"] == before[rank]["generation"] + 1, now
    late = [o for o in load.outcomes if o.started >= first_served and o.status != 200]
    assert not late, f"{len(late)} failed after the first success at {first_served:.3f}: {late[:2]}"
    assert answers(server.url) == reference
