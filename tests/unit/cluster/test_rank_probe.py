"""A rank names itself even where setproctitle lost the process's argv (then it reports no title),
reports the EPLB load vLLM recorded under its current placement only, and can leave its heap out of the
interpreter's last collection."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import setproctitle
import torch
from vllm.distributed import parallel_state

from devtools import REPO
from flotilla.cluster.rank_probe import RankProbe

# A process whose heap holds a reference cycle with a finalizer: the exit's last collection finds it.
CYCLE_AT_EXIT = """
import os, sys
from flotilla.cluster.rank_probe import RankProbe
class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        os.write(1, b"walked")
kept = Cycle()
if sys.argv[1] == "skip":
    RankProbe().flotilla_skip_collection_at_exit()
"""


def group(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(rank_in_group=rank, world_size=size)


@pytest.mark.parametrize(
    ("tp", "pp", "expected"),
    [((1, 2), (0, 1), "Worker_TP1"), ((0, 2), (1, 2), "Worker_PP1_TP0"), ((0, 1), (0, 1), "Worker")],
)
def test_without_a_title_the_rank_is_named_by_its_tp_and_pp_place(monkeypatch, tp, pp, expected) -> None:
    monkeypatch.setattr(setproctitle, "getproctitle", lambda: "")
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group(*tp))
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: group(*pp))
    assert RankProbe().flotilla_rank_process() == (os.getpid(), expected)


@pytest.mark.parametrize("process", ["EngineCore", "EngineCore_DP1"])
def test_without_a_title_a_rank_inside_engine_core_is_named_by_vllms_process_name(monkeypatch, process) -> None:
    monkeypatch.setattr(setproctitle, "getproctitle", lambda: "")
    monkeypatch.setattr(multiprocessing.current_process(), "name", process)
    assert RankProbe().flotilla_rank_process() == (os.getpid(), f"VLLM::{process}")


def test_vllms_title_wins_where_there_is_one(monkeypatch) -> None:
    monkeypatch.setattr(setproctitle, "getproctitle", lambda: "VLLM::Worker_TP1")
    assert RankProbe().flotilla_rank_process() == (os.getpid(), "VLLM::Worker_TP1")


def eplb_rank(steps_since_rebalance: int, write_position: int) -> RankProbe:
    """A rank whose vLLM EPLB window (8 steps, 1 layer, 2 slots; interval 32) holds step ``i`` as ``[i, 1]``."""
    window = torch.tensor([[[i, 1]] for i in range(8)], dtype=torch.int32)
    model = SimpleNamespace(
        expert_weights=[], num_local_physical_experts=1, num_physical_experts=2, num_logical_experts=2
    )
    model_state = SimpleNamespace(
        model=model, expert_load_window=window, physical_to_logical_map=torch.tensor([[0, 1]])
    )
    state = SimpleNamespace(
        model_states={"model": model_state},
        expert_rearrangement_step=steps_since_rebalance,
        expert_rearrangement_step_interval=32,
        expert_load_window_step=write_position,
    )
    probe = RankProbe()
    probe.model_runner = SimpleNamespace(eplb_state=state)  # type: ignore[attr-defined]
    return probe


def test_the_eplb_load_covers_the_newest_window_entries_recorded_since_the_last_rearrangement() -> None:
    # 27 steps into a 32-step interval with an 8-step window: steps 24, 25, 26 were recorded, at ring
    # positions 6, 7, 0 (the next write goes to 1); the other 5 entries are the previous placement's
    snapshot = eplb_rank(steps_since_rebalance=27, write_position=1).flotilla_eplb_snapshot()
    assert snapshot is not None
    assert snapshot["window_steps"] == 3 and snapshot["load"] == [[6 + 7 + 0, 3]]
    just_rebalanced = eplb_rank(steps_since_rebalance=5, write_position=1).flotilla_eplb_snapshot()
    assert just_rebalanced is not None
    assert just_rebalanced["window_steps"] == 0 and just_rebalanced["load"] == [[0, 0]]


@pytest.mark.parametrize(("mode", "expected"), [("keep", "walked"), ("skip", "")])
def test_a_rank_can_leave_its_heap_out_of_the_collection_at_exit(mode, expected) -> None:
    child = subprocess.run(
        [sys.executable, "-c", CYCLE_AT_EXIT, mode], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (child.returncode, child.stdout) == (0, expected), child.stderr
