from __future__ import annotations

from flotilla.router.prefix_index import CONFIRMED, STORED, PrefixIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def index(*groups: str, capacity: int = 100, clock: Clock | None = None) -> PrefixIndex:
    idx = PrefixIndex(confirmed_grace_s=2.0, clock=clock or Clock())
    for g in groups:
        idx.add_group(g, capacity)
    return idx


def test_match_counts_leading_blocks_per_group() -> None:
    idx = index("a", "b")
    idx.record_stored("a", [1, 2, 3])
    idx.record_stored("b", [1, 2, 9])
    assert idx.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.match([7, 1, 2]) == {}
    assert idx.match([1, 2, 3], groups=["b"]) == {"b": 2}


def test_lru_is_bounded_by_capacity_and_touch_refreshes() -> None:
    idx = index("a", capacity=3)
    idx.record_stored("a", [1, 2, 3])
    idx.touch("a", [1])
    idx.record_stored("a", [4])
    assert idx.size("a") == 3
    assert idx.match([2]) == {} and idx.match([1]) == {"a": 1}


def test_removed_and_cleared_blocks_stop_matching() -> None:
    idx = index("a")
    idx.record_stored("a", [1, 2, 3])
    idx.record_removed("a", [2])
    assert idx.match([1, 2, 3]) == {"a": 1}
    idx.clear("a", STORED)
    assert idx.match([1]) == {}


def test_precise_groups_count_their_own_confirmations_only_until_events_are_due() -> None:
    clock = Clock()
    idx = index("a", clock=clock)
    idx.set_precise("a", True)
    idx.record_confirmed("a", [1, 2])
    assert idx.match([1, 2]) == {"a": 2}
    clock.now = 5.0  # no BlockStored arrived: the confirmation alone no longer counts
    assert idx.match([1, 2]) == {}
    idx.set_precise("a", False)  # events stopped: the router's own knowledge is all there is
    assert idx.match([1, 2]) == {"a": 2}


def test_clearing_one_source_keeps_the_other() -> None:
    idx = index("a")
    idx.record_confirmed("a", [1])
    idx.record_stored("a", [1, 2])
    idx.clear("a", STORED)
    assert idx.match([1, 2]) == {"a": 1}
    idx.clear("a", CONFIRMED)
    assert idx.size("a") == 0


def test_removing_a_group_forgets_it_everywhere() -> None:
    idx = index("a", "b")
    idx.record_stored("a", [1])
    idx.record_stored("b", [1])
    idx.remove_group("a")
    assert idx.match([1]) == {"b": 1}
