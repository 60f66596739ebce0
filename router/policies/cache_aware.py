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
3. **Pick** the cheapest; equal costs take turns in name order (deterministic, yet fair).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from router.policies.base import GroupView, PolicyParams, RoutingPolicy, RoutingRequest, TieBreaker


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

    def __init__(self, params: CacheAwareParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, CacheAwareParams)
        self.p: CacheAwareParams = self.params
        self._ties = TieBreaker()

    def choose(self, request: RoutingRequest, groups: Sequence[GroupView]) -> GroupView:
        least = min(g.outstanding for g in groups)
        usable = [g for g in groups if not self.saturated(g, least)] or list(groups)
        best_match = max(g.matched_blocks for g in groups)
        costs = {g.name: self.cost(request, g, best_match) for g in usable}
        best = min(costs.values())
        return self._ties.pick([g for g in usable if costs[g.name] == best])

    def saturated(self, group: GroupView, least_outstanding: int) -> bool:
        least = least_outstanding
        return (
            group.kv_usage >= self.p.kv_saturation
            or group.outstanding > self.p.balance_abs + self.p.balance_rel * least
        )

    def cost(self, request: RoutingRequest, group: GroupView, best_matched_blocks: int) -> float:
        uncached = max(0, request.prompt_tokens - group.matched_blocks * request.block_size)
        duplicated = (best_matched_blocks - group.matched_blocks) * request.block_size
        return (
            group.pending_prefill_tokens
            + uncached
            + self.p.decode_weight * group.outstanding
            + self.p.duplicate_weight * duplicated
        )
