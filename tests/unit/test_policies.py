from __future__ import annotations

import pytest

from router.policies import POLICIES, GroupView, RoutingRequest, make_policy


def test_round_robin_cycles_through_groups_in_name_order() -> None:
    policy = make_policy("round_robin")
    groups = [GroupView("group-1"), GroupView("group-0"), GroupView("group-2")]
    picks = [policy.choose(RoutingRequest(str(i), [1, 2]), groups).name for i in range(6)]
    assert picks == ["group-0", "group-1", "group-2"] * 2


def test_unknown_policy_fails_fast_and_lists_choices() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("cache_awre")


def test_registry_names_match_policy_names() -> None:
    assert all(name == cls.name for name, cls in POLICIES.items())
