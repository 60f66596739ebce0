"""Routing policies, one module each, registered here by name."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from flotilla.router.policies.base import Candidates, GroupView, PolicyParams, RoutingPolicy, RoutingRequest
from flotilla.router.policies.cache_aware import CacheAwarePolicy
from flotilla.router.policies.least_loaded import LeastLoadedPolicy
from flotilla.router.policies.power_of_two import PowerOfTwoPolicy
from flotilla.router.policies.prefix_only import PrefixOnlyPolicy
from flotilla.router.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy
    for policy in (CacheAwarePolicy, RoundRobinPolicy, LeastLoadedPolicy, PowerOfTwoPolicy, PrefixOnlyPolicy)
}
DEFAULT_POLICY = CacheAwarePolicy.name


def make_policy(name: str, params: dict[str, Any] | None = None) -> RoutingPolicy:
    """The policy called ``name`` with ``params``; unknown names and parameters are errors."""
    try:
        policy = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
    try:
        return policy(policy.Params.model_validate(params or {}))
    except ValidationError as err:
        raise ValueError(f"invalid parameters for routing policy {name!r}: {err}") from None


__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Candidates",
    "GroupView",
    "PolicyParams",
    "RoutingPolicy",
    "RoutingRequest",
    "make_policy",
]
