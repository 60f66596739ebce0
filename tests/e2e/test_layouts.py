"""TP and PP layouts on real vLLM workers: placement asserted from Ray, outputs compared.

Two local clusters, one after the other: two simulated nodes with one slot each (TP=1, then
PP=2, which must span both nodes), and one node with two slots (TP=2, then the MoE model).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group_table
from ray.util.state import list_actors

from flotilla.cluster.config import LocalClusterConfig
from flotilla.cluster.contract import RankProcess
from flotilla.cluster.engine import EngineSpec, Executor
from flotilla.cluster.group import ReplicaGroup
from flotilla.cluster.local_ray import LocalCluster, LocalClusterShape
from flotilla.cluster.model_spec import ModelSpec
from flotilla.cluster.planner import kv_capacity_tokens
from flotilla.router.block_keys import block_keys
from flotilla.router.group_channel import GroupChannel
from flotilla.router.kv_events import KvEventFeed
from flotilla.router.prefix_index import PrefixIndex
from flotilla.router.settings import IngressSettings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
PROMPTS = [
    [17, 250, 33, 980, 5, 61, 402, 77],
    [300 + i for i in range(40)],
    [9] * 20,
    [(37 * i) % 997 for i in range(300)],
]
NEW_TOKENS = 24
_ids = itertools.count()


@dataclass
class WorkerActor:
    name: str
    node_id: str
    placement_group_id: str


@dataclass
class LayoutRun:
    group: ReplicaGroup
    placement_group_id: str
    workers: list[WorkerActor]
    outputs: list[list[int]]
    stored_keys: list[int]
    """Block keys the engine announced in BlockStored events while serving PROMPTS."""
    rank_processes: list[RankProcess]
    """Under the mp executor: the leader's child processes serving the ranks."""
    bundles: dict[int, dict[str, float]]
    """The placement group's bundles (index → resources), read while it existed."""


@contextmanager
def local_cluster(nodes: int, slots_per_node: int) -> Iterator[LocalCluster]:
    shape = LocalClusterShape.for_groups(LocalClusterConfig(nodes=nodes, slots_per_node=slots_per_node), 0, 1)
    cluster = LocalCluster(shape, namespace="flotilla", log_to_driver=False)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def engine_requests(spec: EngineSpec, max_model_len: int, block_size: int) -> list:
    """PROMPTS as the ingress sends them: vLLM ``EngineCoreRequest``s, greedy, made by vLLM's input processor."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from flotilla.router.frontend import frontend_config

    settings = IngressSettings(engine=spec, max_model_len=max_model_len, block_size=block_size)
    processor = InputProcessor(frontend_config(settings))
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    return [
        processor.process_inputs(f"p{i}", {"type": "token", "prompt_token_ids": prompt}, params, ("generate",))
        for i, prompt in enumerate(PROMPTS)
    ]


def run_layout(model: Path, tp: int, pp: int, executor: Executor = "ray") -> LayoutRun:
    spec = EngineSpec(
        model=str(model),
        served_model_name=model.name,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        cpu_threads_per_worker=1,
        executor=executor,
    )
    group = ReplicaGroup(f"layout-{next(_ids)}", spec)

    index = PrefixIndex()

    async def start_and_generate() -> list[list[int]]:
        await group.start(timeout_s=600)
        assert group.info is not None and group.info.kv_events_endpoint
        index.add_group(group.name, group.info.num_kv_blocks)
        expected = sum(len(p) // group.info.block_size for p in PROMPTS)
        all_stored = asyncio.Event()

        def on_event(_: str) -> None:
            if index.size(group.name) >= expected:
                all_stored.set()

        feed = KvEventFeed(
            group.name, group.info.kv_events_endpoint, group.info.kv_events_replay_endpoint, index, on_event
        )
        feed.start()
        channel = GroupChannel(group.leader, "127.0.0.1", group.info.inbox_endpoint)
        outputs = []
        for i, request in enumerate(engine_requests(spec, group.info.max_model_len, group.info.block_size)):
            final = [output async for output in channel.stream(request, f"{group.name}-{i}")][-1]
            outputs.append(final.generated_token_ids())
        try:
            await asyncio.wait_for(all_stored.wait(), 30)
        except TimeoutError:
            pass  # the test below reports which keys never arrived
        feed.stop()
        channel.close()
        return outputs

    try:
        outputs = asyncio.run(start_and_generate())
        pg_id = group.placement_group.id.hex()
        workers = [
            WorkerActor(a.name, a.node_id, a.placement_group_id)
            for a in list_actors(
                address=ray.get_runtime_context().gcs_address,
                filters=[("state", "=", "ALIVE")],
                detail=True,
                limit=10_000,
            )
            if a.class_name == "RayWorkerProc" and a.placement_group_id == pg_id
        ]
        stored = index.keys(group.name) if index.has_group(group.name) else []
        description = ray.get(group.leader.describe.remote())
        bundles = placement_group_table(group.placement_group)["bundles"]
        return LayoutRun(
            group, pg_id, sorted(workers, key=lambda w: w.name), outputs, stored, description.rank_processes, bundles
        )
    finally:
        group.stop()


@pytest.fixture(scope="module")
def runs(tiny_llama: Path, tiny_mixtral: Path) -> dict[str, LayoutRun]:
    results = {}
    with local_cluster(nodes=2, slots_per_node=1):
        results["tp1"] = run_layout(tiny_llama, tp=1, pp=1)
        results["pp2"] = run_layout(tiny_llama, tp=1, pp=2)
    with local_cluster(nodes=1, slots_per_node=2):
        results["tp2"] = run_layout(tiny_llama, tp=2, pp=1)
        results["moe_tp2"] = run_layout(tiny_mixtral, tp=2, pp=1)
        results["tp2_mp"] = run_layout(tiny_llama, tp=2, pp=1, executor="mp")
    return results


def test_tp2_runs_two_worker_actors_on_one_node_inside_its_placement_group(runs) -> None:
    run = runs["tp2"]
    assert [w.name.rsplit("_", 1)[-1] for w in run.workers] == ["TP0", "TP1"]
    assert len({w.node_id for w in run.workers}) == 1
    assert all(w.placement_group_id == run.placement_group_id for w in run.workers)
    assert [a.node_id for a in run.group.ranks] == [w.node_id for w in run.workers]


def test_tp2_under_mp_runs_its_ranks_as_the_leaders_children_in_one_bundle(runs) -> None:
    run = runs["tp2_mp"]
    assert run.workers == []  # no Ray worker actors
    # vLLM's titles, VLLM::Worker_TP0 and 1, or the probe's own names where setproctitle gave none
    assert [p.name.removeprefix("VLLM::") for p in run.rank_processes] == ["Worker_TP0", "Worker_TP1"]
    assert all(p.state == "ALIVE" and p.pid for p in run.rank_processes)
    assert run.bundles == {0: {"CPU": 1.0, "GPU": 2.0}}
    assert {a.bundle_index for a in run.group.ranks} == {0}
    assert run.outputs == runs["tp1"].outputs


def test_pp2_runs_its_stages_on_different_nodes(runs) -> None:
    run = runs["pp2"]
    stages = {w.name.rsplit("_", 1)[-1]: w.node_id for w in run.workers}
    assert sorted(stages) == ["PP0", "PP1"]
    assert stages["PP0"] != stages["PP1"]
    assert all(w.placement_group_id == run.placement_group_id for w in run.workers)
    assert {a.pp_rank: a.node_id for a in run.group.ranks} == {0: stages["PP0"], 1: stages["PP1"]}


def test_greedy_output_is_identical_for_tp1_tp2_and_pp2(runs) -> None:
    reference = runs["tp1"].outputs
    assert all(len(tokens) == NEW_TOKENS for tokens in reference)
    assert runs["tp2"].outputs == reference
    assert runs["pp2"].outputs == reference


def test_moe_model_serves_with_tp2(runs) -> None:
    run = runs["moe_tp2"]
    assert len(run.workers) == 2
    assert all(len(tokens) == NEW_TOKENS for tokens in run.outputs)
    assert run.outputs != runs["tp1"].outputs  # different weights, different text


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "moe_tp2"])
def test_planner_kv_capacity_is_within_10_percent_of_what_vllm_reports(runs, tiny_llama, tiny_mixtral, layout) -> None:
    run = runs[layout]
    spec = ModelSpec.from_path(tiny_mixtral if layout.startswith("moe") else tiny_llama)
    engine = run.group.spec
    info = run.group.info
    assert info is not None and info.num_kv_blocks > 0
    reported = info.num_kv_blocks * info.block_size
    estimated = kv_capacity_tokens(
        spec, engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.cpu_kv_cache_memory_bytes
    )
    assert abs(estimated - reported) <= 0.10 * reported, (estimated, reported)


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "tp2_mp"])
def test_router_block_keys_are_the_keys_vllm_announces(runs, layout) -> None:
    """The engine's BlockStored events name exactly the blocks the router computes for the prompts."""
    run = runs[layout]
    assert run.group.info is not None
    block_size = run.group.info.block_size
    expected = [key for prompt in PROMPTS for key in block_keys(prompt, block_size)]
    assert expected, "PROMPTS must contain a prompt of at least one full block"
    assert set(expected) <= set(run.stored_keys)
