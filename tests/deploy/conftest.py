"""Fixtures for the deployment tests: Debian's Prometheus (installed by `make test` when missing)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    found = shutil.which("prometheus")
    if found is None or shutil.which("promtool") is None:
        pytest.fail("prometheus/promtool not found: `make test` installs Debian's prometheus package")
    return Path(found)
