"""Round-robin: each request goes to the next group in turn. Ignores load and caches."""

from __future__ import annotations

import numpy as np

from flotilla.router.policies.base import Candidates, PolicyParams, RoutingPolicy, RoutingRequest, TieBreaker


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self._turns = TieBreaker()

    def choose(self, request: RoutingRequest, groups: Candidates) -> int:
        return self._turns.pick(np.arange(len(groups)))
