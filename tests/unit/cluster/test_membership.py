"""Group lifecycle without Ray: the coordinator's state machine over fake groups, restart backoff,
and an ingress directory following membership snapshots."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from flotilla.cluster import coordinator as coordinator_module
from flotilla.cluster.contract import (
    EngineInfo,
    EnginePhase,
    GroupSnapshot,
    GroupState,
    LeaderHealth,
    Membership,
    RoutingChoice,
)
from flotilla.cluster.coordinator import Coordinator, UnknownGroup
from flotilla.cluster.engine import EngineSpec
from flotilla.cluster.group import Member, member_names
from flotilla.cluster.lifecycle import RecoveryConfig, RestartBudget
from flotilla.router.group_directory import GroupDirectory, with_engine_shape
from flotilla.router.routing import NoRoutableGroup
from flotilla.router.settings import IngressSettings, RoutingConfig

BLOCK = 16
PROMPT = list(range(100, 100 + 4 * BLOCK + 3))
FAST = RecoveryConfig(
    health_period_s=0.01, hang_timeout_s=0.05, health_timeout_s=0.05, death_verdict_s=0.05, backoff_base_s=0.01
)


# --- restart budget --------------------------------------------------------------------------------


def test_backoff_doubles_and_the_budget_runs_out() -> None:
    budget = RestartBudget(RecoveryConfig(max_restarts=4, window_s=100, backoff_base_s=2, backoff_max_s=5))
    assert [budget.next_delay(t) for t in (0, 1, 2, 3)] == [0.0, 2.0, 4.0, 5.0]
    assert budget.next_delay(4) is None  # a fifth failure within the window


def test_old_failures_leave_the_window() -> None:
    budget = RestartBudget(RecoveryConfig(max_restarts=2, window_s=10))
    assert budget.next_delay(0) == 0.0
    assert budget.next_delay(1) is not None
    assert budget.next_delay(20) == 0.0  # both earlier failures are older than the window


# --- the coordinator over fake groups --------------------------------------------------------------


@dataclass
class FakeLeader:
    health_result: LeaderHealth = field(default_factory=lambda: LeaderHealth(True, None, 0, 0.0))
    dead: bool = False
    frozen: bool = False

    @property
    def health(self) -> Any:
        leader = self

        class Call:
            @staticmethod
            async def remote() -> LeaderHealth:
                if leader.frozen:
                    await asyncio.sleep(3600)
                if leader.dead:
                    raise ConnectionError("actor died")
                return leader.health_result

        return Call

    @property
    def num_unfinished_requests(self) -> Any:
        class Call:
            @staticmethod
            async def remote() -> int:
                return 0

        return Call


class FakeGroup:
    """Stands in for cluster.group.ReplicaGroup; every instance is one generation of a group."""

    started: list[str] = []
    fail_starts: set[str] = set()
    leftovers: dict[str, tuple[int, bool]] = {}
    """group → (generation, ready) of what a previous coordinator left running."""
    torn_down: list[str] = []

    def __init__(self, name: str, spec: EngineSpec, namespace: str = "", generation: int = 0) -> None:
        self.name, self.spec, self.generation = name, spec, generation
        self.phase = EnginePhase.PLACING
        self.members = [Member(member, rank) for rank, member in enumerate(member_names(name, spec.data_parallel_size))]
        self.error: str | None = None
        self.placement_group = None

    @property
    def leader(self) -> FakeLeader | None:
        return self.members[0].leader

    @property
    def instance_id(self) -> str | None:
        return self.members[0].instance_id

    def _up(self, instance: str) -> None:
        for member in self.members:
            member.leader = FakeLeader()
            member.info = EngineInfo(
                64, BLOCK, 100, f"{member.name}-{instance}", startup_s=0.0, inbox_endpoint="tcp://127.0.0.1:9"
            )
        self.phase = EnginePhase.READY

    async def start(self, timeout_s: float, on_progress: Any = None) -> None:
        FakeGroup.started.append(self.name)
        await asyncio.sleep(0.05)  # long enough for watchers to see the group start
        if self.name in FakeGroup.fail_starts:
            self.phase, self.error = EnginePhase.FAILED, "engine would not start"
            raise RuntimeError(self.error)
        self._up(str(len(FakeGroup.started)))

    async def adopt(self) -> bool:
        self.generation, ready = FakeGroup.leftovers.get(self.name, (0, False))
        if ready:
            self._up("adopted")
        return ready

    async def teardown(self, graceful: bool = True) -> None:
        FakeGroup.torn_down.append(self.name)
        for member in self.members:
            member.leader = None
        self.phase = EnginePhase.STOPPED

    def describe_step(self) -> str:
        return f"{self.phase.value}: {self.error or ''}"


@pytest.fixture
def fake_groups(monkeypatch: pytest.MonkeyPatch) -> type[FakeGroup]:
    FakeGroup.started, FakeGroup.fail_starts, FakeGroup.leftovers, FakeGroup.torn_down = [], set(), {}, []
    monkeypatch.setattr(coordinator_module, "ReplicaGroup", FakeGroup)
    return FakeGroup


def make_coordinator(recovery: RecoveryConfig = FAST) -> Coordinator:
    spec = EngineSpec(model="m", served_model_name="m", tensor_parallel_size=1, pipeline_parallel_size=1)
    return Coordinator({"g0": spec, "g1": spec}, recovery, startup_timeout_s=10, namespace="test")


async def until(coordinator: Coordinator, condition: Any, timeout_s: float = 5.0) -> Membership:
    """The first membership snapshot that satisfies ``condition`` (follows ``watch`` like an ingress)."""
    membership = await coordinator.get_membership()
    async with asyncio.timeout(timeout_s):
        while not condition(membership):
            membership = await coordinator.watch(membership.version, membership.coordinator_started_at)
    return membership


def state(membership: Membership, name: str) -> GroupState:
    group = membership.group(name)
    assert group is not None
    return group.state


def test_a_dead_leader_restarts_only_its_group(fake_groups: type[FakeGroup]) -> None:
    async def scenario() -> None:
        coordinator = make_coordinator()
        await coordinator.start()
        ready = await until(coordinator, lambda m: len(m.ready()) == 2)
        first = {g.name: g.instance_id for g in ready.groups}
        coordinator.records["g0"].runtime.leader.dead = True
        restarting = await until(coordinator, lambda m: state(m, "g0") is GroupState.RESTARTING)
        assert state(restarting, "g1") is GroupState.READY
        back = await until(coordinator, lambda m: len(m.ready()) == 2)
        g0, g1 = back.group("g0"), back.group("g1")
        assert g0 is not None and g1 is not None
        assert g0.instance_id != first["g0"] and g0.generation == 2 and g0.restarts == {"leader_died": 1}
        assert g1.instance_id == first["g1"] and g1.generation == 1 and not g1.restarts
        assert back.events[-1].kind == "leader_died" and back.events[-1].back_in_routing_at is not None
        assert back.recovery.count == 1 and back.detection.count == 1
        await coordinator.shutdown()

    asyncio.run(scenario())


def test_a_new_coordinator_adopts_ready_groups_and_restarts_broken_ones(
    fake_groups: type[FakeGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coordinator restarted by Ray finds g1 serving and g0 broken (say, by the node loss that also
    killed the old coordinator): g1 is adopted untouched, g0's leftovers are torn down (they hold
    resources) and it restarts with a newer generation, counted as a restart."""
    monkeypatch.setattr(coordinator_module, "_was_restarted", lambda: True)
    fake_groups.leftovers = {"g0": (3, False), "g1": (2, True)}

    async def scenario() -> None:
        coordinator = make_coordinator()
        await coordinator.start()
        back = await until(coordinator, lambda m: len(m.ready()) == 2)
        g0, g1 = back.group("g0"), back.group("g1")
        assert g0 is not None and g1 is not None
        assert g1.generation == 2 and g1.instance_id == "g1-adopted" and not g1.restarts
        assert g0.generation == 4 and g0.restarts == {"engine_dead": 1}
        assert fake_groups.torn_down == ["g0"] and fake_groups.started == ["g0"]
        await coordinator.shutdown()

    asyncio.run(scenario())


def test_a_wide_ep_group_is_one_gang_of_routable_dp_ranks(fake_groups: type[FakeGroup]) -> None:
    """Each DP rank is its own routing target; one rank's death takes every rank of its group out of
    routing and recreates them all (LWS RecreateGroupOnPodRestart); the other group is untouched."""
    spec = EngineSpec("m", "m", tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=2)

    async def scenario() -> None:
        coordinator = Coordinator({"ep": spec, "g1": replace(spec, data_parallel_size=1)}, FAST, 10, "test")
        await coordinator.start()
        ready = await until(coordinator, lambda m: len(m.ready()) == 3)
        assert [g.name for g in ready.groups] == ["ep-dp0", "ep-dp1", "g1"]
        assert len({g.instance_id for g in ready.groups}) == 3 and len({id(g.leader) for g in ready.groups}) == 3
        coordinator.records["ep"].runtime.members[1].leader.dead = True
        restarting = await until(coordinator, lambda m: state(m, "ep-dp0") is GroupState.RESTARTING)
        assert state(restarting, "ep-dp1") is GroupState.RESTARTING and state(restarting, "g1") is GroupState.READY
        assert {g.name for g in restarting.ready()} == {"g1"}
        back = await until(coordinator, lambda m: len(m.ready()) == 3)
        assert [g.generation for g in back.groups] == [2, 2, 1]
        assert back.events[-1].group == "ep" and back.events[-1].reason.startswith("ep-dp1: leader unreachable")
        assert fake_groups.started == ["ep", "g1", "ep"] and fake_groups.torn_down == ["ep"]
        drained = await coordinator.drain("ep-dp1")  # an operator names a rank: the gang drains
        assert drained.name == "ep-dp1" and state(coordinator.membership, "ep-dp0") is GroupState.DRAINING
        await coordinator.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "fault",
    [
        "no_progress",
        "frozen_leader",
        "engine_dead",
        "killed_leader_slow_to_fail",
        "killed_leader_listed_late",
        "killed_leader_listed_after_the_health_timeout",
    ],
)
def test_hangs_and_dead_engines_are_detected(
    fake_groups: type[FakeGroup], fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        # Ray's verdict may come later than the health timeout: the leader counts as hung only after death_verdict_s
        coordinator = make_coordinator(FAST.model_copy(update={"death_verdict_s": 2.0}))
        await coordinator.start()
        await until(coordinator, lambda m: len(m.ready()) == 2)
        leader = coordinator.records["g1"].runtime.leader
        if fault == "no_progress":  # requests in the engine, no step for longer than hang_timeout_s
            leader.health_result = LeaderHealth(True, None, unfinished_requests=3, seconds_since_progress=1.0)
        elif fault == "frozen_leader":
            leader.frozen = True
        elif fault == "killed_leader_slow_to_fail":  # its health call hangs, but Ray's actor table says dead
            leader.frozen = True
            monkeypatch.setattr(coordinator_module, "_actor_dead", lambda handle: handle is leader)
        elif fault == "killed_leader_listed_late":  # ... and Ray lists it dead only at the third look
            leader.frozen = True
            looks: list[Any] = []
            monkeypatch.setattr(
                coordinator_module, "_actor_dead", lambda handle: handle is leader and len(looks.append(0) or looks) > 2
            )
        elif fault == "killed_leader_listed_after_the_health_timeout":  # ... 10 health timeouts after its first look
            leader.frozen = True
            loop = asyncio.get_running_loop()
            first_look: list[float] = []

            def listed_dead(handle: Any) -> bool:
                first_look[:] = first_look or [loop.time()]
                return handle is leader and loop.time() - first_look[0] > 10 * FAST.health_timeout_s

            monkeypatch.setattr(coordinator_module, "_actor_dead", listed_dead)
        else:
            leader.health_result = LeaderHealth(False, "EngineDeadError: worker died", 0, 0.0)
        back = await until(coordinator, lambda m: (m.group("g1").generation == 2) and len(m.ready()) == 2)
        expected = {
            "no_progress": "hang",
            "frozen_leader": "hang",
            "engine_dead": "engine_dead",
            "killed_leader_slow_to_fail": "leader_died",
            "killed_leader_listed_late": "leader_died",
            "killed_leader_listed_after_the_health_timeout": "leader_died",
        }[fault]
        assert back.group("g1").restarts == {expected: 1}
        await coordinator.shutdown()

    asyncio.run(scenario())


def test_idle_engine_is_not_a_hang(fake_groups: type[FakeGroup]) -> None:
    async def scenario() -> None:
        coordinator = make_coordinator()
        await coordinator.start()
        await until(coordinator, lambda m: len(m.ready()) == 2)
        leader = coordinator.records["g0"].runtime.leader
        leader.health_result = LeaderHealth(True, None, unfinished_requests=0, seconds_since_progress=100.0)
        for _ in range(20):
            await coordinator._supervise_once()
        assert coordinator.records["g0"].generation == 1
        await coordinator.shutdown()

    asyncio.run(scenario())


def test_a_group_that_keeps_failing_is_marked_failed(fake_groups: type[FakeGroup]) -> None:
    async def scenario() -> None:
        coordinator = make_coordinator(FAST.model_copy(update={"max_restarts": 2}))
        await coordinator.start()
        await until(coordinator, lambda m: len(m.ready()) == 2)
        coordinator.serving_started()
        fake_groups.fail_starts.add("g0")
        coordinator.records["g0"].runtime.leader.dead = True
        failed = await until(coordinator, lambda m: state(m, "g0") is GroupState.FAILED)
        g0 = failed.group("g0")
        assert g0 is not None and "2 restarts" in g0.detail and "engine would not start" in g0.detail
        assert state(failed, "g1") is GroupState.READY
        assert failed.events[-1].failed
        # an operator restart gives it a fresh budget
        fake_groups.fail_starts.clear()
        await coordinator.restart("g0")
        await until(coordinator, lambda m: len(m.ready()) == 2)
        await coordinator.shutdown()

    asyncio.run(scenario())


def test_a_group_that_cannot_start_fails_serve_fast(fake_groups: type[FakeGroup]) -> None:
    async def scenario() -> None:
        fake_groups.fail_starts.add("g1")
        coordinator = make_coordinator()
        await coordinator.start()
        failed = await until(coordinator, lambda m: state(m, "g1") is GroupState.FAILED)
        assert "engine would not start" in failed.group("g1").detail
        assert fake_groups.started.count("g1") == 1  # no retries before serving began
        await coordinator.shutdown()

    asyncio.run(scenario())


def test_serving_with_some_groups_retries_the_rest_until_they_start(fake_groups: type[FakeGroup]) -> None:
    """min_ready_groups: serving begins before g1 can start; g1 is retried with backoff and joins later."""

    async def scenario() -> None:
        fake_groups.fail_starts.add("g1")
        coordinator = make_coordinator(FAST.model_copy(update={"max_restarts": 100, "window_s": 3600}))
        coordinator.serving_started()
        await coordinator.start()
        waiting = await until(
            coordinator, lambda m: state(m, "g0") is GroupState.READY and fake_groups.started.count("g1") >= 3
        )
        assert state(waiting, "g1") in (GroupState.STARTING, GroupState.RESTARTING)
        fake_groups.fail_starts.clear()  # its nodes joined
        ready = await until(coordinator, lambda m: len(m.ready()) == 2)
        assert {e.kind for e in ready.events if e.group == "g1"} == {"start_failed"}
        await coordinator.shutdown()

    asyncio.run(scenario())


def test_drain_resume_and_unknown_groups(fake_groups: type[FakeGroup]) -> None:
    async def scenario() -> None:
        coordinator = make_coordinator()
        await coordinator.start()
        await until(coordinator, lambda m: len(m.ready()) == 2)
        assert (await coordinator.drain("g0")).state is GroupState.DRAINING
        with pytest.raises(ValueError, match="only a ready group"):
            await coordinator.drain("g0")
        assert (await coordinator.resume("g0")).state is GroupState.READY
        with pytest.raises(UnknownGroup, match="g9"):
            await coordinator.restart("g9")
        await coordinator.shutdown()

    asyncio.run(scenario())


# --- an ingress directory following membership -------------------------------------------------------


@dataclass
class Info:
    block_size: int = BLOCK
    num_kv_blocks: int = 1000
    max_model_len: int = 4096
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    inbox_endpoint: str = "tcp://127.0.0.1:9"  # nobody listens: these tests route, they submit nothing


def snapshot(name: str, state: GroupState, instance: str) -> GroupSnapshot:
    ready = state in (GroupState.READY, GroupState.DRAINING)
    return GroupSnapshot(
        name, state, 1, object() if ready else None, Info() if ready else None, instance if ready else None, "", 0.0
    )


def membership(version: int, **groups: tuple[GroupState, str]) -> Membership:
    return Membership(version, 1.0, [snapshot(name, st, inst) for name, (st, inst) in groups.items()])


def test_directory_routes_exactly_the_ready_groups() -> None:
    settings = IngressSettings(
        engine=EngineSpec(model="/m", served_model_name="m", tensor_parallel_size=1, pipeline_parallel_size=1),
        max_model_len=4096,
        block_size=BLOCK,
        routing=RoutingConfig(kv_events=False),
    )
    ready = GroupState.READY
    directory = GroupDirectory(settings, None, membership(1, g=(ready, "e1"), h=(ready, "e1")), "127.0.0.1")
    decision, member = directory.route("x", PROMPT)
    directory.first_token(decision)
    directory.finished(decision, [])
    holder, other = member.name, ({"g", "h"} - {member.name}).pop()
    assert directory.route("y", PROMPT)[0].best_matched_blocks == 4

    directory.apply(membership(2, **{holder: (GroupState.RESTARTING, ""), other: (ready, "e1")}))
    assert {directory.route(str(i), PROMPT)[1].name for i in range(5)} == {other}
    with pytest.raises(NoRoutableGroup):
        directory.route("z", PROMPT, exclude=frozenset({other}))

    directory.apply(membership(3, **{holder: (ready, "e2"), other: (ready, "e1")}))
    assert directory.members[holder].instance_id == "e2"
    assert directory.index.size(holder) == 0  # the new engine caches nothing
    assert holder in directory.router.group_names

    directory.apply(membership(4, **{holder: (GroupState.DRAINING, "e2"), other: (ready, "e1")}))
    assert directory.router.group_names == [other]
    directory.apply(membership(5, **{holder: (ready, "e2"), other: (ready, "e1")}))
    assert sorted(directory.router.group_names) == ["g", "h"]


def shapeless_settings(**shape: int) -> IngressSettings:
    return IngressSettings(
        engine=EngineSpec(model="/m", served_model_name="m", tensor_parallel_size=1, pipeline_parallel_size=1),
        routing=RoutingConfig(kv_events=False),
        **shape,
    )


def test_an_ingress_without_the_engines_shape_waits_for_a_ready_group_and_takes_its_shape() -> None:
    """flotilla serve starts its ingress while the groups load: the replica follows membership until a group is
    ready, then validates and hashes by that engine's max_model_len and block size."""
    starting = membership(1, g=(GroupState.STARTING, ""), h=(GroupState.STARTING, ""))
    ready = membership(3, g=(GroupState.STARTING, ""), h=(GroupState.READY, "e1"))
    ready.groups[1] = replace(ready.groups[1], info=Info(block_size=32, max_model_len=1024))
    later = iter([membership(2, g=(GroupState.STARTING, ""), h=(GroupState.STARTING, "")), ready])
    asked: list[int] = []

    async def next_membership(known: Membership) -> Membership:
        asked.append(known.version)
        return next(later)

    settings, taken = asyncio.run(with_engine_shape(shapeless_settings(), starting, next_membership))
    assert asked == [1, 2]
    assert (settings.max_model_len, settings.block_size, taken.version) == (1024, 32, 3)
    assert GroupDirectory(settings, None, taken, "127.0.0.1").router.group_names == ["h"]

    given = shapeless_settings(max_model_len=4096, block_size=BLOCK)
    assert asyncio.run(with_engine_shape(given, starting, next_membership)) == (given, starting)  # no wait
    assert asked == [1, 2]


def test_a_group_shorter_than_the_ingress_validates_for_is_not_routed() -> None:
    both = membership(1, g=(GroupState.READY, "e1"), h=(GroupState.READY, "e1"))
    both.groups[1] = replace(both.groups[1], info=Info(max_model_len=2048))
    directory = GroupDirectory(shapeless_settings(max_model_len=4096, block_size=BLOCK), None, both, "127.0.0.1")
    assert directory.router.group_names == ["g"]


def test_an_operator_routing_choice_reaches_every_directory_through_membership(fake_groups: type[FakeGroup]) -> None:
    """PUT /admin/routing goes to the coordinator; every ingress replica (directory), and one created later,
    routes by it from the next snapshot; a replica keeps its policy when a snapshot carries none."""

    async def scenario() -> None:
        coordinator = make_coordinator()
        await coordinator.start()
        ready = await until(coordinator, lambda m: len(m.ready()) == 2)
        settings = shapeless_settings(max_model_len=64, block_size=BLOCK)  # the fake engines' shape
        replicas = [GroupDirectory(settings, coordinator, ready, "127.0.0.1") for _ in range(2)]
        assert {r.router.policy.name for r in replicas} == {"cache_aware"}

        choice = RoutingChoice("round_robin", {})
        await coordinator.set_routing(choice)
        changed = await until(coordinator, lambda m: m.routing == choice)
        for replica in replicas:
            replica.apply(changed)
        later = GroupDirectory(settings, coordinator, await coordinator.get_membership(), "127.0.0.1")
        assert {r.router.policy.name for r in [*replicas, later]} == {"round_robin"}
        assert len({later.route(str(i), PROMPT)[1].name for i in range(4)}) == 2  # it really routes round robin

        coordinator.records["g0"].runtime.leader.dead = True  # later snapshots keep the choice
        restarted = await until(coordinator, lambda m: state(m, "g0") is not GroupState.READY)
        assert restarted.routing == choice
        await coordinator.shutdown()

    asyncio.run(scenario())
