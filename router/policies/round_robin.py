"""Round-robin: each request goes to the next group in name order. Ignores load and caches."""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import GroupView, RoutingPolicy, RoutingRequest, TieBreaker


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._turns = TieBreaker()

    def choose(self, request: RoutingRequest, groups: Sequence[GroupView]) -> GroupView:
        return self._turns.pick(groups)
