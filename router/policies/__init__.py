"""Routing policies, one module each, registered here by name."""

from __future__ import annotations

from router.policies.base import GroupView, RoutingPolicy, RoutingRequest
from router.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {policy.name: policy for policy in (RoundRobinPolicy,)}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None


__all__ = ["POLICIES", "GroupView", "RoutingPolicy", "RoutingRequest", "make_policy"]
