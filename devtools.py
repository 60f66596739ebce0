"""Helpers the tests and the benchmarks share (not part of the installed package).

Polling with a deadline, stopping a server the way Ctrl-C does, and a steady request load that
records every outcome (including the requests still in flight when it stops).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

REPO = Path(__file__).resolve().parent
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.2) -> T | None:
    """The predicate's first truthy value, polled every ``interval_s``; None if none came by the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval_s)
    return predicate() or None


def alive(process: psutil.Process) -> bool:
    """Still running: neither gone nor a zombie its parent has not reaped."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def answers(url: str, timeout_s: float = 2) -> bool:
    """``GET url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_serving(url: str, process: subprocess.Popen, timeout_s: float, name: str) -> None:
    """Until ``url`` answers 200; raises if ``process`` exits first or the deadline passes."""

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited (code {process.returncode}) before {url} answered")
        return answers(url)

    if not wait_for(ready, timeout_s, 0.5):
        raise TimeoutError(f"{name}: {url} did not answer within {timeout_s:.0f} s")


def stop_gracefully(process: subprocess.Popen, timeout_s: float = 120) -> None:
    """SIGINT (a server's Ctrl-C path, which tears down what it started), then SIGKILL after ``timeout_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True, slots=True)
class Outcome:
    started: float
    ended: float
    status: int
    """HTTP status, or 0 when the request failed without one (connection error, timeout)."""
    text: str


@dataclass
class Load:
    """Non-streaming completions, ``concurrency`` at a time, until stopped; every outcome recorded.

    As a context manager it starts, waits until the first outcomes arrived, and stops on exit.
    """

    url: str
    model: str = "tiny-llama"
    concurrency: int = 4
    timeout_s: float = 300
    headers: dict[str, str] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    """Extra fields of every request's body, e.g. ``{"temperature": 0}`` for the same tokens each time."""
    outcomes: list[Outcome] = field(default_factory=list)
    _started: dict[int, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        def run(worker: int) -> None:
            with httpx.Client(timeout=self.timeout_s, headers=self.headers) as client:
                while not self._stop.is_set():
                    body = {"model": self.model, "prompt": "The harbour at dawn", "max_tokens": 12, **self.sampling}
                    started = self._started[worker] = time.time()
                    try:
                        response = client.post(f"{self.url}/v1/completions", json=body)
                        status, text = response.status_code, response.text[:300]
                    except httpx.HTTPError as err:
                        status, text = 0, repr(err)
                    del self._started[worker]
                    self.outcomes.append(Outcome(started, time.time(), status, text))

        self._threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(self.concurrency)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop sending; requests in flight may still finish within ``timeout_s`` (see :meth:`in_flight`)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s)

    def __enter__(self) -> Load:
        self.start()
        assert wait_for(lambda: len(self.outcomes) >= 2 * self.concurrency, 120), "the load never got going"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def in_flight(self) -> int:
        """Requests sent and not answered (after :meth:`stop`: the ones that never came back)."""
        return len(self._started)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]

    def failed_since(self, t0: float) -> int:
        """Requests that ended in failure at or after ``t0`` (wall clock), e.g. a fault's time."""
        return sum(1 for o in self.outcomes if o.ended >= t0 and o.status != 200)

    def answered_since(self, t0: float) -> int:
        return sum(1 for o in self.outcomes if o.ended >= t0)

    def served_after(self, t0: float) -> int:
        """Requests sent at or after ``t0`` and answered 200: the load carried by what was left after a fault."""
        return sum(1 for o in self.outcomes if o.started >= t0 and o.status == 200)
