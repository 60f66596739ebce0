"""The coordinator: one named Ray actor that owns every replica group's lifecycle.

States: starting → ready ⇄ draining; any failure → restarting → ready (or failed when the
restart budget runs out). Health checks run per group every ``health_period_s``:

* the leader answers ``health()`` within ``health_timeout_s`` (else: leader died or hung);
* the engine is alive (vLLM marks it dead when one of its worker actors dies);
* the engine made progress in the last ``hang_timeout_s`` while it had work (a frozen rank or a
  stuck collective stalls every step without killing anything);
* under the Ray executor, every worker actor in the group's placement group is alive (read from
  Ray's state API; under mp the leader's health check reads its rank processes' states).

A failure anywhere restarts the whole group (LeaderWorkerSet's ``RecreateGroupOnPodRestart``):
it leaves routing at once, its leader is killed and its placement group removed (which kills
the workers), and it is recreated. Other groups are never touched. Every change is published
as a :class:`Membership` snapshot that ingress replicas follow (``watch``).

Groups and their placement groups are detached actors: if the coordinator dies, serving goes
on, and Ray restarts the coordinator, which re-adopts the ready groups it finds by name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from flotilla.cluster import routing_store
from flotilla.cluster.contract import (
    COORDINATOR_NAME,
    DurationHistogram,
    EnginePhase,
    EplbStatus,
    FailureKind,
    GroupEvent,
    GroupSnapshot,
    GroupState,
    Membership,
    RoutingChoice,
)
from flotilla.cluster.engine import EngineSpec
from flotilla.cluster.eplb.ep_group import EP_GROUP_NAME, EpGroup, EpGroupConfig, ep_group_actor_options
from flotilla.cluster.eplb.vllm_group import EngineEplbState, VllmEplbWatch
from flotilla.cluster.group import ReplicaGroup
from flotilla.cluster.lifecycle import RecoveryConfig, RestartBudget
from flotilla.cluster.placement import HEAD_NODE_RESOURCE

logger = logging.getLogger(__name__)
MAX_EVENTS = 100
RECENT_DETAILS = 16  # per group, in membership snapshots: enough for every start step between two progress polls
WATCH_TIMEOUT_S = 30.0
EPLB_READ_S = 2.0
"""How often the EPLB state of wide-EP groups' engines is read (each read is one RPC to every rank)."""


class UnknownGroup(KeyError):
    pass


@dataclass
class GroupRecord:
    """The coordinator's state for one group (the Ray resources live in ``runtime``)."""

    name: str
    spec: EngineSpec
    budget: RestartBudget
    runtime: ReplicaGroup
    state: GroupState = GroupState.STARTING
    generation: int = 0
    detail: str = "waiting to start"
    since: float = field(default_factory=time.time)
    last_healthy_at: float = field(default_factory=time.time)
    last_worker_check: float = 0.0
    restarts: dict[str, int] = field(default_factory=dict)
    last_failure: str | None = None
    recent_details: list[tuple[int, str]] = field(default_factory=list)
    task: asyncio.Task[Any] | None = None
    """The restart or start in progress, if any."""


@dataclass(frozen=True, slots=True)
class Failure:
    kind: FailureKind
    reason: str


class Coordinator:
    def __init__(
        self,
        groups: dict[str, EngineSpec],
        recovery: RecoveryConfig,
        startup_timeout_s: float,
        namespace: str,
        expert_parallel: EpGroupConfig | None = None,
    ) -> None:
        self.recovery = recovery
        self.expert_parallel = expert_parallel
        self.eplb: dict[str, EplbStatus] = {}
        """Every EP group's EPLB status by group name."""
        self._eplb_watches = {name: VllmEplbWatch(name) for name, spec in groups.items() if spec.eplb}
        self.routing: RoutingChoice | None = None
        self.startup_timeout_s = startup_timeout_s
        self.namespace = namespace
        self.started_at = time.time()
        self.records = {
            name: GroupRecord(name, spec, RestartBudget(recovery), ReplicaGroup(name, spec, namespace=namespace))
            for name, spec in groups.items()
        }
        self.version = 0
        self.events: list[GroupEvent] = []
        self.membership = self._snapshot()
        self._changed = asyncio.Condition()
        self._supervisor: asyncio.Task[None] | None = None
        self._eplb_driver: asyncio.Task[None] | None = None
        self._eplb_reader: asyncio.Task[None] | None = None
        self._restarted = _was_restarted()
        self._retry_on_failure = self._restarted
        """False during the first start: a group that cannot start at all fails ``flotilla serve`` fast."""

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start (or, after a coordinator restart, adopt) every group, then supervise them.

        Returns at once; ``get_membership()`` shows progress. Ray restarts a dead coordinator
        without calling this, so every entry point below calls it too.
        """
        if self._supervisor is not None:
            return
        self._supervisor = asyncio.create_task(self._supervise())
        if self.expert_parallel is not None:
            self._eplb_driver = asyncio.create_task(self._drive_eplb(self.expert_parallel))
        if self._eplb_watches:
            self._eplb_reader = asyncio.create_task(self._read_vllm_eplb())
        adopted = [False] * len(self.records)
        # An operator's routing choice outlives a coordinator restart, not a new `flotilla serve`.
        if not self._restarted:
            await routing_store.save(self.namespace, None)
        else:
            self.routing = await routing_store.load(self.namespace)
            adopted = await asyncio.gather(*(record.runtime.adopt() for record in self.records.values()))
            logger.warning("coordinator restarted: adopted %d of %d groups", sum(adopted), len(adopted))
        for record, ready in zip(self.records.values(), adopted, strict=True):
            record.generation = record.runtime.generation
            if ready:
                self._set_state(record, GroupState.READY, "adopted after a coordinator restart")
            elif self._restarted:
                # Broken while no coordinator watched (perhaps by what killed the last one): whatever is
                # left of it holds resources, so it is torn down and restarted like any failed group.
                kind = FailureKind.ENGINE_DEAD if record.generation else FailureKind.LEADER_DIED
                self._restart_now(record, Failure(kind, "not ready when a new coordinator took over"))
            else:
                record.task = asyncio.create_task(self._start_group(record))
        await self._publish()

    async def shutdown(self) -> None:
        for task in (self._supervisor, self._eplb_driver, self._eplb_reader):
            if task is not None:
                task.cancel()
        if self.expert_parallel is not None:
            await _stop_ep_group(self.namespace)
        for record in self.records.values():
            if record.task is not None:
                record.task.cancel()
        await asyncio.gather(*(record.runtime.teardown() for record in self.records.values()), return_exceptions=True)
        for record in self.records.values():
            self._set_state(record, GroupState.STOPPED, "stopped")
        await self._publish()

    def serving_started(self) -> None:
        """From now on a group that fails to start is retried with backoff instead of failing fast."""
        self._retry_on_failure = True

    # --- what ingress replicas and operators call ---------------------------------------------------
    async def get_membership(self) -> Membership:
        await self.start()
        return self.membership

    async def watch(self, known_version: int, known_started_at: float) -> Membership:
        """The next snapshot after ``known_version`` (or the current one after a while).

        A caller that knew a previous coordinator (``known_started_at`` differs) gets the current one at once.
        """
        await self.start()
        async with self._changed:
            if self.version <= known_version and known_started_at == self.started_at:
                try:
                    await asyncio.wait_for(self._changed.wait(), WATCH_TIMEOUT_S)
                except TimeoutError:
                    pass
        return self.membership

    async def report_failure(self, group: str, instance_id: str | None, error: str) -> None:
        """An ingress saw a request fail with an engine or actor error: check that group now."""
        await self.start()
        record = self._record(group)
        current = {member.instance_id for member in record.runtime.members}
        if record.state is not GroupState.READY or (instance_id and instance_id not in current):
            return  # already handled, or about an engine that is gone
        failure = await self._probe(record, time.time())
        if failure is not None:
            self._begin_restart(record, failure)
            await self._publish()

    async def drain(self, group: str) -> GroupSnapshot:
        await self.start()
        record = self._record(group)
        if record.state is not GroupState.READY:
            raise ValueError(f"group {group} is {record.state.value}; only a ready group can be drained")
        self._set_state(record, GroupState.DRAINING, "drained by an operator: no new requests")
        await self._publish()
        return self._member_snapshot(record, group)

    async def resume(self, group: str) -> GroupSnapshot:
        await self.start()
        record = self._record(group)
        if record.state is not GroupState.DRAINING:
            raise ValueError(f"group {group} is {record.state.value}; only a draining group can be resumed")
        self._set_state(record, GroupState.READY, "resumed by an operator")
        await self._publish()
        return self._member_snapshot(record, group)

    async def restart(self, group: str) -> GroupSnapshot:
        """Operator restart: out of routing now, in-flight requests finish (up to drain_timeout_s), then recreate."""
        record = self._record(group)
        await self.start()
        if record.state in (GroupState.RESTARTING, GroupState.STARTING, GroupState.STOPPED):
            raise ValueError(f"group {group} is already {record.state.value}")
        record.budget.failures.clear()  # an operator's restart also gives a failed group a fresh budget
        self._begin_restart(record, Failure(FailureKind.OPERATOR, "restarted by an operator"), drain=True)
        await self._publish()
        return self._member_snapshot(record, group)

    async def set_routing(self, choice: RoutingChoice) -> RoutingChoice:
        """Every ingress replica routes by ``choice`` from its next membership snapshot on (checked by the caller)."""
        await self.start()
        await routing_store.save(self.namespace, choice)
        self.routing = choice
        await self._publish()
        return choice

    # --- expert parallelism ----------------------------------------------------------------------------
    async def _drive_eplb(self, config: EpGroupConfig) -> None:
        """Create (or, after a coordinator restart, adopt) the EP group; tick its EPLB controller every
        ``tick_s`` and publish its status. A dead EP group is created again at the next tick."""
        import ray
        from ray.exceptions import RayActorError

        group: Any = None
        while True:
            if group is None:
                group = ray.remote(EpGroup).options(**ep_group_actor_options(self.namespace)).remote(config)
            try:
                status = await group.tick.remote()
                self.eplb[EP_GROUP_NAME] = replace(status, group=EP_GROUP_NAME)
                await self._publish()
            except RayActorError as err:
                logger.error("EP group died (%s); creating it again", _first_line(err))
                group = None
            except Exception as err:
                logger.error("EPLB tick failed: %s", _first_line(err))
            await asyncio.sleep(config.tick_s)

    async def _read_vllm_eplb(self) -> None:
        """Every ``EPLB_READ_S``, read the EPLB state of each ready wide-EP group with EPLB from all its ranks
        (the engines rebalance themselves) and publish it."""
        while True:
            for name, watch in self._eplb_watches.items():
                record = self.records[name]
                if record.state not in (GroupState.READY, GroupState.DRAINING):
                    continue
                generation = record.generation
                try:
                    per_leader = await asyncio.wait_for(
                        asyncio.gather(*(m.leader.eplb_snapshot.remote() for m in record.runtime.members)),
                        self.recovery.health_timeout_s,
                    )
                except Exception as err:  # a failing group is the supervisor's business
                    logger.debug("EPLB read of %s failed: %s", name, _first_line(err))
                    continue
                state = EngineEplbState.combine([snapshot for ranks in per_leader for snapshot in ranks])
                if state is not None and record.generation == generation:
                    self.eplb[name] = watch.update(state, generation)
            await self._publish()
            await asyncio.sleep(EPLB_READ_S)

    # --- supervision ------------------------------------------------------------------------------------
    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.recovery.health_period_s)
            await self._supervise_once()

    async def _supervise_once(self) -> None:
        now = time.time()
        checked = [r for r in self.records.values() if r.state in (GroupState.READY, GroupState.DRAINING)]
        failures = await asyncio.gather(*(self._probe(r, now) for r in checked), return_exceptions=True)
        for record, failure in zip(checked, failures, strict=True):
            if isinstance(failure, BaseException):
                logger.error("health check of %s crashed: %r", record.name, failure)
            elif failure is not None and record.state in (GroupState.READY, GroupState.DRAINING):
                self._begin_restart(record, failure)
        await self._publish()

    async def _probe(self, record: GroupRecord, now: float) -> Failure | None:
        """One group's health: every engine of it (every DP rank of a wide-EP group), then its workers."""
        members = record.runtime.members
        failures = await asyncio.gather(*(self._probe_leader(member.leader) for member in members))
        for member, failure in zip(members, failures, strict=True):
            if failure is not None:
                prefix = f"{member.name}: " if len(members) > 1 else ""
                return Failure(failure.kind, prefix + failure.reason)
        # Under mp the ranks are the leader's processes (its health check reads their state from the process
        # table) and the placement group holds only leaders, probed above: no listing of Ray's actors to ask for.
        workers_due = now - record.last_worker_check >= self.recovery.worker_check_period_s
        if record.runtime.spec.executor == "ray" and workers_due:
            dead = await asyncio.to_thread(_dead_workers, record.runtime.placement_group)
            record.last_worker_check = now
            if dead:
                return Failure(FailureKind.WORKER_DIED, f"worker actor(s) dead: {', '.join(dead)}")
        record.last_healthy_at = now
        return None

    async def _probe_leader(self, leader: Any) -> Failure | None:
        if leader is None:
            return Failure(FailureKind.LEADER_DIED, "the group has no leader")
        try:
            health = await asyncio.wait_for(leader.health.remote(), self.recovery.health_timeout_s)
        except TimeoutError:
            if await self._listed_dead_soon(leader):
                return Failure(FailureKind.LEADER_DIED, "the leader's actor is dead (Ray's actor table)")
            return Failure(
                FailureKind.HANG, f"the leader did not answer a health check within {self.recovery.health_timeout_s} s"
            )
        except Exception as err:
            return Failure(FailureKind.LEADER_DIED, f"leader unreachable: {type(err).__name__}: {_first_line(err)}")
        if not health.engine_alive:
            return Failure(FailureKind.ENGINE_DEAD, f"engine dead: {_first_line(health.error)}")
        if health.unfinished_requests and health.seconds_since_progress > self.recovery.hang_timeout_s:
            return Failure(
                FailureKind.HANG,
                f"no engine progress for {health.seconds_since_progress:.1f} s with "
                f"{health.unfinished_requests} unfinished request(s)",
            )
        return None

    async def _listed_dead_soon(self, leader: Any) -> bool:
        """Whether Ray's actor table lists a leader that missed its health check as dead within
        ``death_verdict_s``: a killed leader's pending call fails only once Ray has noticed the death, which can
        take longer than the health timeout (seen in the e2e suite); that is a death, not a hang."""
        deadline = time.monotonic() + self.recovery.death_verdict_s
        while not await asyncio.to_thread(_actor_dead, leader):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.5, self.recovery.death_verdict_s / 5))
        return True

    def _begin_restart(self, record: GroupRecord, failure: Failure, drain: bool = False) -> None:
        if record.state in (GroupState.RESTARTING, GroupState.STARTING, GroupState.STOPPED):
            return  # someone else noticed first
        self._restart_now(record, failure, drain)

    def _restart_now(self, record: GroupRecord, failure: Failure, drain: bool = False) -> None:
        detected = time.time()
        event = GroupEvent(record.name, failure.reason, failure.kind, record.last_healthy_at, detected)
        self._add_event(event)
        record.restarts[failure.kind] = record.restarts.get(failure.kind, 0) + 1
        record.last_failure = f"{failure.kind}: {failure.reason}"
        self.membership.detection.observe(max(0.0, detected - record.last_healthy_at))
        logger.warning("group %s: %s; restarting the whole group", record.name, record.last_failure)
        self._set_state(record, GroupState.RESTARTING, f"restarting: {failure.reason}")
        if record.task is not None:
            record.task.cancel()
        record.task = asyncio.create_task(self._restart(record, event, drain))

    async def _restart(self, record: GroupRecord, event: GroupEvent, drain: bool) -> None:
        await self._publish()  # out of routing before anything else happens
        if drain:
            await self._wait_idle(record)
        while True:
            await record.runtime.teardown(graceful=drain)
            drain = False
            delay = record.budget.next_delay(time.time())
            if delay is None:
                event.failed = True
                self._set_state(
                    record,
                    GroupState.FAILED,
                    f"failed: {len(record.budget.failures) - 1} restarts within {self.recovery.window_s:.0f} s; "
                    f"last: {record.last_failure}",
                )
                logger.error("group %s failed: %s", record.name, record.detail)
                await self._publish()
                return
            if delay:
                record.detail = f"restarting in {delay:.0f} s (backoff): {record.last_failure}"
                await self._publish()
                await asyncio.sleep(delay)
            if await self._start_group(record, restarting=True):
                event.back_in_routing_at = time.time()
                self.membership.recovery.observe(event.back_in_routing_at - event.detected_at)
                await self._publish()
                return
            record.last_failure = f"start_failed: {record.runtime.error}"

    async def _start_group(self, record: GroupRecord, restarting: bool = False) -> bool:
        record.generation += 1
        record.runtime = ReplicaGroup(record.name, record.spec, namespace=self.namespace, generation=record.generation)
        state = GroupState.RESTARTING if restarting else GroupState.STARTING

        def progress(group: ReplicaGroup) -> None:
            if group.phase is not EnginePhase.FAILED:
                self._set_state(record, state, group.describe_step())
                asyncio.get_running_loop().create_task(self._publish())

        try:
            await record.runtime.start(self.startup_timeout_s, progress)
        except Exception:
            if not restarting and not self._retry_on_failure:
                self._set_state(record, GroupState.FAILED, record.runtime.describe_step())
                await self._publish()
                return False
            if not restarting:  # a first start failing after serving began: restart it with backoff
                record.task = None  # this task ends here; the restart runs in its own
                self._restart_now(record, Failure(FailureKind.START_FAILED, record.runtime.describe_step()))
            return False
        record.last_healthy_at = time.time()
        self._set_state(record, GroupState.READY, record.runtime.describe_step())
        await self._publish()
        return True

    async def _wait_idle(self, record: GroupRecord) -> None:
        deadline = time.monotonic() + self.recovery.drain_timeout_s
        for member in record.runtime.members:
            while member.leader is not None and time.monotonic() < deadline:
                try:
                    unfinished = await asyncio.wait_for(
                        member.leader.num_unfinished_requests.remote(), self.recovery.health_timeout_s
                    )
                except Exception:
                    break
                if unfinished == 0:
                    break
                await asyncio.sleep(self.recovery.health_period_s)

    # --- snapshots --------------------------------------------------------------------------------------
    def _record(self, group: str) -> GroupRecord:
        """The group named ``group``, or the wide-EP group one of whose DP ranks it names."""
        record = self.records.get(group)
        if record is None:
            record = next((r for r in self.records.values() if group in {m.name for m in r.runtime.members}), None)
        if record is None:
            raise UnknownGroup(f"no group named {group!r}; groups: {sorted(self.records)}")
        return record

    def _set_state(self, record: GroupRecord, state: GroupState, detail: str) -> None:
        if state is not record.state:
            record.since = time.time()
        if detail != record.detail:
            number = record.recent_details[-1][0] + 1 if record.recent_details else 1
            record.recent_details = [*record.recent_details[-(RECENT_DETAILS - 1) :], (number, detail)]
        record.state, record.detail = state, detail

    def _add_event(self, event: GroupEvent) -> None:
        self.events.append(event)
        del self.events[:-MAX_EVENTS]

    def _group_snapshots(self, record: GroupRecord) -> list[GroupSnapshot]:
        """One snapshot per routable engine: the group, or each DP rank of a wide-EP group (all in one state)."""
        ready = record.state in (GroupState.READY, GroupState.DRAINING)
        return [
            GroupSnapshot(
                name=member.name,
                state=record.state,
                generation=record.generation,
                leader=member.leader if ready else None,
                info=member.info if ready else None,
                instance_id=member.instance_id if ready else None,
                detail=record.detail,
                since=record.since,
                restarts=dict(record.restarts),
                last_failure=record.last_failure,
                recent_details=list(record.recent_details),
                gang=record.name,
            )
            for member in record.runtime.members
        ]

    def _member_snapshot(self, record: GroupRecord, name: str) -> GroupSnapshot:
        snapshots = self._group_snapshots(record)
        return next((s for s in snapshots if s.name == name), snapshots[0])

    def _snapshot(self) -> Membership:
        previous = getattr(self, "membership", None)
        return Membership(
            version=self.version,
            coordinator_started_at=self.started_at,
            groups=[snapshot for r in self.records.values() for snapshot in self._group_snapshots(r)],
            detection=previous.detection if previous else DurationHistogram(),
            recovery=previous.recovery if previous else DurationHistogram(),
            events=list(self.events),
            eplb=list(self.eplb.values()),
            routing=self.routing,
        )

    async def _publish(self) -> None:
        snapshot = self._snapshot()
        if _same(snapshot, self.membership):
            return
        self.version += 1
        snapshot.version = self.version
        self.membership = snapshot
        async with self._changed:
            self._changed.notify_all()


def _same(a: Membership, b: Membership) -> bool:
    """Equal apart from the version (actor handles compare by identity, so compare generations)."""

    def key(m: Membership) -> Any:
        return (
            [(g.name, g.state, g.generation, g.detail, g.instance_id, g.leader is None) for g in m.groups],
            len(m.events),
            [e.back_in_routing_at for e in m.events],
            m.eplb,
            m.routing,
        )

    return key(a) == key(b)


async def _stop_ep_group(namespace: str) -> None:
    import ray

    try:
        group = ray.get_actor(EP_GROUP_NAME, namespace=namespace)
    except ValueError:
        return
    try:
        await group.shutdown.remote()  # stops its rank actors
    except Exception as err:
        logger.warning("EP group shutdown: %s", _first_line(err))
    ray.kill(group)


def _was_restarted() -> bool:
    import ray

    if not ray.is_initialized():  # not running as an actor (unit tests)
        return False
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _first_line(text: object) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def _actor_dead(handle: Any) -> bool:
    """Whether Ray's actor table says the actor behind ``handle`` is dead (False when it cannot tell)."""
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id is not None and bool(_dead_actors(("actor_id", "=", actor_id.hex())))


def _dead_workers(placement_group: Any) -> list[str]:
    """Names of actors in the group's placement group that Ray reports dead (state API; empty without it)."""
    if placement_group is None:
        return []
    return _dead_actors(("placement_group_id", "=", placement_group.id.hex()))


def _dead_actors(state_filter: tuple[str, str, str]) -> list[str]:
    """Names (or ids) of the actors matching ``state_filter`` that Ray's state API lists as dead; empty when
    it cannot answer."""
    import ray
    from ray.util.state import list_actors

    try:
        actors = list_actors(
            address=ray.get_runtime_context().gcs_address,  # "auto" is ambiguous when a machine runs two clusters
            filters=[state_filter],
            limit=1000,
            raise_on_missing_output=False,
            timeout=5,
        )
    except Exception:
        return []
    return sorted(a.name or a.actor_id for a in actors if a.state == "DEAD")


def coordinator_actor_options(namespace: str) -> dict[str, Any]:
    """Named, restarted by Ray whenever it dies (it re-adopts the groups it finds), and on the head
    node, with the control plane, not on a worker node that may be lost with the groups it watches."""
    return {
        "resources": {HEAD_NODE_RESOURCE: 0.001},
        "name": COORDINATOR_NAME,
        "namespace": namespace,
        "lifetime": "detached",
        "max_restarts": -1,
        "max_concurrency": 1000,
        "num_cpus": 0,
    }
