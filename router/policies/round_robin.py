"""Round-robin: each request goes to the next group in name order."""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import GroupView, RoutingPolicy, RoutingRequest


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RoutingRequest, groups: Sequence[GroupView]) -> GroupView:
        ordered = sorted(groups, key=lambda g: g.name)
        group = ordered[self._next % len(ordered)]
        self._next += 1
        return group
