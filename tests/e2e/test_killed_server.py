"""A ``flotilla serve`` killed with SIGKILL leaves nothing behind: every process it started ends
(HAProxy included, though it is only the child of a Ray actor), the cores its worker held are free,
and the next server starts on its port and pins its worker to them again."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
import pytest

from devtools import alive, wait_for
from flotilla.cluster.cpu_binding import held_claims, machine_cores
from tests.e2e.server import flotilla_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # two server starts (about 3 minutes)


def port_free(port: int) -> bool:
    """Free for a new server: no listener on it. Servers bind with SO_REUSEADDR (HAProxy, uvicorn), so
    connections of the killed one lingering in TIME_WAIT (up to 60 s) do not block them, nor this probe."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def holders(port: int) -> str:
    sockets = [c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port]
    return "the serving port is still held: " + "; ".join(f"{c.status} pid {c.pid}" for c in sockets)


def name_of(process: psutil.Process) -> str | None:
    """The process's name, or None where it ended after it was listed (Ray's short-lived helpers do)."""
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return None


def thread_cores(process: psutil.Process) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(thread.id)) for thread in process.threads()}


def thread_name(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text()


def pinned_and_fenced(server_pid: int) -> frozenset[int]:
    """The server's worker runs the model on the cores its claim holds, and nothing else of its Ray does, its
    own I/O threads included (where any core is left for the rest: cpu.bind_cores, the default). Returns the
    claimed cores."""
    claims = held_claims()
    assert claims.cores and claims.workers and not claims.starting_leaders, claims
    for pid in claims.workers:
        assert frozenset(os.sched_getaffinity(pid)) <= claims.cores, pid  # the thread that runs the model
    if machine_cores() - claims.cores:
        for pid in claims.workers:
            zmq_threads = [t.id for t in psutil.Process(pid).threads() if thread_name(pid, t.id).startswith("ZMQbg/")]
            assert zmq_threads, pid
            assert not any(os.sched_getaffinity(tid) & claims.cores for tid in zmq_threads), pid
        raylets = [
            p for p in psutil.Process(server_pid).children(recursive=True) if name_of(p) in ("raylet", "gcs_server")
        ]
        assert raylets
        for root in raylets:
            for process in [root, *root.children(recursive=True)]:
                if process.pid in claims.workers or not alive(process):
                    continue
                try:
                    overlap = [cores for cores in thread_cores(process) if cores & claims.cores]
                except psutil.NoSuchProcess:
                    continue
                assert not overlap, f"{process.pid} {' '.join(process.cmdline())[:80]} runs on {overlap}"
    return claims.cores


def test_a_killed_server_leaves_no_process_and_frees_its_port(models_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "one-group.yaml"
    config.write_text(f"model: {models_dir / 'tiny-llama'}\nserved_model_name: tiny-llama\ngroups: 1\n")
    with flotilla_serve(str(config)) as server:
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        started = psutil.Process(server.process.pid).children(recursive=True)
        assert any(name_of(p) == "haproxy" for p in started), "the default front proxy is not among its processes"
        cores = pinned_and_fenced(server.process.pid)
        port = urlparse(server.url).port
        assert port is not None
        os.kill(server.process.pid, signal.SIGKILL)
        assert wait_for(lambda: port_free(port), 60), holders(port)
        assert wait_for(lambda: not held_claims().cores, 60), held_claims()
        with flotilla_serve(str(config), port=port) as second:  # the next server on the same port starts
            assert httpx.post(f"{second.url}/v1/completions", json=body, timeout=60).status_code == 200
            assert pinned_and_fenced(second.process.pid) == cores
            # Ray's node agents notice their raylet is gone at once, then try to report it to the dead GCS
            # for Ray's reconnect timeout (60 s) before they exit: waited for while the second one serves.
            assert wait_for(lambda: not any(alive(p) for p in started), 240), [
                f"{p.pid} {name_of(p)}" for p in started if alive(p)
            ]
