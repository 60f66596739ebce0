"""Prefix-only: the group holding the longest prefix of the prompt, ignoring load.

The pure-affinity baseline (like the vLLM production-stack's ``prefixaware``): it shows what
affinity alone buys and how it hot-spots. Misses and ties take turns.
"""

from __future__ import annotations

import numpy as np

from flotilla.router.policies.base import Candidates, PolicyParams, RoutingPolicy, RoutingRequest, TieBreaker


class PrefixOnlyPolicy(RoutingPolicy):
    name = "prefix_only"
    uses_prefix_match = True

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self._ties = TieBreaker()

    def choose(self, request: RoutingRequest, groups: Candidates) -> int:
        matched = groups.matched_blocks
        return self._ties.pick(np.flatnonzero(matched == matched.max()))
