"""Least-loaded: the group with the fewest outstanding requests, then the least queued prefill."""

from __future__ import annotations

import numpy as np

from flotilla.router.policies.base import Candidates, PolicyParams, RoutingPolicy, RoutingRequest, TieBreaker


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self._ties = TieBreaker()

    def choose(self, request: RoutingRequest, groups: Candidates) -> int:
        outstanding = groups.outstanding
        fewest = np.flatnonzero(outstanding == outstanding.min())
        pending = groups.pending_prefill_tokens[fewest]
        return self._ties.pick(fewest[pending == pending.min()])
