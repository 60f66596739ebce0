"""Prefix-only: the group holding the longest prefix of the prompt, ignoring load.

The pure-affinity baseline (like the vLLM production-stack's ``prefixaware``): it shows what
affinity alone buys and how it hot-spots. Misses and ties take turns.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import GroupView, RoutingPolicy, RoutingRequest, TieBreaker


class PrefixOnlyPolicy(RoutingPolicy):
    name = "prefix_only"
    uses_prefix_match = True

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._ties = TieBreaker()

    def choose(self, request: RoutingRequest, groups: Sequence[GroupView]) -> GroupView:
        best = max(g.matched_blocks for g in groups)
        return self._ties.pick([g for g in groups if g.matched_blocks == best])
