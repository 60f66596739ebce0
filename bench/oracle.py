"""An offline routing oracle for the simulated grid: every session's group decided before the first request.

Issue 15's target compares a policy's hit rate to "the best of ``prefix_only`` and an offline oracle".
The oracle here is the one of the peer study (``../shared/reference/routing_peers.md``: "oracle, group
% 2, balanced"), made general: knowing every session in advance, it labels each one by what it shares
(a multi-turn session keeps its own history; a single-turn session the leading blocks its first prompt
shares with another session's; a session that shares nothing stands alone), and places the labels on
groups greedily, largest first, on the least loaded group (tokens in and out), so that a shared prefix
lives on one group and the groups carry equal work. A label with more work than a group's fair share
(one hot prefix) is spread over as many groups as its share needs, its sessions taking turns among
them: a static oracle that sent a hot prefix to one group would win on hit rate by giving up the
throughput the issue also asks for.

It is not an upper bound: the ceiling of a cell's hit rate (``workloads.optimal_hit_rate``, every
repeat a hit) ignores that the KV cache is finite and that concurrent requests miss a prefix still
being computed; the oracle runs through the same simulator as the policies and meets both.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from flotilla.router.block_keys import block_keys
from flotilla.router.policies.base import Candidates, RoutingPolicy, RoutingRequest
from flotilla.router.sim_cluster import Session

Label = tuple[str, object]


class StaticOracle(RoutingPolicy):
    """Routes each prompt to the group index :func:`oracle_assignment` chose for it (groups in joining order)."""

    name = "oracle"

    def __init__(self, group_of_prompt: dict[tuple[int, ...], int]) -> None:
        super().__init__(None)
        self._group_of_prompt = group_of_prompt

    def choose(self, request: RoutingRequest, groups: Candidates) -> int:
        return self._group_of_prompt[tuple(request.prompt_token_ids)]


def oracle_assignment(sessions: Sequence[Session], groups: int, block_size: int) -> dict[tuple[int, ...], int]:
    """Every prompt of ``sessions`` → the index of the group the oracle sends it to."""
    first_blocks = Counter(key for s in sessions for key in set(block_keys(s.turns[0].prompt, block_size)))
    labels = [_label(index, session, first_blocks, block_size) for index, session in enumerate(sessions)]
    work: Counter[Label] = Counter()
    for label, session in zip(labels, sessions, strict=True):
        work[label] += sum(len(turn.prompt) + len(turn.output) for turn in session.turns)
    fair_share = sum(work.values()) / groups
    load = [0.0] * groups
    placed: dict[Label, list[int]] = {}
    for label, tokens in sorted(work.items(), key=lambda item: -item[1]):
        spread = min(groups, max(1, math.ceil(tokens / fair_share - 1e-9)))
        chosen = sorted(range(groups), key=lambda g: (load[g], g))[:spread]
        placed[label] = chosen
        for group in chosen:
            load[group] += tokens / spread
    turns: Counter[Label] = Counter()
    assignment = {}
    for label, session in zip(labels, sessions, strict=True):
        chosen = placed[label]
        group = chosen[turns[label] % len(chosen)]
        turns[label] += 1
        for turn in session.turns:
            assignment[tuple(turn.prompt)] = group
    return assignment


def _label(index: int, session: Session, first_blocks: Counter[int], block_size: int) -> Label:
    if len(session.turns) > 1:
        return ("session", index)
    shared = []
    for key in block_keys(session.turns[0].prompt, block_size):
        if first_blocks[key] < 2:
            break
        shared.append(key)
    return ("prefix", tuple(shared)) if shared else ("alone", index)
