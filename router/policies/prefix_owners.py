"""Prefix owners: keep each shared prefix on the groups that hold it while no other group has room
for another copy of it.

Cost terms judge one request at a time, and where every group's KV cache is short of the prefixes in
flight that is not enough: a request sent to a second group because its prefix's group is busier
computes the prefix again and evicts another group's prefix there, whose next requests miss in turn.
The offline oracle (`bench/oracle.py`) avoids that by giving each prefix one group; this is its online
form (why each rule, with the measurements: docs/routing.md, section 1):

* A prefix (a prompt's first block, :attr:`RoutingRequest.head`) is **owned** by the groups it was
  routed to, for as long as each still holds it, is prefilling it or runs one of its requests there
  (checked when the prefix is next requested), and until as many new blocks have been routed to that
  group since the prefix was last used there as the group's cache holds (its LRU cache has evicted it
  by then: the bound on stale entries).
* A group's **room** is its capacity less the blocks of the prefixes it owns and ``private_blocks`` per
  request this router has in flight there, this one included (its suffix and output, which no index
  shows). A prefix counts from its first request, so the first burst of requests does not copy
  prefixes onto groups that look empty.
* A request for an owned prefix may go to its owners and to any group with room for one more copy;
  the policy's costs choose among those. A prefix whose requests in flight exceed ``hot_share`` × a
  group's fair share of all requests in flight, per owner, is unrestricted (a hot prefix spreads, and
  the group chosen becomes one more owner); so is one that carries nearly all of them while a group
  does not own it (:meth:`PrefixOwners._hot`). One that carries all of them while a group is idle may
  go to its owners and the groups with room, and there a copy of it still being prefilled costs only its own
  prefill (:meth:`PrefixOwners._alone_beside_an_idle_group`).
* A prefix also counts its requests that some group held further than the prefix (a chat's next turn), so
  the policy can tell a new chat behind it from a one-off prompt (:meth:`PrefixOwners.starts_session`).

Written here rather than taken from a library: the peers' routers (SGLang's gateway, Ray Serve LLM's
prefix-affinity router, llm-d's scorers) keep no per-prefix placement; they score each request alone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from flotilla.router.policies.base import Candidates, RoutingRequest


@dataclass(slots=True)
class _Prefix:
    blocks: int
    """Blocks it shares: its first request's prompt blocks but the last (the unique suffix's)."""
    owners: list[int] = field(default_factory=list)
    """Group ids (:attr:`Candidates.group_ids`)."""
    in_flight: dict[int, int] = field(default_factory=dict)
    """Group id → its requests in flight there."""
    requests: int = 0
    """Requests this router sent for it so far; from the second on it is reused, and evicting it costs hits."""
    continued: int = 0
    """Those of its requests of which some group held more than the prefix: a chat's next turn, whose prompt
    extends an earlier turn's prompt and answer."""


@dataclass(frozen=True, slots=True)
class Allowed:
    groups: np.ndarray | None
    """A boolean column: the prefix's owners and the groups with room for another copy; None: any group."""
    spreads: bool
    """A copy of the prefix while it is still being prefilled costs only its own prefill. With ``groups`` None it is
    hot (more requests in flight than its owners' fair share) and may go anywhere, one more group at a time;
    otherwise it carries every request in flight while a group is idle, and may go where ``groups`` allows."""


class PrefixOwners:
    def __init__(self, private_blocks: float, hot_share: float, spread_when_alone: bool = True) -> None:
        self.private_blocks = private_blocks
        self.hot_share = hot_share
        self.spread_when_alone = spread_when_alone
        self._prefixes: dict[int, _Prefix] = {}
        self._owned_blocks = np.zeros(16, dtype=np.int64)  # per group id: blocks of the prefixes it owns
        self._inflow = np.zeros(16, dtype=np.int64)  # per group id: blocks routed there to be filled, cumulative
        self._once_blocks = np.zeros(16, dtype=np.int64)  # per group id: blocks of its prefixes requested once
        self._last_use: dict[int, OrderedDict[int, int]] = {}  # group id → head → its inflow at the last use, LRU

    def allowed(self, request: RoutingRequest, groups: Candidates, outstanding: np.ndarray) -> Allowed:
        """Which candidates the request may go to, and whether its prefix spreads; ``outstanding``:
        :attr:`Candidates.outstanding`, computed once per decision."""
        head = request.head
        prefix = self._prefixes.get(head) if head is not None else None
        if head is None or prefix is None or not prefix.owners:
            return Allowed(None, spreads=False)
        live = self._live_owner_positions(head, prefix, groups)
        if not live:
            return Allowed(None, spreads=False)
        in_flight = sum(prefix.in_flight.values())
        if self._hot(in_flight, len(live), outstanding):
            return Allowed(None, spreads=True)
        ids = groups.group_ids
        self._fit(int(ids[-1]))
        used = self._owned_blocks[ids] + self.private_blocks * (groups.in_flight + 1) + prefix.blocks
        allowed = used <= groups.capacity_blocks
        allowed[live] = True
        return Allowed(allowed, spreads=self._alone_beside_an_idle_group(in_flight, outstanding))

    def _hot(self, in_flight: int, owners: int, outstanding: np.ndarray) -> bool:
        """More requests in flight than ``hot_share`` × a group's fair share per owner; or, while some group does
        not own it, more than ``hot_share`` per owner and nearly every request in flight (more than all groups but
        half of one carry at their fair share). Without the second clause a prefix that carries all the load never
        reaches the last groups: ``hot_share`` × owners × fair share exceeds all requests in flight from
        n / ``hot_share`` owners on."""
        groups = len(outstanding)
        fair_share = max(1.0, outstanding.sum() / groups)
        spread_over_owners = self.hot_share * owners
        if in_flight > fair_share * spread_over_owners:
            return True
        return owners < groups and in_flight > max(spread_over_owners, fair_share * (groups - 0.5))

    def _alone_beside_an_idle_group(self, in_flight: int, outstanding: np.ndarray) -> bool:
        """The prefix carries every request in flight while a group is idle (``spread_when_alone``): it spreads
        among the groups allowed, so a copy of it while it is still being prefilled costs only its own prefill.

        Otherwise a prefix's second request, sent while the first was the only request in flight, waited behind
        that whole first prefill while other groups idled, and the next ones queued behind both. A copy on an idle
        group with room for it beside the prefixes it owns uses compute that would otherwise wait, and no other
        prefix in flight wants that group's cache. What it gained and cost: docs/routing.md."""
        return bool(self.spread_when_alone and 0 < in_flight == outstanding.sum() and (outstanding == 0).any())

    def routed(self, request: RoutingRequest, groups: Candidates, choice: int) -> None:
        """Record that ``request`` goes to row ``choice`` of ``groups``."""
        head = request.head
        if head is None:
            return
        prompt_blocks = request.prompt_blocks
        prefix = self._prefixes.get(head)
        if prefix is None:
            prefix = self._prefixes[head] = _Prefix(blocks=max(1, prompt_blocks - 1))
        group = int(groups.group_ids[choice])
        self._fit(group)
        prefix.requests += 1
        prefix.continued += int(groups.matched_blocks.max()) > prefix.blocks
        if prefix.requests == 2:
            self._once_blocks[prefix.owners] -= prefix.blocks
        if group not in prefix.owners:
            prefix.owners.append(group)
            self._owned_blocks[group] += prefix.blocks
            if prefix.requests == 1:
                self._once_blocks[group] += prefix.blocks
        prefix.in_flight[group] = prefix.in_flight.get(group, 0) + 1
        new_blocks = prompt_blocks - int(groups.matched_blocks[choice]) + self.private_blocks
        self._inflow[group] += int(new_blocks)
        last_use = self._last_use.setdefault(group, OrderedDict())
        last_use[head] = int(self._inflow[group])
        last_use.move_to_end(head)
        self._expire(group, int(groups.capacity_blocks[choice]))

    def finished(self, request: RoutingRequest) -> None:
        head, group = request.head, request.group_id
        prefix = self._prefixes.get(head) if head is not None else None
        if head is None or prefix is None or group not in prefix.in_flight:
            return
        prefix.in_flight[group] -= 1
        if not prefix.in_flight[group]:
            del prefix.in_flight[group]
        self._forget_if_unused(head, prefix)

    def once_blocks(self, groups: Candidates) -> np.ndarray:
        """Per candidate: blocks of the prompts it owns that this router has seen requested only once; a
        prefill computed there may evict them at no cost to a later request (that it knows of)."""
        ids = groups.group_ids
        self._fit(int(ids[-1]))
        return self._once_blocks[ids]

    def reused_blocks(self, groups: Candidates) -> np.ndarray:
        """Per candidate: blocks of the prefixes it owns that were requested more than once, whose next requests
        will go there too."""
        ids = groups.group_ids
        self._fit(int(ids[-1]))
        return self._owned_blocks[ids] - self._once_blocks[ids]

    def owners(self, head: int) -> list[int]:
        prefix = self._prefixes.get(head)
        return list(prefix.owners) if prefix else []

    def starts_session(self, request: RoutingRequest, groups: Candidates) -> bool:
        """A request of a chat's prefix (at least half its requests, and two or more, were a chat's next turn) that
        no group holds beyond the prefix: a new chat, whose next turns will follow it."""
        prefix = self._prefixes.get(request.head) if request.head is not None else None
        if prefix is None or prefix.continued < 2 or 2 * prefix.continued < prefix.requests:
            return False
        return int(groups.matched_blocks.max()) <= prefix.blocks

    def is_new(self, head: int | None) -> bool:
        """A prompt with a first block that no group owns: where it goes, its prefix's later requests follow."""
        return head is not None and not self.owners(head)

    def _live_owner_positions(self, head: int, prefix: _Prefix, groups: Candidates) -> list[int]:
        """Rows of the owners that still hold, prefill or run the prefix; owners that do none of it are dropped
        (owners not among the candidates, failed or excluded, are kept but not offered)."""
        ids = groups.group_ids
        live = []
        for owner in list(prefix.owners):
            row = int(np.searchsorted(ids, owner))
            if row == len(ids) or ids[row] != owner:
                continue
            if groups.matched_blocks[row] > 0 or groups.prefilling[row] > 0 or prefix.in_flight.get(owner, 0) > 0:
                live.append(row)
            else:
                self._disown(head, prefix, owner)
        return live

    def _expire(self, group: int, capacity_blocks: int) -> None:
        """Drop the prefixes whose last use on ``group`` is a cache's worth of new blocks ago: evicted by now."""
        last_use = self._last_use[group]
        for _ in range(len(last_use)):  # bounded: an entry in use moves to the end, and a cache may hold 0 blocks
            head, at = next(iter(last_use.items()))
            if self._inflow[group] - at < capacity_blocks:
                break
            prefix = self._prefixes.get(head)
            if prefix is not None and prefix.in_flight.get(group):  # in use there: as good as used now
                last_use[head] = int(self._inflow[group])
                last_use.move_to_end(head)
                continue
            del last_use[head]
            if prefix is not None and group in prefix.owners:
                self._disown(head, prefix, group)

    def _disown(self, head: int, prefix: _Prefix, group: int) -> None:
        prefix.owners.remove(group)
        self._owned_blocks[group] -= prefix.blocks
        if prefix.requests == 1:
            self._once_blocks[group] -= prefix.blocks
        last_use = self._last_use.get(group)
        if last_use is not None:
            last_use.pop(head, None)
        self._forget_if_unused(head, prefix)

    def _forget_if_unused(self, head: int, prefix: _Prefix) -> None:
        if not prefix.owners and not prefix.in_flight:
            del self._prefixes[head]

    def _fit(self, group: int) -> None:
        if group >= len(self._owned_blocks):
            size = max(2 * len(self._owned_blocks), group + 1)
            for attr in ("_owned_blocks", "_inflow", "_once_blocks"):
                grown = np.zeros(size, dtype=np.int64)
                column = getattr(self, attr)
                grown[: len(column)] = column
                setattr(self, attr, grown)
