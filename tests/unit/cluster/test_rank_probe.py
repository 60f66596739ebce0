"""A rank names itself even where setproctitle lost the process's argv (then it reports no title)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import setproctitle
from vllm.distributed import parallel_state

from flotilla.cluster.rank_probe import RankProbe


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


def test_vllms_title_wins_where_there_is_one(monkeypatch) -> None:
    monkeypatch.setattr(setproctitle, "getproctitle", lambda: "VLLM::Worker_TP1")
    assert RankProbe().flotilla_rank_process() == (os.getpid(), "VLLM::Worker_TP1")
