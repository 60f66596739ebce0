"""An ingress replica's live view of the replica groups it routes to.

Membership comes from the coordinator: the replica follows its snapshots (``watch``) and
routes only to ready groups. A group that leaves ``ready`` leaves routing at once; one that
comes back with a new engine (a gang restart) gets a fresh channel, an empty prefix index
and a new KV-event feed. If the coordinator is down, the last snapshot stays in force.

Per group: the output channel to its leader, the engine facts (block size, KV capacity, event
endpoints), a KV-event feed into the prefix index, and the engine load, watched (the leader
answers once it changes) at most every ``load_poll_s``. A group whose events stop while prefills
are routed to it falls back to approximate matching.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import ray

from flotilla.cluster.contract import (
    COORDINATOR_NAME,
    EngineInfo,
    GroupSnapshot,
    GroupState,
    LoadReport,
    Membership,
    RoutingChoice,
)
from flotilla.router.group_channel import GroupChannel
from flotilla.router.kv_events import KvEventFeed
from flotilla.router.policies import make_policy
from flotilla.router.prefix_index import PrefixIndex
from flotilla.router.routing import Decision, EngineLoad, Router
from flotilla.router.settings import IngressSettings

logger = logging.getLogger(__name__)
COORDINATOR_RETRY_S = 0.5
LOAD_WATCH_TIMEOUT_S = 10.0
"""The longest a load watch waits on an idle group before it asks again."""


@dataclass(slots=True)
class Member:
    name: str
    leader: Any  # ActorHandle of flotilla.cluster.leader.GroupLeader
    channel: GroupChannel
    info: EngineInfo
    instance_id: str | None
    gang: str
    """The group it is restarted with: itself, or the wide-EP group whose DP rank it is."""
    routable: bool = True
    feed: KvEventFeed | None = None
    load_watch: asyncio.Task[None] | None = None
    events_due_by: float | None = None
    """Set when a prefill was routed here on precise knowledge; cleared by any event."""


class GroupDirectory:
    def __init__(self, settings: IngressSettings, coordinator: Any, membership: Membership, host: str) -> None:
        self.settings = settings
        self.routing = settings.routing
        self.coordinator = coordinator
        self.host = host
        self.index = PrefixIndex()
        assert settings.block_size is not None, "connect() takes the block size from the groups"
        self.router = Router(make_policy(self.routing.policy, self.routing.params), settings.block_size, self.index)
        self.routing_choice: RoutingChoice | None = None
        """The operator's run-time policy this replica routes by (None: the config's)."""
        self.members: dict[str, Member] = {}
        self.membership = Membership(-1, membership.coordinator_started_at, [])
        self._started = False
        self._tasks: list[asyncio.Task[None]] = []
        self.apply(membership)

    @classmethod
    async def connect(cls, settings: IngressSettings) -> GroupDirectory:
        """Find the coordinator by name and take its current membership (waiting for a ready group when the
        settings leave the engines' shape to the groups: ``with_engine_shape``)."""
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=settings.namespace)

        async def next_membership(known: Membership) -> Membership:
            return cast(Membership, await coordinator.watch.remote(known.version, known.coordinator_started_at))

        membership = cast(Membership, await coordinator.get_membership.remote())
        settings, membership = await with_engine_shape(settings, membership, next_membership)
        return cls(settings, coordinator, membership, ray.util.get_node_ip_address())

    # --- membership --------------------------------------------------------------------------------
    def apply(self, membership: Membership) -> None:
        """Route to exactly the ready groups of ``membership``, by its routing choice."""
        if membership.routing is not None and membership.routing != self.routing_choice:
            try:
                self.set_policy(membership.routing)
            except ValueError as err:  # checked by the ingress that took it; a newer Flotilla's policy?
                logger.error("cannot route by %s: %s", membership.routing, err)
        for snapshot in membership.groups:
            member = self.members.get(snapshot.name)
            if snapshot.state is GroupState.READY:
                if member is None or member.instance_id != snapshot.instance_id:
                    self._admit(snapshot, member)
                elif not member.routable:
                    self.router.add_group(member.name, member.info.num_kv_blocks)
                    member.routable = True
            elif member is not None and member.routable:
                # Out of routing now; requests in flight finish, or fail when the leader is killed.
                self.router.remove_group(member.name)
                member.routable = False
        self.membership = membership

    def _admit(self, snapshot: GroupSnapshot, previous: Member | None) -> None:
        info = snapshot.info
        assert info is not None
        if (mismatch := self._shape_mismatch(info)) is not None:
            logger.error("group %s has %s; not routing to it", snapshot.name, mismatch)
            return
        if previous is not None:
            self._retire(previous)
        member = Member(
            snapshot.name,
            snapshot.leader,
            GroupChannel(snapshot.leader, self.host, info.inbox_endpoint),
            info,
            snapshot.instance_id,
            gang=snapshot.gang or snapshot.name,
        )
        self.members[member.name] = member
        self.router.remove_group(member.name)  # a new engine caches nothing: start from an empty index
        self.router.add_group(member.name, info.num_kv_blocks)
        if self._started:
            self._follow(member)

    def _shape_mismatch(self, info: EngineInfo) -> str | None:
        """What in a group's engine shape this replica cannot route by, if anything."""
        if info.block_size != self.router.block_size:
            return f"KV block size {info.block_size}, not {self.router.block_size}"
        limit = self.settings.max_model_len
        if limit is not None and info.max_model_len < limit:
            # The ingress validates prompt lengths for every group: a shorter engine would get prompts it refuses.
            return f"max_model_len {info.max_model_len}, less than the {limit} this ingress validates by"
        return None

    def _retire(self, member: Member) -> None:
        if member.feed is not None:
            member.feed.stop()
            member.feed = None
        if member.load_watch is not None:
            member.load_watch.cancel()
            member.load_watch = None
        member.channel.close()

    def gang_of(self, member: Member) -> set[str]:
        """Every member restarted with ``member``: a DP rank that fails stalls its whole EP group."""
        return {other.name for other in self.members.values() if other.gang == member.gang} | {member.name}

    def report_failure(self, member: Member, error: str) -> None:
        """Ask the coordinator to check the group now (fire and forget)."""
        try:
            self.coordinator.report_failure.remote(member.name, member.instance_id, error)
        except Exception as err:
            logger.warning("could not report %s's failure to the coordinator: %s", member.name, err)

    # --- lifecycle -------------------------------------------------------------------------------
    def ensure_started(self) -> None:
        """Start following membership, and each member's load and events (needs the running event loop)."""
        if self._started and all(not task.done() for task in self._tasks):
            return
        for task in self._tasks:
            task.cancel()
        for member in self.members.values():
            if not self._started:
                self._follow(member)
            elif member.load_watch is None or member.load_watch.done():
                member.load_watch = asyncio.create_task(self._watch_load(member))
        self._started = True
        self._tasks = [asyncio.create_task(self._follow_membership())]

    def set_policy(self, choice: RoutingChoice) -> None:
        """Route by ``choice`` from now on; ValueError if its policy or parameters are wrong."""
        self.router.policy = make_policy(choice.policy, choice.params)
        self.routing_choice = choice

    async def reset_prefix_caches(self) -> dict[str, bool]:
        """Empty every engine's prefix cache and the index (benchmarks start each arm cold)."""
        names = [name for name, member in self.members.items() if member.routable]
        done = await asyncio.gather(*(self.members[n].leader.reset_prefix_cache.remote() for n in names))
        for name in names:
            self.index.clear(name)
        return dict(zip(names, done, strict=True))

    # --- requests ----------------------------------------------------------------------------------
    def route(
        self, request_id: str, prompt_token_ids: list[int], exclude: frozenset[str] = frozenset()
    ) -> tuple[Decision, Member]:
        decision = self.router.route(request_id, prompt_token_ids, exclude)
        return decision, self.members[decision.group]

    def first_token(self, decision: Decision) -> None:
        self.router.first_token(decision)
        member = self.members.get(decision.group)
        new_blocks = decision.uncached_tokens // self.router.block_size
        if member and member.feed and self.index.is_precise(member.name) and new_blocks and not member.events_due_by:
            member.events_due_by = time.monotonic() + self.routing.event_timeout_s

    def finished(self, decision: Decision, output_token_ids: list[int]) -> None:
        self.router.finished(decision, output_token_ids)

    # --- background ----------------------------------------------------------------------------------
    def _follow(self, member: Member) -> None:
        """Follow a new member's KV events and load (each engine generation is a new member)."""
        member.load_watch = asyncio.create_task(self._watch_load(member))
        if self.routing.kv_events and member.info.kv_events_endpoint:
            member.feed = KvEventFeed(
                member.name,
                member.info.kv_events_endpoint,
                member.info.kv_events_replay_endpoint,
                self.index,
                on_event=self._on_event,
            )
            member.feed.start()

    def _on_event(self, group: str) -> None:
        member = self.members.get(group)
        if member is None:
            return
        member.events_due_by = None
        if not self.index.is_precise(group):
            self.index.set_precise(group, True)

    async def _follow_membership(self) -> None:
        while True:
            known = self.membership
            try:
                membership = await self.coordinator.watch.remote(known.version, known.coordinator_started_at)
            except Exception as err:  # the coordinator is restarting: keep routing on the last snapshot
                logger.warning("coordinator unavailable (%s); routing on the last membership", type(err).__name__)
                await asyncio.sleep(COORDINATOR_RETRY_S)
                continue
            if (membership.version, membership.coordinator_started_at) != (
                known.version,
                known.coordinator_started_at,
            ):
                self.apply(membership)

    async def _watch_load(self, member: Member) -> None:
        """Keep the router's view of ``member``'s engine load current, at most every ``load_poll_s``.

        The leader answers a watch once the load differs from the last report (``GroupLeader.watch_load``):
        an idle group costs no calls, a busy one as many as polling did.
        """
        known: LoadReport | None = None
        while True:
            if member.routable:
                timeout_s = LOAD_WATCH_TIMEOUT_S
                if member.events_due_by is not None:
                    timeout_s = min(timeout_s, max(0.0, member.events_due_by - time.monotonic()))
                try:
                    known = await member.leader.watch_load.remote(known, timeout_s)
                except Exception as err:  # the coordinator handles dead groups; routing keeps the last load
                    logger.debug("load of %s unavailable: %s", member.name, err)
                else:
                    load = EngineLoad(known.running, known.waiting, known.kv_usage)
                    self.router.update_engine_load(member.name, load)
                if member.events_due_by is not None and time.monotonic() > member.events_due_by:
                    logger.warning("no KV events from %s; routing it on approximate knowledge", member.name)
                    self.index.set_precise(member.name, False)
                    member.events_due_by = None
            else:
                known = None  # back in routing, the router starts from no load: ask at once
            await asyncio.sleep(self.routing.load_poll_s)


async def with_engine_shape(
    settings: IngressSettings,
    membership: Membership,
    next_membership: Callable[[Membership], Awaitable[Membership]],
) -> tuple[IngressSettings, Membership]:
    """``settings`` with the max_model_len and block size they leave open taken from the first ready group,
    following membership until one is ready; and the membership it was taken from.

    ``flotilla serve`` leaves them open so that its ingress replicas load vLLM's frontend while the groups load
    their engines: the shape is the engines' (vLLM sets the block size per platform and attention backend).
    """
    while not settings.knows_engine_shape and not membership.ready():
        membership = await next_membership(membership)
    if settings.knows_engine_shape:
        return settings, membership
    info = cast(EngineInfo, membership.ready()[0].info)
    shape = {
        "max_model_len": settings.max_model_len or info.max_model_len,
        "block_size": settings.block_size or info.block_size,
    }
    return settings.model_copy(update=shape), membership
