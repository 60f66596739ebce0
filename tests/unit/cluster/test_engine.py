"""How Flotilla configures a group's vLLM engine on CPU."""

from __future__ import annotations

import pytest

from flotilla.cluster.engine import default_worker_threads


@pytest.mark.parametrize(
    ("cpus", "workers", "threads"),
    [(2, 1, 1), (2, 2, 1), (8, 1, 7), (8, 2, 3), (16, 4, 3), (1, 1, 1)],
)
def test_cpu_workers_leave_a_core_each_to_their_engine_loop(cpus: int, workers: int, threads: int) -> None:
    assert default_worker_threads(cpus, workers) == threads
