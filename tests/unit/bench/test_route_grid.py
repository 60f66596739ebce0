"""The grid's count of issue 15's targets: cell by cell, and per workload over its seeds."""

from bench.route_grid import Cell, Outcome, targets


def cell(seed: int) -> Cell:
    return Cell(f"prefix_repetition 2g × 32 blocks, c4, s{seed}", 2, 32, 4, [], seed=seed)


def test_targets_are_counted_per_cell_and_per_workload_over_its_seeds() -> None:
    cells = [cell(1), cell(2)]
    results = {
        "round_robin": [Outcome(0.4, 400.0, 900.0, 1.0), Outcome(0.4, 400.0, 900.0, 1.0)],
        "prefix_only": [Outcome(0.8, 100.0, 500.0, 1.0), Outcome(0.8, 100.0, 500.0, 1.0)],
        "oracle": [Outcome(0.9, 100.0, 500.0, 1.0), Outcome(0.8, 100.0, 500.0, 1.0)],
        # seed 1: hit rate 0.85 of the oracle's 0.9 (0.944×, missed); p50 above prefix_only's; p99 below.
        # seed 2: every target met. Over both seeds: hit rate 0.972×, p50 (1.2 × 0.9) = 1.04× (missed), p99 met.
        "cache_aware": [Outcome(0.85, 120.0, 400.0, 1.0), Outcome(0.8, 90.0, 450.0, 1.0)],
    }
    rows = [line for line in targets(cells, results) if line.startswith("| cache_aware")]
    assert rows == ["| cache_aware | 1 | 1 | 2 | 1 | 2 | 1 | 0 | 1 | 1 |"]
    assert not [line for line in targets(cells, results) if line.startswith(("| prefix_only", "| round_robin"))]
