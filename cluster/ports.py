"""Free TCP ports for the listeners Flotilla configures itself (dashboards, HAProxy stats, KV events).

Ports come from 20000–29499: above Ray's worker port range (10002–19999), below vLLM's default
data-parallel ports (29500 and up, counted up per process group) and below Linux's ephemeral range
(32768+), so a port chosen now is not taken by an OS-assigned socket before its owner starts; and
they are checked free on every address, because HAProxy binds 0.0.0.0.

"Free now" is not enough for a port bound minutes after it is chosen (HAProxy's, bound when the
ingress deploys, after every group has started): a pick in between, by another Flotilla process on
the machine, could return it again. So every pick is also noted in a directory all Flotilla
processes on the machine share, and a port picked within the last :data:`PICK_HOLD_S` is not
handed out again. (No lock to hold: the picker is often not the process that binds.)
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

PORT_RANGE = (20000, 29500)
PICKS_DIR = Path(tempfile.gettempdir()) / "flotilla-port-picks"
PICK_HOLD_S = 900.0
"""Longer than any start of a group or a server: a port picked is bound (or abandoned) by then."""


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on every address right now and not picked by any Flotilla process on
    this machine within :data:`PICK_HOLD_S` (their owner binds them moments or minutes later)."""
    candidates = list(range(*PORT_RANGE))
    random.shuffle(candidates)
    chosen: list[int] = []
    for port in candidates:
        if not _free(port) or not _note_pick(port):
            continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"fewer than {count} free TCP ports in {PORT_RANGE}")


def free_port_run(length: int) -> int:
    """A port p with p … p + length - 1 all free right now and noted as picked (a base port its owner
    counts up from)."""
    bases = list(range(PORT_RANGE[0], PORT_RANGE[1] - length + 1))
    random.shuffle(bases)
    for base in bases:
        run = range(base, base + length)
        if all(_free(port) for port in run) and all(map(_note_pick, run)):
            return base
    raise RuntimeError(f"no run of {length} free TCP ports found in {PORT_RANGE}")


def _note_pick(port: int) -> bool:
    """Note ``port`` as picked now; False where another pick holds it (created atomically, so of two
    processes picking the same port at once, one wins)."""
    PICKS_DIR.mkdir(parents=True, exist_ok=True)
    path = PICKS_DIR / str(port)
    try:
        if time.time() - path.stat().st_mtime < PICK_HOLD_S:
            return False
        path.unlink(missing_ok=True)  # an old pick: its owner bound the port or gave it up long ago
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
