"""Cache-aware: the group where the request's first token comes soonest, cached prefix included.

Per request, in three steps:

1. **Filter saturated groups.** A group is saturated when its KV cache is nearly full
   (``kv_saturation``) or it carries more than ``balance_abs`` + ``balance_rel`` × the least
   loaded group's outstanding requests. Saturated groups get no traffic while another group is
   not saturated, so affinity never piles onto a busy group — and a hot prefix, once its
   holder is saturated, spreads to the next group, which then holds it too.
2. **Score** every remaining group by the work ahead of this request's first token, in
   prompt-token units::

       cost = pending_prefill_tokens + (prompt_tokens − matched_blocks × block_size)
              + decode_weight × outstanding
              + duplicate_weight × (best_matched_blocks − matched_blocks) × block_size

   i.e. the prefill already queued there, this request's uncached prefill, the decode steps it
   shares with the group's running requests, and — when another group already holds more of
   the prefix — the KV space a second copy would take from other prefixes. Misses therefore
   go to the least-loaded group (not to the group with the smallest cache, which piles new
   work onto busy groups).
3. **Pick** the cheapest; equal costs take turns in the order groups joined (deterministic, yet fair).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from flotilla.router.policies.base import Candidates, PolicyParams, RoutingPolicy, RoutingRequest, TieBreaker


class CacheAwareParams(PolicyParams):
    decode_weight: float = Field(
        16.0,
        ge=0,
        description=(
            "Prompt-token equivalents one outstanding request adds to a group's cost: the decode work the new "
            "request shares with it. Higher spreads load more; 0 is affinity plus queued prefill only."
        ),
    )
    duplicate_weight: float = Field(
        1.0,
        ge=0,
        description=(
            "Weight of prefix blocks that another group holds but this one would compute again: a duplicate "
            "costs its prefill now and, under KV pressure, evicts other prefixes later. 0 ignores duplication."
        ),
    )
    balance_abs: int = Field(
        8,
        ge=0,
        description=(
            "A group with more than balance_abs + balance_rel × (least outstanding) requests is saturated and "
            "gets no affinity traffic: the hot-spot guard. Sized for CPU groups of a few concurrent requests."
        ),
    )
    balance_rel: float = Field(1.5, ge=1.0, description="See balance_abs.")
    kv_saturation: float = Field(
        0.95, gt=0, le=1.0, description="KV-cache usage at which a group is saturated; 1.0 disables this check."
    )


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"
    Params = CacheAwareParams
    uses_prefix_match = True

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, CacheAwareParams)
        self.p: CacheAwareParams = self.params
        self._ties = TieBreaker()

    def choose(self, request: RoutingRequest, groups: Candidates) -> int:
        outstanding = groups.outstanding
        cost = self.costs(request, groups, outstanding)
        saturated = self.saturated(groups, outstanding)
        if saturated.any() and not saturated.all():
            cost[saturated] = np.inf
        return self._ties.pick(np.flatnonzero(cost == cost.min()))

    def saturated(self, groups: Candidates, outstanding: np.ndarray) -> np.ndarray:
        limit = self.p.balance_abs + self.p.balance_rel * outstanding.min()
        return (groups.kv_usage >= self.p.kv_saturation) | (outstanding > limit)

    def costs(self, request: RoutingRequest, groups: Candidates, outstanding: np.ndarray) -> np.ndarray:
        """Prompt-token equivalents of work ahead of the first token, per group (a fresh array)."""
        matched_tokens = groups.matched_blocks * request.block_size
        cost = groups.pending_prefill_tokens + self.p.decode_weight * outstanding
        cost += np.maximum(0, request.prompt_tokens - matched_tokens)
        if self.p.duplicate_weight:
            cost += self.p.duplicate_weight * (matched_tokens.max() - matched_tokens)
        return cost
