"""Cores of their own for the CPU workers of every group on a machine (``cpu.bind_cores``, on by default).

vLLM's CPU executor pins each worker's OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``, default
``auto``), but it only sees its own ranks: two engines on one machine would pin to the same cores. So
Flotilla claims distinct cores for every group's workers and hands them to vLLM as that variable.

Each group's leader claims cores before it starts its engine: one exclusive ``flock`` per core, on a lock
file every Flotilla process on the machine shares, held by the leader for its life and released by the
kernel however the leader ends (a SIGKILLed group frees its cores for its replacement). Groups on
simulated nodes of one machine therefore never share a core, and a claim needs no coordinator. Where
too few cores are free the group runs unpinned.

Pinning alone leaves the worker's core open to every other process: vLLM pins the worker, but the
leader, EngineCore, the ingress replicas, HAProxy and Ray's actors still land on its core and preempt
the decode step (measured: a pinned worker got 0.84 of a core under load, vLLM's own server's 0.98).
So once its workers run, a leader *fences* the machine (``fence_claimed_cores``): every thread of Ray's
processes here, bar the pinned workers, runs on the cores no claim holds, as vLLM's reserved CPUs are
meant to be used. Processes Ray starts later inherit the fence from their raylet. Where claims hold
every core (two groups on two cores) nothing is fenced: the rest then runs anywhere, as before.

The rank's own process needs the same: its I/O threads, started after vLLM pinned the thread that runs the
model, inherit that thread's core, and where the rank runs inside EngineCore one of them sends every step's
tokens. The leader therefore asks each rank to move its I/O threads where the fence puts everything else
(``move_io_threads``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

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

    def record_workers(self, pids: Sequence[int]) -> None:
        """Name the pinned worker processes in the claim, so that fences leave them where vLLM pinned them."""
        self._write({"leader": os.getpid(), "workers": list(pids)})

    def release(self) -> None:
        for lock in self._locks:
            lock.close()
        self._locks.clear()

    def _write(self, record: dict[str, object]) -> None:
        text = json.dumps(record)
        for lock in self._locks:
            os.ftruncate(lock.fileno(), 0)
            os.pwrite(lock.fileno(), text.encode(), 0)


def claim_cores(
    ranks: int, threads_per_rank: int, allowed: Sequence[int] | None = None, claims_dir: Path = CLAIMS_DIR
) -> CoreClaim | None:
    """``threads_per_rank`` free cores for each of ``ranks`` ranks, lowest first; None where too few are free.

    ``allowed``: the cores this process may run on (default: its affinity mask, so a container's cpuset counts).
    """
    wanted = ranks * threads_per_rank
    candidates = sorted(machine_cores() if allowed is None else allowed)
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
    claim = CoreClaim(
        [cores[rank * threads_per_rank : (rank + 1) * threads_per_rank] for rank in range(ranks)],
        [held_lock for _, held_lock in held],
    )
    claim._write({"leader": os.getpid(), "workers": []})  # starting: fences leave this leader's processes alone
    return claim


def machine_cores() -> set[int]:
    """The cores processes here may use: this thread's and init's (a fenced process's own mask is narrower,
    a container's cpuset bounds both)."""
    return os.sched_getaffinity(0) | os.sched_getaffinity(1)


def widen_to_machine() -> None:
    """Let this thread, and the processes it starts, run on every core again: a worker can pin its OpenMP
    threads only to cores its initial mask holds (libgomp refuses the rest), and a fenced leader's mask
    does not hold the cores it just claimed."""
    os.sched_setaffinity(0, machine_cores())


@dataclass(frozen=True, slots=True)
class HeldClaims:
    """Every live claim on the machine: its cores, its workers (pinned), its starting leaders (not yet pinned)."""

    cores: frozenset[int]
    workers: frozenset[int]
    starting_leaders: frozenset[int]


def held_claims(claims_dir: Path = CLAIMS_DIR, locks: Path = Path("/proc/locks")) -> HeldClaims:
    """The claims some process holds now: lock files whose ``flock`` the kernel lists (``/proc/locks``)."""
    held = set()
    for line in locks.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == "WRITE":
            major, minor, inode = fields[5].split(":")
            held.add((int(major, 16), int(minor, 16), int(inode)))
    cores, workers, starting = set(), set(), set()
    for path in claims_dir.glob("core-*.lock") if claims_dir.is_dir() else ():
        try:
            status = path.stat()
            if (os.major(status.st_dev), os.minor(status.st_dev), status.st_ino) not in held:
                continue
            record = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            continue
        cores.add(int(path.stem.removeprefix("core-")))
        workers.update(record.get("workers", []))
        if not record.get("workers") and "leader" in record:
            starting.add(record["leader"])
    return HeldClaims(frozenset(cores), frozenset(workers), frozenset(starting))


def fence_claimed_cores(claims_dir: Path = CLAIMS_DIR, roots: Sequence[int] | None = None) -> int:
    """Move every thread of Ray's processes on this machine, except pinned workers, onto the cores no claim
    holds (onto every core where claims hold them all). Returns how many threads moved.

    ``roots``: the processes whose trees are fenced; default every raylet and GCS here. A leader still starting
    keeps its processes (its workers are about to pin themselves); it fences once its workers are recorded.
    Threads that end or belong to another user meanwhile are skipped.
    """
    claims = held_claims(claims_dir)
    target = fence_cores(claims)
    moved = 0
    for process in _fenced_processes(claims, _ray_roots() if roots is None else roots):
        try:
            threads = process.threads()
        except psutil.Error:
            continue
        for thread in threads:
            try:
                if os.sched_getaffinity(thread.id) != target:
                    os.sched_setaffinity(thread.id, target)
                    moved += 1
            except OSError:
                continue
    return moved


def fence_cores(claims: HeldClaims | None = None) -> set[int]:
    """Where everything but the model's threads runs: the cores no claim holds (every core where claims hold
    them all)."""
    everywhere = machine_cores()
    return (everywhere - (held_claims() if claims is None else claims).cores) or everywhere


def move_io_threads(cores: set[int]) -> int:
    """In a pinned rank's process, called from the thread that runs the model: move the process's other
    Python threads and ZeroMQ's I/O threads onto ``cores``; returns how many moved.

    They inherit the rank's pinned core when started after the pinning, as EngineCore's are when the rank runs
    inside it: its output thread, the one that sends every step's tokens, then waits for the model's core
    between steps (measured: 46 of 2,000 inter-token gaps over 10 ms at concurrency 1, against none in vLLM's
    server, whose EngineCore threads run off its worker's core). OpenMP's threads (not Python's, not named
    ZMQbg) stay pinned; threads started later stay where they start.
    """
    import threading

    model_thread = threading.get_native_id()
    io_threads = {t.native_id for t in threading.enumerate() if t.native_id not in (None, model_thread)}
    for thread in psutil.Process().threads():
        try:
            with open(f"/proc/self/task/{thread.id}/comm") as comm:
                if comm.read().startswith("ZMQbg/"):
                    io_threads.add(thread.id)
        except OSError:
            continue
    moved = 0
    for tid in io_threads:
        try:
            os.sched_setaffinity(tid, cores)
            moved += 1
        except OSError:  # ended meanwhile
            continue
    return moved


def _ray_roots() -> list[int]:
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("raylet", "gcs_server")]


def _fenced_processes(claims: HeldClaims, roots: Sequence[int]) -> Iterator[psutil.Process]:
    """The processes of the ``roots``' trees, less pinned workers and whatever starting leaders run."""
    seen: set[int] = set()
    for pid in roots:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        skipped: set[int] = set()
        for process in tree:
            try:
                parent = process.ppid()
            except psutil.Error:
                continue
            if process.pid in claims.starting_leaders or parent in skipped:
                skipped.add(process.pid)  # children() lists parents before their children
                continue
            if process.pid in seen or process.pid in claims.workers:
                continue
            seen.add(process.pid)
            yield process
