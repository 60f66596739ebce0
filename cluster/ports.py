"""Free TCP ports for the listeners Flotilla configures itself (dashboards, HAProxy stats, KV events).

Ports come from 20000–29999: above Ray's worker port range (10002–19999) and below Linux's
ephemeral range (32768+), so a port chosen now is not taken by an OS-assigned socket before its
owner starts; and they are checked free on every address, because HAProxy binds 0.0.0.0.
"""

from __future__ import annotations

import random
import socket

PORT_RANGE = (20000, 30000)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on every address right now (their owner binds them moments later)."""
    candidates = list(range(*PORT_RANGE))
    random.shuffle(candidates)
    chosen: list[int] = []
    for port in candidates:
        if not _free(port):
            continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"fewer than {count} free TCP ports in {PORT_RANGE}")


def free_port_run(length: int) -> int:
    """A port p with p … p + length - 1 all free right now (a base port its owner counts up from)."""
    for base in free_ports(64):
        if base + length <= PORT_RANGE[1] and all(_free(port) for port in range(base, base + length)):
            return base
    raise RuntimeError(f"no run of {length} free TCP ports found in {PORT_RANGE}")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
