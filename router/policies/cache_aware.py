"""Cache-aware: the group where the request's first token comes soonest, cached prefix included,
without trading other prefixes' cache for it.

Per request, in five steps:

1. **Keep a prefix on its owners** (``keep_prefix_owners``, `router/policies/prefix_owners.py`). A
   prefix (the prompt's first block) is owned by the groups it was routed to while they hold, prefill
   or run it; its requests may go only to its owners and to groups with room for another copy beside
   the prefixes they own. Where every group's cache is short of the prefixes in flight, the costs
   below, judging one request at a time, send some requests to a group that must compute their prefix
   again and evict another there, whose requests then miss in turn; owners keep the offline oracle's
   placement instead. A hot prefix (more requests in flight than ``hot_share`` × a group's fair share
   per owner, or nearly all requests in flight while a group does not own it) is not restricted and
   spreads; one carrying all requests in flight while a group is idle spreads among its owners and the
   groups with room (``spread_when_alone``). (Measured on the simulated grid, 8 seeds, 288 cells:
   265 cells at ≥ 0.97× the best of ``prefix_only`` and the oracle against 135 without, TTFT p50
   0.674× ``prefix_only``'s against 0.794×, p99 0.776× against 0.831×.)
2. **Filter saturated groups.** A group is saturated when it carries more than ``balance_abs`` +
   ``balance_rel`` × the least loaded group's outstanding requests (or, if enabled, its KV cache
   is nearly full: ``kv_saturation``). Saturated groups get no traffic while another allowed group is
   not saturated, so affinity never piles onto a busy group — and a hot prefix, once its holder is
   saturated, spreads to the next group, which then holds it too. (An owner that is saturated keeps
   its prefix when no other group has room for it: a short wait beats evicting another prefix.)
   A request kept on its prefix's owners is guarded at ``balance_abs_owned`` instead: sending it
   elsewhere computes its prefix again and copies it, and the requests queued behind that prefill
   wait for it. At ``balance_abs`` the guard fired on the grid's concurrency-16 cells whenever one
   group carried 9 of 16 requests of popular prefixes (3 groups × 48 blocks, seed 3: TTFT p50 549 ms
   against `prefix_only`'s 155). At 16, on 8 seeds: 265 of 288 cells at ≥ 0.97× the best hit rate
   against 239, TTFT p50 0.674× ``prefix_only``'s against 0.696×, worst cell's p50 1.96× against
   3.55×. (16 for every request too gave 267, but a hot prefix with 16 requests in flight then stayed
   on the one group holding it: ``test_a_hot_prefix_spreads_beyond_its_first_holder``.)
3. **Score** every remaining group by the work ahead of this request's first token, and the cache
   it would cost, in prompt-token units::

       cost = pending_prefill_tokens − prefill_done_tokens + (prompt_tokens − held_blocks × block_size)
              + decode_weight × outstanding
              + duplicate_weight × (most_held_blocks − held_blocks) × block_size
              + eviction_weight × max(0, prompt_blocks − held_blocks − room_blocks) × block_size
              + new_prefix_weight × reused_owned_blocks × block_size      (a prefix no group owns)

   i.e. the prefill already queued there, less what the group has likely done of it (``prefill_progress``:
   the time since it began, at the pace the router timed that group's prefills, or all groups' until it
   timed one there), this request's uncached prefill, the decode steps it
   shares with the group's running requests, the prefix a second copy would compute again when
   another group already holds it, and the cached blocks computing it there would evict: under KV
   pressure each of those is another prefix some later request misses. Misses therefore go to the
   least-loaded group (not to the group with the smallest cache, which piles new work onto busy
   groups), preferring one with room for them. ``room_blocks`` is what the group's index shows free
   plus, with ``keep_prefix_owners``, the blocks of the prompts this router sent there that no
   second request has wanted (step 1 tracks them): evicting those costs no later hit that the router
   knows of, while blocks it did not route (another ingress replica's) count as worth keeping.
   Counting every cached block as worth keeping sent unique prompts to the groups with the fewest
   such blocks, where they evicted prefixes in use (measured on the grid, 8 seeds: 270 of 288 cells
   at ≥ 0.97× the best hit rate against 265, the worst cell 0.905× against 0.845×; the ``mixed``
   cells of shared prefixes among unique prompts missed the target on 7 against 12).
   ``duplicate_weight`` is 2: the copy's own prefill, and as much again for the prefix its blocks
   evict later, which the eviction term does not see when the group has room at the time (traced on
   the grid's 2,048-token cells: copies made to skip a holder's two queued prefills left a group with
   three prefixes, which then evicted one another). At 1, on 8 seeds: 270 cells at ≥ 0.97× the best
   hit rate against 279, and on 8 other seeds (9–16) 271 against 279; TTFT p50 0.677× and 0.671×
   ``prefix_only``'s against 0.679× and 0.682×
   (``test_a_prefix_is_copied_only_when_the_holders_queue_outweighs_twice_its_prefill``).
   ``prefill_progress``: an engine's step runs to its end, so a request sent to a group midway through a
   long prefill waits for the rest of it, one sent to a group that just began waits for all of it. Counted
   in full, equal queues tied wherever every group was prefilling one prompt, and ties went by turns, often
   to the group that began last (open loop, unrelated prompts: TTFT p99 1.08–1.13× ``prefix_only``'s,
   which is round robin there and sends to the group it sent to longest ago). Not where the group is
   computing this prompt's prefix: that made a group midway through a prefix's first prefill cheaper than
   an idle one, and the requests of a hot prefix queued behind it instead of spreading (``hot`` 2,048
   tokens, 25 req/s, in a prototype: TTFT p50 1.24× ``prefix_only``'s against 0.95×). Measured on 3 sets of 8 seeds
   against ``prefill_progress`` off: cells meeting all three targets open loop 79, 85 and 92 against 76, 77
   and 83; open-loop workloads at the hit-rate target 15 of 15 on each set (against 15, 14, 14) and at the
   p99 target 13 (against 12); the worst cell against the best hit rate 0.924, 0.917 and 0.898 against
   0.887, 0.880 and 0.848. Closed loop moved a few cells either way (all three targets: 155, 142, 145
   against 152, 147, 143), and one ``mixed`` workload per set on 9–16 and 17–24 fell just under the
   hit-rate target (0.9697 and 0.968 against 0.980 and 0.982; their seeds moved up to ±0.09 either way).
   ``new_prefix_weight`` (0.25, with ``keep_prefix_owners``) charges a prompt that no group owns (a new
   prefix, or a prompt never asked again) for the reused prefixes (requested twice or more; step 1 tracks
   them) each group owns. Under KV pressure its blocks evict theirs, and if it is a prefix, its later
   requests add to theirs. By the other costs alone such prompts went wherever the load was lowest at
   that moment. In the grid's ``mixed`` cells (shared prefixes among as many unique prompts) that was
   often a group holding popular prefixes, which the unique prompts then evicted.
   Measured on 3 sets of 8 seeds (1–8, 9–16, 17–24; 368 cells each, closed and open loop):
   - cells at ≥ 0.97× the best hit rate: 348, 346 and 335 → 352, 347 and 351;
   - workloads meeting the hit-rate target: 45, 45 and 43 → 46, 45 and 45 (of 46);
   - TTFT p50 and p99 moved by a few cells either way; 0.1 and 0.5 did about as well.
   The gains are in ``mixed`` cells (12 prefixes, 4 groups, 7 req/s, seed 20: hit rate 0.458 against
   0.418; the oracle's 0.451). It does not help where the first requests place the prefixes unevenly
   before any is asked twice: seed 19's 2-group cells at 10 req/s are unchanged
   (``test_a_new_prefix_goes_to_the_group_owning_fewer_reused_prefixes``).
4. **A prefix being computed counts as held.** ``held_blocks`` is the larger of what a group's index
   holds and what a request it is prefilling shares with this prompt: vLLM caches a block as soon
   as it schedules its computation (``KVCacheManager.allocate_slots``), so a request sent there now
   finds the prefix cached, while the index learns of it only once that prefill is done. Costing
   it as a miss sent every request that came during the first prefill of its prefix to another
   group, which computed the prefix again (measured on the simulated grid, 8 seeds, 288 cells,
   with the simulator caching blocks as vLLM does: 239 cells at ≥ 0.97× the best of
   ``prefix_only`` and the oracle against 116, TTFT p99 0.775× ``prefix_only``'s against 0.898×).
   Except where a prefix spreads (a hot one, step 1's ``hot_share``, or any without
   ``keep_prefix_owners``): there the duplicate term counts only what indexes hold, so a copy of a
   prefix still being prefilled costs only its own prefill and the first burst spreads over the
   groups (counting prefills there too put all 64 requests of the grid's ``hot`` cell on one group:
   TTFT p50 261 ms against 38 ms).
5. **Pick** the cheapest; equal costs take turns in the order groups joined (deterministic, yet fair).

Why the KV-usage filter is off by default (``kv_saturation`` 1.0): when requests share long
prefixes, the KV cache of a busy group is nearly full of the running requests' blocks most of the
time. That only means a new request waits for a running one to finish, which outstanding requests
already count; treating it as saturation sent affine requests to groups that had to compute and
cache their prefix again, evicting others, and the hit rate fell with every round (measured on
the simulated engine, `bench/route_grid.py`).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from flotilla.router.policies.base import Candidates, PolicyParams, RoutingPolicy, RoutingRequest, TieBreaker
from flotilla.router.policies.prefix_owners import PrefixOwners


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
        2.0,
        ge=0,
        description=(
            "Weight of prefix blocks that another group holds but this one would compute again: a duplicate "
            "costs its prefill now and, under KV pressure, as much again when the prefix it evicts later is computed "
            "again (2). 0 ignores duplication."
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
    balance_abs_owned: int = Field(
        16,
        ge=0,
        description=(
            "balance_abs for a request kept on its prefix's owners (keep_prefix_owners): sending it elsewhere "
            "computes and copies its prefix, so it takes a larger imbalance."
        ),
    )
    balance_rel: float = Field(1.5, ge=1.0, description="See balance_abs.")
    eviction_weight: float = Field(
        1.0,
        ge=0,
        description=(
            "Weight of the cached blocks this request's uncached prefill would evict on a group (the blocks it "
            "needs beyond the group's free ones): each is a prefix some later request misses. 0 ignores it."
        ),
    )
    new_prefix_weight: float = Field(
        0.25,
        ge=0,
        description=(
            "Prompt-token equivalents per token of the reused prefixes a group owns, charged when a request begins "
            "with a prefix no group owns (a new prefix or a one-off prompt): its blocks would evict theirs, and its "
            "later requests add to theirs. 0 places such prompts by the instantaneous costs alone."
        ),
    )
    prefill_progress: bool = Field(
        True,
        description=(
            "Count the prefill a group has likely done since it began (at the pace the router timed there) off its "
            "queued prefill, unless it is computing this prompt's prefix: a group midway through a long prefill is "
            "nearer its next step than one that just began. Off: queued prefill counts in full until the first token."
        ),
    )
    kv_saturation: float = Field(
        1.0,
        gt=0,
        le=1.0,
        description=(
            "KV-cache usage at which a group is saturated; 1.0 (the default) disables this check: a full cache "
            "of running requests' blocks means a short wait, which outstanding requests already count."
        ),
    )

    keep_prefix_owners: bool = Field(
        True,
        description=(
            "Keep a reused prefix on the groups that hold it while no other group has room for another copy beside "
            "the prefixes it owns (router/policies/prefix_owners.py); off: every request is judged by the costs alone."
        ),
    )
    spread_when_alone: bool = Field(
        True,
        description=(
            "With keep_prefix_owners: a prefix carrying every request in flight while a group is idle spreads among "
            "its owners and the groups with room for a copy (a copy of it still being prefilled costs only its own "
            "prefill), so its second request does not wait behind the first's whole prefill while groups idle. Off: "
            "only the hot_share clauses make a prefix spread."
        ),
    )
    private_blocks: float = Field(
        2.0,
        ge=0,
        description=(
            "Blocks each request in flight on a group takes beyond its shared prefix (its suffix and output), when "
            "judging whether that group has room for another copy of a prefix."
        ),
    )
    hot_share: float = Field(
        1.5,
        gt=0,
        description=(
            "A prefix whose requests in flight exceed hot_share × a group's fair share of all requests in flight, per "
            "group owning it, may go anywhere the costs say: a hot prefix spreads, one more group at a time (as does "
            "one with more than hot_share per owner that carries nearly all requests in flight, to reach the last "
            "groups)."
        ),
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
        self.owners = (
            PrefixOwners(self.p.private_blocks, self.p.hot_share, self.p.spread_when_alone)
            if self.p.keep_prefix_owners
            else None
        )

    def choose(self, request: RoutingRequest, groups: Candidates) -> int:
        """The cheapest allowed group; the choice is recorded as routed (the router sends every chosen request)."""
        outstanding = groups.outstanding
        allowed = self.owners.allowed(request, groups, outstanding) if self.owners else None
        spreads = allowed is None or allowed.spreads
        cost = self.costs(request, groups, outstanding, spreads=spreads)
        saturated = self.saturated(groups, outstanding, self.p.balance_abs if spreads else self.p.balance_abs_owned)
        if allowed is not None and allowed.groups is not None:  # the prefix's owners and groups with room for a copy
            cost[~allowed.groups] = np.inf
        if (np.isfinite(cost) & ~saturated).any():
            cost[saturated] = np.inf
        choice = self._ties.pick(np.flatnonzero(cost == cost.min()))
        if self.owners:
            self.owners.routed(request, groups, choice)
        return choice

    def on_finished(self, request: RoutingRequest, group: str) -> None:
        if self.owners:
            self.owners.finished(request)

    def saturated(self, groups: Candidates, outstanding: np.ndarray, balance_abs: int) -> np.ndarray:
        limit = balance_abs + self.p.balance_rel * outstanding.min()
        return (groups.kv_usage >= self.p.kv_saturation) | (outstanding > limit)

    def costs(
        self, request: RoutingRequest, groups: Candidates, outstanding: np.ndarray, spreads: bool = False
    ) -> np.ndarray:
        """Prompt-token equivalents of work ahead of the first token, per group (a fresh array). A group prefilling
        part of the prompt counts as holding it (vLLM will find it cached); where the prefix ``spreads``, a copy
        of what is still being prefilled costs only its own prefill."""
        held = np.maximum(groups.matched_blocks, groups.prefilling_blocks)
        cost = groups.pending_prefill_tokens + self.p.decode_weight * outstanding
        if self.p.prefill_progress:  # not where this prompt's prefix is being computed (see the docstring's step 3)
            cost -= np.where(groups.prefilling_blocks > 0, 0, groups.prefill_done_tokens)
        cost += np.maximum(0, request.prompt_tokens - held * request.block_size)
        if self.p.duplicate_weight:
            copied = groups.matched_blocks if spreads else held
            cost += self.p.duplicate_weight * request.block_size * (copied.max() - copied)
        if self.p.eviction_weight:
            room = groups.free_blocks
            if self.owners is not None:  # evicting blocks of prompts requested once costs no later hit
                room = np.minimum(groups.capacity_blocks, room + self.owners.once_blocks(groups))
            evicted = np.maximum(0, request.prompt_blocks - held - room)
            cost += self.p.eviction_weight * request.block_size * evicted
        if self.owners is not None and self.p.new_prefix_weight and self.owners.is_new(request.head):
            cost += self.p.new_prefix_weight * request.block_size * self.owners.reused_blocks(groups)
        return cost
