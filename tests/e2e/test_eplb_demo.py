"""``flotilla eplb-demo`` ends through its own cleanup on Ctrl-C and on SIGTERM, and leaves no process of
the Ray cluster it started. Started as a shell's background job (``flotilla eplb-demo &``) it inherits
SIGINT ignored, and Python then never raises KeyboardInterrupt: the demo must take the signal back."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from devtools import REPO, alive, wait_for

pytestmark = pytest.mark.e2e  # two demo starts of 2 ranks (about 15 s each)


def ignore_sigint() -> None:
    """What a non-interactive shell does to a job it starts with ``&``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=lambda sig: sig.name)
def test_the_demo_stops_on_a_signal_as_a_background_job_and_leaves_no_process(
    models_dir: Path, tmp_path: Path, stop: signal.Signals
) -> None:
    log = tmp_path / "demo.log"
    command = [sys.executable, "-m", "flotilla.cli", "eplb-demo", "--ranks", "2", "--duration-s", "600"]
    with log.open("w") as out:
        process = subprocess.Popen(
            command + ["--model", str(models_dir / "tiny-mixtral")],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=ignore_sigint,
        )
    started: list[psutil.Process] = []
    try:
        wait_for(lambda: "EP ranks up" in log.read_text() or process.poll() is not None, timeout_s=240)
        assert process.poll() is None, log.read_text()
        started = psutil.Process(process.pid).children(recursive=True)  # the demo's Ray cluster
        process.send_signal(stop)
        try:
            returncode = process.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the demo was still running 60 s after {stop.name}:\n{log.read_text()[-2000:]}")
        output = log.read_text()
        assert (returncode, "interrupted" in output) == (0, True), output[-2000:]
        left = wait_for(lambda: not [p for p in started if alive(p)], timeout_s=30)
        assert left, [f"{p.pid} {p.name()}" for p in started if alive(p)]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for child in started:
            if alive(child):
                child.kill()
