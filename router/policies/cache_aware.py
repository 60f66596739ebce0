"""Cache-aware: the group where the request's first token comes soonest, cached prefix included,
without trading other prefixes' cache for it.

Per request, in five steps (why each rule and its default, with the measurements: docs/routing.md):

1. **Keep a prefix on its owners** (``keep_prefix_owners``, `router/policies/prefix_owners.py`): a
   prefix's requests may go only to the groups that own it and to groups with room for another copy
   beside the prefixes they own. Judged one at a time, requests went where their prefix had to be
   computed again, evicting another group's prefix, whose requests then missed in turn. A hot prefix is
   not restricted and spreads; one carrying every request in flight while a group is idle spreads among
   its owners and the groups with room (``spread_when_alone``). **Keep a session on its group**
   (``keep_sessions``): where every group holds the prompt's start (a system prompt) and some hold more
   (a chat's own history), the prompt goes to those holding the most unless they are all saturated.
   Judged one at a time, a chat's next turn moved to a group with a shorter queue, computed its history
   again there and took its later turns along, and in a burst of turns the group it joined spilled in turn.
   **Start a new chat where load is light** (``balance_new_sessions``): a prompt of a prefix most of whose
   requests were a chat's next turn, that no group holds beyond the prefix, goes among the groups within
   ``new_session_slack`` outstanding requests of the least loaded, unless none of them is allowed and not
   saturated. Its later turns follow it; by the costs alone (a copy of the system prompt against a short
   queue) the chats behind each of several system prompts piled onto the groups that held it first, and
   stayed there.
2. **Filter saturated groups**: a group carrying more than ``balance_abs`` + ``balance_rel`` × the least
   loaded group's outstanding requests (``balance_abs_owned`` for a request kept on its prefix's owners or
   its session's group, whose move would compute and copy the prefix or history), or, if enabled, whose KV usage reaches
   ``kv_saturation``. Saturated groups get nothing while another allowed group is not saturated, so
   affinity never piles onto a busy group and a hot prefix spreads to the next group; an owner keeps its
   prefix when no other group has room for it.
3. **Score** every remaining group by the work ahead of this request's first token, and the cache
   it would cost, in prompt-token units::

       cost = pending_prefill_tokens − prefill_done_tokens + (prompt_tokens − held_blocks × block_size)
              + decode_weight × outstanding
              + duplicate_weight × (most_held_blocks − held_blocks) × block_size
              + eviction_weight × max(0, prompt_blocks − held_blocks − room_blocks) × block_size
              + new_prefix_weight × reused_owned_blocks × block_size      (a prefix no group owns)

   - the prefill queued there, less what the group has likely done of it (``prefill_progress``: the time
     since it began, at the pace the router timed that group's prefills, or all groups' until it timed one
     there), except where the group is computing this prompt's prefix;
   - this request's uncached prefill, and the decode steps it shares with the group's running requests;
   - a second copy of a prefix another group holds: its prefill now, and as much again for the prefix its
     blocks evict later (``duplicate_weight`` 2);
   - the cached blocks its prefill would evict: beyond ``room_blocks``, what the group's index shows free
     plus, with ``keep_prefix_owners``, the blocks of prompts this router sent there that no second request
     wanted (blocks it did not route, another ingress replica's, count as worth keeping);
   - for a prompt no group owns (a new prefix or a one-off prompt), the reused prefixes (requested twice or
     more) the group owns: its blocks would evict theirs, and its later requests add to theirs.

   Misses therefore go to the least-loaded group with room for them, not to the group with the smallest
   cache, which piles new work onto busy groups.
4. **A prefix being computed counts as held.** ``held_blocks`` is the larger of what a group's index
   holds and what a request it is prefilling shares with this prompt: vLLM caches a block as soon as it
   schedules its computation (``KVCacheManager.allocate_slots``), while the index learns of it only once
   that prefill is done. Except where the prefix spreads (step 1, or any prefix without
   ``keep_prefix_owners``): there the duplicate term counts only what indexes hold, so a copy of a prefix
   still being prefilled costs only its own prefill.
5. **Pick** the cheapest; equal costs take turns in the order groups joined (deterministic, yet fair).

``kv_saturation`` is off by default (1.0): where requests share long prefixes a busy group's KV cache is
nearly full of its running requests' blocks most of the time, which means only a short wait, and outstanding
requests already count it.
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
    keep_sessions: bool = Field(
        True,
        description=(
            "A prompt of which every group holds the start and some group more (a chat's history beyond a system "
            "prompt every group holds) goes to the groups holding the most, unless each of them is saturated at "
            "balance_abs_owned: moving it computes that history again and moves the session's later turns there for "
            "good. Off: the costs choose among all groups."
        ),
    )
    balance_new_sessions: bool = Field(
        True,
        description=(
            "With keep_prefix_owners: a new chat (a prompt of a prefix whose requests are mostly a chat's next turn, "
            "held by no group beyond that prefix) goes among the groups with at most new_session_slack more "
            "outstanding requests than the least loaded, unless none of them is allowed and unsaturated: its later "
            "turns follow it, so where it starts loads that group for the chat's life, while a copy of the prefix "
            "costs one prefill. Off: the costs choose, and a chat's first turn stays where its prefix is."
        ),
    )
    new_session_slack: int = Field(2, ge=0, description="See balance_new_sessions.")
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
        session = self.session_holders(groups)
        kept = session is not None or not spreads
        saturated = self.saturated(groups, outstanding, self.p.balance_abs_owned if kept else self.p.balance_abs)
        if allowed is not None and allowed.groups is not None:  # the prefix's owners and groups with room for a copy
            cost[~allowed.groups] = np.inf
        if session is not None and (np.isfinite(cost[session]) & ~saturated[session]).any():
            cost[~session] = np.inf
        elif self.p.balance_new_sessions and self.owners and self.owners.starts_session(request, groups):
            light = outstanding <= outstanding.min() + self.p.new_session_slack
            if (np.isfinite(cost[light]) & ~saturated[light]).any():
                cost[~light] = np.inf
        if (np.isfinite(cost) & ~saturated).any():
            cost[saturated] = np.inf
        choice = self._ties.pick(np.flatnonzero(cost == cost.min()))
        if self.owners:
            self.owners.routed(request, groups, choice)
        return choice

    def session_holders(self, groups: Candidates) -> np.ndarray | None:
        """With ``keep_sessions``, where every group holds the prompt's start and some hold more of it (a session's
        own history): those holding the most, as a boolean column; otherwise None."""
        held = groups.matched_blocks
        if not self.p.keep_sessions or held.min() == 0 or held.max() == held.min():  # one group: max == min
            return None
        return held == held.max()

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
