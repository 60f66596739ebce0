"""The HAProxy watchdog: when the server that started it dies, the HAProxies with its token die too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from devtools import wait_for
from flotilla.haproxy_guard import TOKEN_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# A stand-in for `flotilla serve`: starts the watchdog, prints its pid, then waits to be killed.
SERVER = (
    "import sys, time; from flotilla.haproxy_guard import start_watchdog; "
    "print(start_watchdog(sys.argv[1]).pid, flush=True); time.sleep(600)"
)


def fake_haproxy(tmp_path: Path, token: str) -> subprocess.Popen[bytes]:
    """A long sleep whose process name is ``haproxy``, with a guard token in its environment."""
    binary = tmp_path / "haproxy"
    if not binary.exists():
        shutil.copy(shutil.which("sleep") or "/bin/sleep", binary)
    return subprocess.Popen([str(binary), "600"], env=os.environ | {TOKEN_ENV: token})


def test_a_killed_server_takes_its_haproxies_and_only_those(tmp_path: Path) -> None:
    mine, other = fake_haproxy(tmp_path, "token-a"), fake_haproxy(tmp_path, "token-b")
    server = subprocess.Popen([sys.executable, "-c", SERVER, "token-a"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        watchdog = psutil.Process(int(server.stdout.readline()))
        assert watchdog.is_running() and mine.poll() is None
        server.send_signal(signal.SIGKILL)
        assert wait_for(lambda: mine.poll() is not None, 10), "HAProxy outlived the server that started it"
        assert mine.returncode == -signal.SIGKILL
        assert wait_for(lambda: not watchdog.is_running() or watchdog.status() == psutil.STATUS_ZOMBIE, 10)
        assert other.poll() is None, "another server's HAProxy was killed"
    finally:
        for process in (server, mine, other):
            process.kill()
            process.wait()
