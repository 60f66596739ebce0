"""Core claims: distinct cores for every engine on the machine, freed however the holder ends; the fence that
keeps everything else off them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flotilla.cluster.cpu_binding import HeldClaims, claim_cores, fence_claimed_cores, held_claims, machine_cores

CORES = [0, 1, 2, 3]


def test_claims_on_one_machine_never_share_a_core(tmp_path: Path) -> None:
    first = claim_cores(1, 2, CORES, tmp_path)
    second = claim_cores(2, 1, CORES, tmp_path)
    assert first is not None and second is not None
    assert first.cores == [[0, 1]] and second.cores == [[2], [3]]
    assert second.omp_threads_bind() == "2|3" and first.omp_threads_bind() == "0,1"
    assert claim_cores(1, 1, CORES, tmp_path) is None  # all four held: run unpinned
    first.release()
    third = claim_cores(1, 2, CORES, tmp_path)
    assert third is not None and third.cores == [[0, 1]]


def test_a_claim_that_does_not_fit_holds_nothing(tmp_path: Path) -> None:
    assert claim_cores(3, 2, CORES, tmp_path) is None
    whole = claim_cores(2, 2, CORES, tmp_path)
    assert whole is not None and whole.cores == [[0, 1], [2, 3]]


def claim_holder(tmp_path: Path, threads: int, cores: list[int], then: str) -> subprocess.Popen[str]:
    """Another process that claims ``cores`` for one rank of ``threads`` threads, runs ``then``, and holds on."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from flotilla.cluster.cpu_binding import claim_cores\n"
        f"claim = claim_cores(1, {threads}, {cores!r}, Path({str(tmp_path)!r}))\n"
        f"{then}"
        "time.sleep(600)\n"
    )
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_killed_holder_frees_its_cores(tmp_path: Path) -> None:
    holder = claim_holder(tmp_path, 2, [0, 1], "print(claim.omp_threads_bind(), flush=True)\n")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "0,1"
        assert claim_cores(1, 1, [0, 1], tmp_path) is None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    claim = claim_cores(1, 2, [0, 1], tmp_path)
    assert claim is not None and claim.cores == [[0, 1]]


# --- the fence: everything else leaves the pinned workers' cores ----------------------------------------------

needs_two_cores = pytest.mark.skipif(len(machine_cores()) < 2, reason="a fence needs a core left for the rest")

SLEEPER = "import time; time.sleep(600)"
TREE = (  # a stand-in for a raylet: it starts two children, prints the three pids, then sleeps
    "import os, subprocess, sys, time\n"
    f"kids = [subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]) for _ in range(2)]\n"
    "print(os.getpid(), *(kid.pid for kid in kids), flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def tree() -> Iterator[list[int]]:
    """[root, worker, other]: a process tree like a raylet's, killed afterwards."""
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    assert root.stdout is not None
    pids = [int(pid) for pid in root.stdout.readline().split()]
    yield pids
    for pid in pids[1:]:
        os.kill(pid, signal.SIGKILL)
    root.kill()
    root.wait(30)


def masks(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(thread.id)) for thread in psutil.Process(pid).threads()}


def test_a_held_claim_is_seen_from_any_process_and_a_dead_one_is_not(tmp_path: Path) -> None:
    holder = claim_holder(
        tmp_path,
        1,
        [0],
        "print('claimed', flush=True)\n"
        "sys.stdin.readline()\n"
        "claim.record_workers([4242])\n"
        "print('recorded', flush=True)\n",
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "claimed"
        starting = held_claims(tmp_path)
        assert starting == HeldClaims(frozenset({0}), frozenset(), frozenset({holder.pid}))
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "recorded"
        assert held_claims(tmp_path) == HeldClaims(frozenset({0}), frozenset({4242}), frozenset())
    finally:
        holder.kill()
        holder.wait(30)
    assert held_claims(tmp_path) == HeldClaims(frozenset(), frozenset(), frozenset())  # the file stays; its lock went


@needs_two_cores
def test_the_fence_moves_everything_but_the_pinned_workers_off_their_cores(tmp_path: Path, tree: list[int]) -> None:
    root, worker, other = tree
    everywhere = machine_cores()
    core = min(everywhere)
    claim = claim_cores(1, 1, [core], tmp_path)
    assert claim is not None
    claim.record_workers([worker])
    assert fence_claimed_cores(tmp_path, roots=[root]) > 0
    assert masks(root) == masks(other) == {frozenset(everywhere - {core})}
    assert masks(worker) == {frozenset(everywhere)}  # left where vLLM pinned it (here: nowhere in particular)
    assert fence_claimed_cores(tmp_path, roots=[root]) == 0  # nothing left to move

    claim.release()  # the claim gone, a fence lets everything use its core again
    assert fence_claimed_cores(tmp_path, roots=[root]) > 0
    assert masks(root) == masks(other) == masks(worker) == {frozenset(everywhere)}


@needs_two_cores
def test_where_claims_hold_every_core_the_rest_runs_anywhere(tmp_path: Path, tree: list[int]) -> None:
    root, worker, other = tree
    everywhere = machine_cores()
    os.sched_setaffinity(other, {min(everywhere)})  # fenced by an earlier, smaller set of claims
    claim = claim_cores(1, len(everywhere), sorted(everywhere), tmp_path)
    assert claim is not None
    claim.record_workers([worker])
    fence_claimed_cores(tmp_path, roots=[root])
    assert masks(root) == masks(other) == {frozenset(everywhere)}


@needs_two_cores
def test_a_starting_leader_and_its_processes_are_left_alone(tmp_path: Path, tree: list[int]) -> None:
    root, leader, other = tree
    everywhere = machine_cores()
    claim = claim_cores(1, 1, [min(everywhere)], tmp_path)
    assert claim is not None
    # ``leader`` holds the claim and has not recorded its workers yet (they may not have pinned themselves).
    claim._write({"leader": leader, "workers": []})
    fence_claimed_cores(tmp_path, roots=[root])
    assert masks(leader) == {frozenset(everywhere)}
    assert masks(other) == {frozenset(everywhere - {min(everywhere)})}


# A stand-in for a pinned rank: the model's thread pinned, then I/O threads started (they inherit its core).
RANK = """
import json, os, sys, threading, zmq
from flotilla.cluster.cpu_binding import move_io_threads

def zmq_threads():
    tasks = os.listdir("/proc/self/task")
    return [int(t) for t in tasks if open(f"/proc/self/task/{t}/comm").read().startswith("ZMQbg/")]

def cores(tid):
    return sorted(os.sched_getaffinity(tid))

model_core, rest = int(sys.argv[1]), set(map(int, sys.argv[2].split(",")))
os.sched_setaffinity(0, {model_core})
stop = threading.Event()
io = threading.Thread(target=stop.wait)
io.start()
socket = zmq.Context.instance().socket(zmq.PUSH)
socket.bind_to_random_port("tcp://127.0.0.1")  # libzmq starts its I/O threads with the first endpoint
while not zmq_threads():  # each names itself once running
    threading.Event().wait(0.01)
before = cores(io.native_id)
moved = move_io_threads(rest)
seen = {"before": before, "moved": moved, "model": cores(0), "io": cores(io.native_id)}
print(json.dumps(seen | {"zmq": [cores(t) for t in zmq_threads()]}))
stop.set()
"""


@needs_two_cores
def test_a_pinned_ranks_io_threads_leave_the_core_of_the_thread_that_runs_the_model() -> None:
    import json

    everywhere = machine_cores()
    model_core = min(everywhere)
    rest = sorted(everywhere - {model_core})
    done = subprocess.run(
        [sys.executable, "-c", RANK, str(model_core), ",".join(map(str, rest))],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    seen = json.loads(done.stdout)
    assert seen["before"] == [model_core]  # started after the pinning: on the model's core
    assert seen["model"] == [model_core]  # the model's thread stays
    assert seen["io"] == rest
    assert seen["zmq"] and all(cores == rest for cores in seen["zmq"])
    assert seen["moved"] == 1 + len(seen["zmq"])
