"""Ports picked now and bound later: no second pick on the machine returns one within the hold."""

from __future__ import annotations

import os
import socket
import time

import pytest

from flotilla.cluster import ports


@pytest.fixture
def narrow(monkeypatch, tmp_path):
    """A three-port range that is free here, and a fresh pick registry."""
    base = ports.free_port_run(3)
    monkeypatch.setattr(ports, "PICKS_DIR", tmp_path / "picks")
    monkeypatch.setattr(ports, "PORT_RANGE", (base, base + 3))
    return base


def test_a_picked_port_is_not_picked_again_although_nothing_bound_it(narrow) -> None:
    picked = ports.free_ports(3)
    assert sorted(picked) == [narrow, narrow + 1, narrow + 2]
    with pytest.raises(RuntimeError, match="fewer than 1 free TCP ports"):
        ports.free_port()


def test_a_pick_older_than_the_hold_is_handed_out_again(narrow) -> None:
    first = ports.free_ports(3)
    old = time.time() - ports.PICK_HOLD_S - 1
    os.utime(ports.PICKS_DIR / str(first[0]), (old, old))
    assert ports.free_port() == first[0]


def test_a_port_bound_by_anyone_is_not_picked(narrow) -> None:
    with socket.socket() as sock:
        sock.bind(("", narrow + 1))
        assert sorted(ports.free_ports(2)) == [narrow, narrow + 2]


def test_a_run_is_noted_whole(narrow) -> None:
    assert ports.free_port_run(3) == narrow
    assert sorted(int(p.name) for p in ports.PICKS_DIR.iterdir()) == [narrow, narrow + 1, narrow + 2]
