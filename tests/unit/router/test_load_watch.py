"""An ingress follows each group's engine load by a watch its leader answers once the load changes:
an idle group costs no calls, a busy one is read at most every ``load_poll_s``. Without Ray: the
leader is the real class, its actor handle a stand-in that calls it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from flotilla.cluster.contract import EnginePhase, GroupSnapshot, GroupState, LoadReport, Membership
from flotilla.cluster.engine import EngineSpec
from flotilla.cluster.leader import GroupLeader
from flotilla.router.group_directory import GroupDirectory
from flotilla.router.settings import IngressSettings, RoutingConfig

SPEC = EngineSpec(model="/m", served_model_name="m", tensor_parallel_size=1, pipeline_parallel_size=1)


@dataclass
class Stats:  # the fields of vLLM's SchedulerStats the leader reads
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float


@dataclass
class Info:
    block_size: int = 16
    num_kv_blocks: int = 1000
    max_model_len: int = 4096
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    inbox_endpoint: str = "tcp://127.0.0.1:9"  # nobody listens: nothing is submitted here


def ready_leader() -> GroupLeader:
    leader = GroupLeader("g", SPEC, placement_group=None, bundle_indices="0")
    leader.phase, leader.vllm_instance_id = EnginePhase.READY, "e1"
    return leader


def test_a_load_watch_is_answered_when_the_engine_steps_with_a_new_load() -> None:
    async def scenario() -> None:
        leader = ready_leader()
        idle = leader.load()
        assert (await leader.watch_load(None, 5.0)) == idle  # the caller knows nothing yet: answered at once

        watch = asyncio.create_task(leader.watch_load(idle, 5.0))
        await asyncio.sleep(0.05)
        leader._scheduler_stats.recorded(Stats(0, 0, 0.0))  # a step that leaves the load as it was
        await asyncio.sleep(0.05)
        assert not watch.done()
        leader._scheduler_stats.recorded(Stats(3, 1, 0.25))
        busy = await asyncio.wait_for(watch, 1.0)
        assert (busy.running, busy.waiting, busy.kv_usage, busy.vllm_instance_id) == (3, 1, 0.25, "e1")
        assert (await leader.watch_load(idle, 5.0)) == busy  # the caller is behind: answered at once

    asyncio.run(scenario())


def test_a_load_watch_on_an_idle_engine_ends_at_its_timeout_with_the_load_as_it_was() -> None:
    async def scenario() -> None:
        leader = ready_leader()
        idle = leader.load()
        began = time.monotonic()
        assert (await leader.watch_load(idle, 0.2)) == idle
        assert 0.2 <= time.monotonic() - began < 2.0

    asyncio.run(scenario())


class Coordinator:
    """Membership never changes."""

    def __init__(self) -> None:
        self.watch = SimpleNamespace(remote=self._never)

    async def _never(self, *_: Any) -> Membership:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def counted(call: Callable[..., Any], calls: list[LoadReport | None], arrived: asyncio.Event) -> Any:
    async def remote(known: LoadReport | None, timeout_s: float) -> LoadReport:
        calls.append(known)
        arrived.set()
        return await call(known, timeout_s)

    return SimpleNamespace(remote=remote)


def test_a_directory_asks_an_idle_group_once_and_follows_its_load_when_it_steps() -> None:
    async def scenario() -> None:
        leader = ready_leader()
        calls: list[LoadReport | None] = []
        arrived = asyncio.Event()
        handle = SimpleNamespace(watch_load=counted(leader.watch_load, calls, arrived))
        group = GroupSnapshot("g", GroupState.READY, 1, handle, Info(), "e1", "", 0.0)  # type: ignore[arg-type]
        settings = IngressSettings(
            engine=SPEC, max_model_len=4096, block_size=16, routing=RoutingConfig(kv_events=False, load_poll_s=0.01)
        )
        directory = GroupDirectory(settings, Coordinator(), Membership(1, 1.0, [group]), "127.0.0.1")
        directory.ensure_started()
        async with asyncio.timeout(5):
            while len(calls) < 2:  # the first watch is answered at once (it knows nothing), the second placed
                await arrived.wait()
                arrived.clear()
        await asyncio.sleep(0.5)  # a window with nothing to report: polled every load_poll_s, 50 more calls
        assert calls == [None, leader.load()]  # the second watch still waits for the engine to step

        leader._scheduler_stats.recorded(Stats(3, 1, 0.5))
        async with asyncio.timeout(5):
            while len(calls) < 3:  # the watch is answered, the router updated, then the next watch placed
                await arrived.wait()
                arrived.clear()
        view = directory.router.view("g")
        assert (view.engine_running, view.engine_waiting, view.kv_usage) == (3, 1, 0.5)
        assert calls[2] == leader.load()  # the next watch waits on the new load

        directory._retire(directory.members["g"])  # a gang restart replaces the member: its watch stops

    asyncio.run(scenario())
