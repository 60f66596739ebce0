"""Power of two choices: sample two groups at random, take the less loaded (Ray Serve's default)."""

from __future__ import annotations

import random

from pydantic import Field

from flotilla.router.policies.base import Candidates, PolicyParams, RoutingPolicy, RoutingRequest


class PowerOfTwoParams(PolicyParams):
    seed: int = Field(0, description="Seed of the sampler, so runs are repeatable.")


class PowerOfTwoPolicy(RoutingPolicy):
    name = "power_of_two"
    Params = PowerOfTwoParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, PowerOfTwoParams)
        self._rng = random.Random(self.params.seed)

    def choose(self, request: RoutingRequest, groups: Candidates) -> int:
        if len(groups) == 1:
            return 0
        first, second = self._rng.sample(range(len(groups)), 2)
        outstanding = groups.outstanding
        return first if outstanding[first] <= outstanding[second] else second
