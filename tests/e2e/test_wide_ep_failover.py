"""Two wide-EP groups (``examples/wide-ep-cpu.yaml`` with ``groups: 2``, each DP = 2 × EP = 2 over two
simulated nodes): a rank killed under load restarts its own EP group once, as one gang, and the other
group never; no non-streaming request fails, because the other group serves the ones the dead group had
not answered (``test_wide_ep_vllm`` has the case where no other group can)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from devtools import REPO, wait_for
from tests.e2e.faults import TOKEN, group, load_through, rank_pid, wait_back_in_routing
from tests.e2e.server import Server, flotilla_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny-mixtral"
GANGS = {"group-0": ("group-0-dp0", "group-0-dp1"), "group-1": ("group-1-dp0", "group-1-dp1")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    raw = yaml.safe_load((REPO / "examples" / "wide-ep-cpu.yaml").read_text())
    raw["groups"] = 2
    raw["cluster"]["local"]["slots_per_node"] = 2  # each EP group keeps one DP rank per node
    config: Path = tmp_path_factory.mktemp("wide-ep") / "two-ep-groups.yaml"
    config.write_text(yaml.safe_dump(raw))
    with flotilla_serve(str(config), env={"FLOTILLA_ADMIN_TOKEN": TOKEN}) as running:
        yield running


def test_a_killed_rank_restarts_its_ep_group_once_and_the_other_group_serves_every_request(server: Server) -> None:
    ranks = [rank for gang in GANGS.values() for rank in gang]
    before = {rank: group(server, rank) for rank in ranks}
    assert all(g["state"] == "ready" for g in before.values()), before
    with load_through(server, victim="group-0-dp1", model=MODEL) as load:  # on exit: none failed, none left
        os.kill(rank_pid(server, "group-0-dp1", rank=0), signal.SIGKILL)
        after = {rank: wait_back_in_routing(server, rank, before[rank]["generation"]) for rank in GANGS["group-0"]}
        recovered = max(float(g["since"]) for g in after.values())
        assert wait_for(lambda: load.answered_since(recovered) >= 8, 120), "too few answers after recovery"
    for rank in GANGS["group-0"]:  # one gang restart, seen by both ranks
        now = group(server, rank)
        grown = {k: n - before[rank]["restarts"].get(k, 0) for k, n in now["restarts"].items()}
        assert sum(grown.values()) == 1 and now["generation"] == before[rank]["generation"] + 1, now
    for rank in GANGS["group-1"]:  # the other EP group was never touched
        now = group(server, rank)
        assert now["generation"] == before[rank]["generation"] and now["restarts"] == before[rank]["restarts"], now
        assert now["state"] == "ready"
