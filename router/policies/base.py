"""The routing policy contract.

A policy sees the request (with its prompt token ids) and the groups that can serve it,
and picks one. Lifecycle hooks have no-op defaults, so a policy implements only what it uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class RoutingRequest:
    request_id: str
    prompt_token_ids: list[int]


@dataclass(slots=True)
class GroupView:
    """A routable group as a policy sees it; the ingress keeps the counters current."""

    name: str
    in_flight: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class RoutingPolicy:
    """Base class: subclasses set ``name`` and implement ``choose``."""

    name: ClassVar[str]

    def choose(self, request: RoutingRequest, groups: Sequence[GroupView]) -> GroupView:
        """Pick one of ``groups`` (never empty) for ``request``."""
        raise NotImplementedError

    def on_routed(self, request: RoutingRequest, group: GroupView) -> None:
        """Called once the request was sent to ``group``."""

    def on_finished(self, request: RoutingRequest, group: GroupView) -> None:
        """Called when the request ends on ``group`` (finished, failed or aborted)."""
