"""The routing policy contract.

For each request the router hands the policy a :class:`Candidates` table — one row per routable
group, as numpy columns (live load, and the request's prefix match when the policy asks for it)
— and the policy returns the row it picks. Columns keep a decision fast with a thousand groups.
Producing the columns (prefix index, load polling) and recording the decision are the router's
job; lifecycle hooks have no-op defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict


@dataclass(slots=True)
class RoutingRequest:
    request_id: str
    prompt_token_ids: list[int]
    block_size: int = 0
    block_keys: list[int] = field(default_factory=list)
    """vLLM-compatible keys of the prompt's full blocks; filled once the prompt is prefilled
    (routing hashes only as far as some group's cache matches)."""
    head: int | None = None
    """The prompt's first full block, hashed (None for a prompt shorter than a block): which shared prefix
    the request begins with, as far as a policy tracking prefixes needs to know."""
    group_id: int = -1
    """The router's id of the group the request was sent to (:attr:`Candidates.group_ids`), once routed."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_blocks(self) -> int:
        """KV blocks the prompt fills, the last one partly."""
        return -(-len(self.prompt_token_ids) // self.block_size)


@dataclass(slots=True)
class Candidates:
    """Routable groups, one row each, in the order they joined."""

    in_flight: np.ndarray
    """Requests this ingress has in flight on the group."""
    pending_prefill_tokens: np.ndarray
    """Uncached prompt tokens of this ingress's requests there that have no first token yet."""
    prefill_done_tokens: np.ndarray
    """How many of ``pending_prefill_tokens`` the group has likely computed already: the time since its prefill
    began, at the pace it prefilled before (0 until the router has timed one). A group's step runs to its end,
    so a request sent to a group midway through a long prefill waits only for the rest of it."""
    engine_running: np.ndarray
    engine_waiting: np.ndarray
    kv_usage: np.ndarray
    """From the engine's last scheduler stats (they cover every ingress's requests)."""
    matched_blocks: np.ndarray
    """Leading prompt blocks each group holds, for this request (zeros unless the policy uses prefixes)."""
    free_blocks: np.ndarray
    """KV blocks each group's cache holds nothing in, as its index knows it (capacity − cached blocks): what
    a prefix computed there fills before it evicts cached ones."""
    prefilling: np.ndarray
    """This router's requests on each group that begin with this request's first block and have no first token
    yet: that group is computing the prefix now, and its index learns of it only once the prefill is done."""
    prefilling_blocks: np.ndarray
    """The most leading blocks of this prompt that a request being prefilled on each group shares. vLLM caches a
    block as soon as it schedules its computation, so a request sent there now finds them cached (as
    ``matched_blocks``, which the index shows only once that prefill is done)."""
    capacity_blocks: np.ndarray
    """KV blocks each group's cache has."""
    group_ids: np.ndarray
    """The router's id of each group, ascending and stable while the router lives (rows move as groups leave
    or are excluded): how a policy remembers groups across requests."""

    @property
    def outstanding(self) -> np.ndarray:
        """Requests on each group: the engine's count, or this ingress's if higher (stats lag)."""
        return np.maximum(self.in_flight, self.engine_running + self.engine_waiting)

    def __len__(self) -> int:
        return len(self.in_flight)


@dataclass(slots=True)
class GroupView:
    """One group's row, as a plain object (for metrics and tests)."""

    name: str
    in_flight: int
    pending_prefill_tokens: int
    engine_running: int
    engine_waiting: int
    kv_usage: float


class PolicyParams(BaseModel):
    """Base of every policy's parameters: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RoutingPolicy:
    """Subclasses set ``name``, ``Params`` and implement ``choose``."""

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    uses_prefix_match: ClassVar[bool] = False

    def __init__(self, params: PolicyParams | None = None) -> None:
        self.params = params or self.Params()

    def choose(self, request: RoutingRequest, groups: Candidates) -> int:
        """The row of ``groups`` (never empty) to send ``request`` to."""
        raise NotImplementedError

    def on_routed(self, request: RoutingRequest, group: str) -> None:
        """Called once the request was sent to ``group``."""

    def on_finished(self, request: RoutingRequest, group: str) -> None:
        """Called when the request ends on ``group`` (finished, failed or aborted)."""


class TieBreaker:
    """Deterministic but fair: equally good rows take turns, in the order the groups joined."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, tied: np.ndarray) -> int:
        """One of the row numbers in ``tied`` (ascending, non-empty)."""
        choice = int(tied[self._turn % len(tied)])
        self._turn += 1
        return choice
