"""An ingress replica's live view of the replica groups it routes to.

Per group: the output channel to its leader, the engine facts (block size, KV capacity, event
endpoints), a KV-event feed into the prefix index, and the engine load read every
``load_poll_s``. A group whose engine instance changed (it was restarted) has its cached
blocks forgotten at once and its event feed reconnected. A group whose events stop while
prefills are routed to it falls back to approximate matching.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from cluster.group_api import leader_actor_name
from router.group_channel import GroupChannel
from router.kv_events import KvEventFeed
from router.policies import make_policy
from router.prefix_index import PrefixIndex
from router.routing import Decision, EngineLoad, Router
from router.settings import IngressSettings

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Member:
    name: str
    leader: Any  # ActorHandle of cluster.leader.GroupLeader
    channel: GroupChannel
    info: Any  # cluster.leader.EngineInfo
    instance_id: str | None
    feed: KvEventFeed | None = None
    events_due_by: float | None = None
    """Set when a prefill was routed here on precise knowledge; cleared by any event."""


class GroupDirectory:
    def __init__(
        self, settings: IngressSettings, leaders: dict[str, Any], descriptions: dict[str, Any], host: str
    ) -> None:
        self.settings = settings
        self.routing = settings.routing
        block_sizes = {d.info.block_size for d in descriptions.values()}
        if len(block_sizes) != 1:
            raise RuntimeError(f"groups disagree on the KV block size: {block_sizes}")
        self.index = PrefixIndex()
        self.router = Router(make_policy(self.routing.policy, self.routing.params), block_sizes.pop(), self.index)
        self.members: dict[str, Member] = {}
        for name, leader in leaders.items():
            description = descriptions[name]
            self.members[name] = Member(
                name, leader, GroupChannel(leader, host), description.info, description.vllm_instance_id
            )
            self.router.add_group(name, description.info.num_kv_blocks)
        self._poller: asyncio.Task[None] | None = None

    @classmethod
    def connect(cls, settings: IngressSettings) -> GroupDirectory:
        """Find every group's leader actor by name and read its engine facts."""
        leaders = {
            name: ray.get_actor(leader_actor_name(name), namespace=settings.leader_namespace)
            for name in settings.group_names
        }
        described: list[Any] = ray.get([leader.describe.remote() for leader in leaders.values()])
        return cls(settings, leaders, dict(zip(leaders, described, strict=True)), ray.util.get_node_ip_address())

    # --- lifecycle -------------------------------------------------------------------------------
    def ensure_started(self) -> None:
        """Start the load poller and event feeds (needs the replica's running event loop)."""
        if self._poller is not None and not self._poller.done():
            return
        for member in self.members.values():
            self._start_feed(member)
        self._poller = asyncio.create_task(self._poll_forever())

    def set_policy(self, name: str, params: dict[str, Any]) -> None:
        self.router.policy = make_policy(name, params)

    async def reset_prefix_caches(self) -> dict[str, bool]:
        """Empty every engine's prefix cache and the index (benchmarks start each arm cold)."""
        names = list(self.members)
        done = await asyncio.gather(*(self.members[n].leader.reset_prefix_cache.remote() for n in names))
        for name in names:
            self.index.clear(name)
        return dict(zip(names, done, strict=True))

    # --- requests ----------------------------------------------------------------------------------
    def route(self, request_id: str, prompt_token_ids: list[int]) -> tuple[Decision, Member]:
        decision = self.router.route(request_id, prompt_token_ids)
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
    def _start_feed(self, member: Member) -> None:
        if member.feed is not None:
            member.feed.stop()
            member.feed = None
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

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(member) for member in list(self.members.values())))
            await asyncio.sleep(self.routing.load_poll_s)

    async def _poll(self, member: Member) -> None:
        try:
            report = await member.leader.load.remote()
        except Exception as err:  # the coordinator handles dead groups; routing keeps the last load
            logger.debug("load of %s unavailable: %s", member.name, err)
            return
        self.router.update_engine_load(member.name, EngineLoad(report.running, report.waiting, report.kv_usage))
        if report.vllm_instance_id and report.vllm_instance_id != member.instance_id:
            await self._engine_restarted(member, report.vllm_instance_id)
        if member.events_due_by is not None and time.monotonic() > member.events_due_by:
            logger.warning("no KV events from %s; routing it on approximate knowledge", member.name)
            self.index.set_precise(member.name, False)
            member.events_due_by = None

    async def _engine_restarted(self, member: Member, instance_id: str) -> None:
        """A new engine caches nothing: forget the old one's blocks and follow the new one's events."""
        description = await member.leader.describe.remote()
        member.info, member.instance_id = description.info, instance_id
        self.router.reset_group(member.name)
        self.index.add_group(member.name, description.info.num_kv_blocks)
        self._start_feed(member)
