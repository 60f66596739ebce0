"""Core claims: distinct cores for every engine on the machine, freed however the holder ends."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from flotilla.cluster.cpu_binding import claim_cores

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


def test_a_killed_holder_frees_its_cores(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from flotilla.cluster.cpu_binding import claim_cores\n"
            f"claim = claim_cores(1, 2, [0, 1], Path({str(tmp_path)!r}))\n"
            "print(claim.omp_threads_bind(), flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "0,1"
        assert claim_cores(1, 1, [0, 1], tmp_path) is None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    claim = claim_cores(1, 2, [0, 1], tmp_path)
    assert claim is not None and claim.cores == [[0, 1]]
