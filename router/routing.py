"""The routing decision, free of Ray and HTTP: prefix index + live load → policy → bookkeeping.

The ingress (and the simulator) call :meth:`Router.route` for each request, then
:meth:`Router.first_token` and :meth:`Router.finished` as it progresses. The router keeps each
group's :class:`GroupView` current: requests in flight and prefill still queued (from this
router's own decisions), engine-side load (from :meth:`update_engine_load`), and, per request,
the cached prefix each group holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from router.block_keys import block_keys, none_hash
from router.policies import GroupView, RoutingPolicy, RoutingRequest
from router.prefix_index import PrefixIndex


@dataclass(slots=True)
class EngineLoad:
    """A group's load as its engine last reported it."""

    running: int
    waiting: int
    kv_usage: float


@dataclass(slots=True)
class Decision:
    request: RoutingRequest
    group: GroupView
    matched_blocks: int
    """Leading blocks the chosen group held (by the index's knowledge)."""
    best_matched_blocks: int
    """The longest match any group held: the prefix reuse an oracle would get."""
    uncached_tokens: int
    decision_s: float
    first_token_seen: bool = False


class NoRoutableGroup(Exception):
    """No group can take requests now."""


class Router:
    def __init__(
        self,
        policy: RoutingPolicy,
        block_size: int,
        index: PrefixIndex | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.policy = policy
        self.block_size = block_size
        self.index = index or PrefixIndex()
        self.groups: dict[str, GroupView] = {}
        self._clock = clock
        self._root = none_hash()

    # --- membership --------------------------------------------------------------------------
    def add_group(self, name: str, capacity_blocks: int) -> None:
        self.groups.setdefault(name, GroupView(name))
        self.index.add_group(name, capacity_blocks)

    def remove_group(self, name: str) -> None:
        self.groups.pop(name, None)
        self.index.remove_group(name)

    def reset_group(self, name: str) -> None:
        """The group's engine restarted: whatever it cached is gone."""
        self.index.clear(name)

    def update_engine_load(self, name: str, load: EngineLoad) -> None:
        view = self.groups.get(name)
        if view is not None:
            view.engine_running, view.engine_waiting, view.kv_usage = load.running, load.waiting, load.kv_usage

    # --- requests ----------------------------------------------------------------------------
    def route(self, request_id: str, prompt_token_ids: list[int]) -> Decision:
        if not self.groups:
            raise NoRoutableGroup("no replica group is routable")
        started = self._clock()
        keys = block_keys(prompt_token_ids, self.block_size, self._root)
        request = RoutingRequest(request_id, prompt_token_ids, self.block_size, keys)
        matches = self.index.match(keys)
        views = list(self.groups.values())
        for view in views:
            view.matched_blocks = matches.get(view.name, 0)
        group = self.policy.choose(request, views)
        matched = group.matched_blocks
        uncached = max(0, request.prompt_tokens - matched * self.block_size)
        self.index.touch(group.name, keys[:matched])
        group.in_flight += 1
        group.pending_prefill_tokens += uncached
        self.policy.on_routed(request, group)
        best = max(matches.values(), default=0)
        return Decision(request, group, matched, best, uncached, self._clock() - started)

    def first_token(self, decision: Decision) -> None:
        """The prompt is prefilled: the group now caches its full blocks."""
        if not decision.first_token_seen:
            decision.first_token_seen = True
            decision.group.pending_prefill_tokens -= decision.uncached_tokens
            if decision.group.name in self.groups:
                self.index.record_confirmed(decision.group.name, decision.request.block_keys)

    def finished(self, decision: Decision, output_token_ids: list[int] | None = None) -> None:
        """The request ended; with its output, the blocks it filled while decoding are known too."""
        if decision.first_token_seen and output_token_ids and decision.group.name in self.groups:
            full = block_keys(decision.request.prompt_token_ids + output_token_ids, self.block_size, self._root)
            self.index.record_confirmed(decision.group.name, full[len(decision.request.block_keys) :])
        if not decision.first_token_seen:  # failed or aborted before its prefill finished
            decision.first_token_seen = True
            decision.group.pending_prefill_tokens -= decision.uncached_tokens
        decision.group.in_flight -= 1
        self.policy.on_finished(decision.request, decision.group)
