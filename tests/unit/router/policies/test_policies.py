from __future__ import annotations

import pytest

from flotilla.router.policies import POLICIES, make_policy
from flotilla.router.routing import Router


def test_round_robin_cycles_through_groups_in_the_order_they_joined() -> None:
    router = Router(make_policy("round_robin"), block_size=16)
    for name in ("group-0", "group-1", "group-2"):
        router.add_group(name, 100)
    picks = [router.route(str(i), [1, 2]).group for i in range(6)]
    assert picks == ["group-0", "group-1", "group-2"] * 2


def test_unknown_policy_fails_fast_and_lists_choices() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("cache_awre")


def test_registry_names_match_policy_names() -> None:
    assert set(POLICIES) == {"round_robin", "least_loaded", "power_of_two", "prefix_only", "cache_aware"}
    assert all(name == cls.name for name, cls in POLICIES.items())
