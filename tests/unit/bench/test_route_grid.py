"""The grid's count of issue 15's targets: cell by cell, and per workload over its seeds; closed loop and open loop
apart."""

from bench.route_grid import Cell, Outcome, targets


def cell(seed: int, request_rate: float | None = None) -> Cell:
    load = f"{request_rate:g} req/s" if request_rate else "c4"
    return Cell(f"prefix_repetition 2g × 32 blocks, {load}, s{seed}", 2, 32, 4, [], request_rate, seed)


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
    lines = targets(cells, results)
    rows = [line for line in lines if line.startswith("| cache_aware")]
    assert rows == ["| cache_aware, closed loop | 2 | 1 | 1 | 2 | 1 | 2 | 1 | 1 | 0 | 1 | 1 |"]
    assert not [line for line in lines if line.startswith(("| prefix_only", "| round_robin"))]
    # The closed-loop workload whose p50 is above prefix_only's is named, with cache_aware's throughput against it.
    assert lines[-1].endswith("prefix_repetition 2g × 32 blocks, c4 (p50 1.039×, tok/s 1.000×).")


def test_open_loop_cells_are_counted_apart_from_closed_loop_ones() -> None:
    cells = [cell(1), cell(1, request_rate=5.0)]
    same = [Outcome(0.8, 100.0, 500.0, 1.0), Outcome(0.8, 100.0, 500.0, 1.0)]
    results = {
        "round_robin": [Outcome(0.4, 400.0, 900.0, 1.0)] * 2,
        "prefix_only": same,
        "oracle": same,
        # closed loop: p50 above prefix_only's at 1.2× its throughput; open loop: every target met.
        "cache_aware": [Outcome(0.8, 110.0, 450.0, 1.2), Outcome(0.8, 90.0, 450.0, 1.0)],
    }
    lines = targets(cells, results)
    assert [line for line in lines if line.startswith("| cache_aware")] == [
        "| cache_aware, closed loop | 1 | 1 | 0 | 1 | 0 | 1 | 1 | 1 | 0 | 1 | 1 |",
        "| cache_aware, open loop | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 1 | 1 |",
    ]
    assert lines[-1].endswith("prefix_repetition 2g × 32 blocks, c4 (p50 1.100×, tok/s 1.200×).")


def test_open_loop_workloads_missing_a_target_are_named() -> None:
    cells = [cell(1, request_rate=5.0)]
    results = {
        "round_robin": [Outcome(0.4, 400.0, 900.0, 1.0)],
        "prefix_only": [Outcome(0.8, 100.0, 500.0, 1.0)],
        "oracle": [Outcome(0.8, 100.0, 500.0, 1.0)],
        "cache_aware": [Outcome(0.8, 90.0, 550.0, 1.0)],  # p99 1.1× prefix_only's
    }
    assert targets(cells, results)[-1].endswith(
        "prefix_repetition 2g × 32 blocks, 5 req/s (hit rate 1.000×, p50 0.900×, p99 1.100×)."
    )
