"""Least-loaded: the group with the fewest outstanding requests, then the least queued prefill."""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import GroupView, RoutingPolicy, RoutingRequest, TieBreaker


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._ties = TieBreaker()

    def choose(self, request: RoutingRequest, groups: Sequence[GroupView]) -> GroupView:
        def load(g: GroupView) -> tuple[int, int]:
            return (g.outstanding, g.pending_prefill_tokens)

        best = min(load(g) for g in groups)
        return self._ties.pick([g for g in groups if load(g) == best])
