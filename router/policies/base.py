"""The routing policy contract.

The ingress fills one :class:`GroupView` per routable group (live load, and the prefix-cache
match for this request when the policy asks for it), then asks the policy to pick one.
Policies only read these views; producing them (the prefix index, load polling) and recording
the decision are the ingress's job. Lifecycle hooks have no-op defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel, ConfigDict


@dataclass(slots=True)
class RoutingRequest:
    request_id: str
    prompt_token_ids: list[int]
    block_size: int = 0
    block_keys: list[int] = field(default_factory=list)
    """vLLM-compatible keys of the prompt's full blocks (empty unless the policy uses prefixes)."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class GroupView:
    """A routable group as a policy sees it."""

    name: str
    in_flight: int = 0
    """Requests this ingress has in flight on the group."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens of this ingress's requests on the group that have no first token yet."""
    engine_running: int = 0
    engine_waiting: int = 0
    kv_usage: float = 0.0
    """From the engine's last scheduler stats (they cover every ingress's requests)."""
    matched_blocks: int = 0
    """Leading prompt blocks the group holds, for this request (prefix-using policies only)."""

    @property
    def outstanding(self) -> int:
        """Requests on the group: the engine's count, or this ingress's if that is higher (stats lag)."""
        return max(self.in_flight, self.engine_running + self.engine_waiting)


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

    def choose(self, request: RoutingRequest, groups: Sequence[GroupView]) -> GroupView:
        """Pick one of ``groups`` (never empty) for ``request``."""
        raise NotImplementedError

    def on_routed(self, request: RoutingRequest, group: GroupView) -> None:
        """Called once the request was sent to ``group``."""

    def on_finished(self, request: RoutingRequest, group: GroupView) -> None:
        """Called when the request ends on ``group`` (finished, failed or aborted)."""


class TieBreaker:
    """Deterministic but fair: equally good groups take turns, in name order."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, tied: Sequence[GroupView]) -> GroupView:
        ordered = sorted(tied, key=lambda g: g.name)
        choice = ordered[self._turn % len(ordered)]
        self._turn += 1
        return choice
