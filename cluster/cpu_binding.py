"""Cores of their own for the CPU workers of every group on a machine (``cpu.bind_cores``, off by default).

vLLM's CPU executor pins each worker's OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``, default
``auto``), but it only sees its own ranks: two engines on one machine would pin to the same cores. So
Flotilla runs its workers unpinned unless asked. Measured side by side on 2 cores (docs/benchmarks.md,
``serve_overhead``), pinning one group's worker made it slower at concurrency 1: the worker can no longer
move away from the front end's processes (leader, ingress, HAProxy) that land on its core. On a machine
with cores to spare for those, pinning is what vLLM recommends for CPU serving; this makes it safe there.

Each group's leader claims cores before it starts its engine: one exclusive ``flock`` per core, on a lock
file every Flotilla process on the machine shares, held by the leader for its life and released by the
kernel however the leader ends (a SIGKILLed group frees its cores for its replacement). Groups on
simulated nodes of one machine therefore never share a core, and a claim needs no coordinator. Where
too few cores are free the group runs unpinned.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

CLAIMS_DIR = Path(tempfile.gettempdir()) / "flotilla-core-claims"
UNPINNED = "nobind"  # vLLM's value for "leave the threads where the OS puts them"


@dataclass
class CoreClaim:
    """Cores held for one engine's ranks (``cores[rank]``) while this object's lock files stay open."""

    cores: list[list[int]]
    _locks: list[IO[str]] = field(default_factory=list, repr=False)

    def omp_threads_bind(self) -> str:
        """The claim as ``VLLM_CPU_OMP_THREADS_BIND`` (one list per local rank, ``|``-separated)."""
        return "|".join(",".join(str(core) for core in rank) for rank in self.cores)

    def release(self) -> None:
        for lock in self._locks:
            lock.close()
        self._locks.clear()


def claim_cores(
    ranks: int, threads_per_rank: int, allowed: Sequence[int] | None = None, claims_dir: Path = CLAIMS_DIR
) -> CoreClaim | None:
    """``threads_per_rank`` free cores for each of ``ranks`` ranks, lowest first; None where too few are free.

    ``allowed``: the cores this process may run on (default: its affinity mask, so a container's cpuset counts).
    """
    wanted = ranks * threads_per_rank
    candidates = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    claims_dir.mkdir(parents=True, exist_ok=True)
    held: list[tuple[int, IO[str]]] = []
    for core in candidates:
        if len(held) == wanted:
            break
        lock = open(claims_dir / f"core-{core}.lock", "a")  # noqa: SIM115  (held open: the claim lives as long)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another engine on this machine holds it
            lock.close()
            continue
        held.append((core, lock))
    if len(held) < wanted:
        for _, unused in held:
            unused.close()
        logger.warning("%d of the %d cores wanted for %d rank(s) are free; running unpinned", len(held), wanted, ranks)
        return None
    cores = [core for core, _ in held]
    return CoreClaim(
        [cores[rank * threads_per_rank : (rank + 1) * threads_per_rank] for rank in range(ranks)],
        [held_lock for _, held_lock in held],
    )
