"""The simulated engine's prefix cache behaves as vLLM's where routing can see it."""

from __future__ import annotations

import pytest

from flotilla.router.sim_engine import SimEngine, SimEngineConfig, SimRequest

BLOCK = 128
PREFIX = [(11 * i) % 900 + 100 for i in range(4 * BLOCK)]


def request(request_id: str, suffix: int) -> SimRequest:
    return SimRequest(request_id, PREFIX + [suffix] * 40, [1] * 4, 0.0)


@pytest.mark.parametrize("same_step", [True, False])
def test_a_prefix_is_shared_as_soon_as_its_computation_is_scheduled(same_step: bool) -> None:
    """vLLM caches a block when it schedules its computation (KVCacheManager.allocate_slots): a request scheduled
    after the one computing the prefix, in the same step or the next, finds the prefix's 4 blocks cached."""
    engine = SimEngine("e", SimEngineConfig(num_blocks=64))
    leader, follower = request("leader", 1), request("follower", 2)
    engine.add_request(leader)
    if not same_step:
        engine.step(0.0)
    engine.add_request(follower)
    engine.step(1.0)
    assert leader.cached_tokens == 0
    assert follower.cached_tokens == 4 * BLOCK
    assert engine.prefix_hits == 4 * BLOCK


def test_a_chunked_prefill_shares_the_blocks_of_its_chunks_so_far() -> None:
    """With 256 tokens a step the leader's first step covers 2 of the prefix's blocks; a request scheduled next
    finds those 2, and computes the rest itself (the leader is scheduled first, and takes the step's budget)."""
    engine = SimEngine("e", SimEngineConfig(num_blocks=64, max_batched_tokens=2 * BLOCK))
    leader, follower = request("leader", 1), request("follower", 2)
    engine.add_request(leader)
    engine.step(0.0)
    engine.add_request(follower)
    engine.step(1.0)
    assert follower.cached_tokens == 0  # not admitted: the leader's second chunk took the budget
    engine.step(2.0)
    assert follower.cached_tokens == 4 * BLOCK
