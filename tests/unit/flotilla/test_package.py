"""One import namespace: the wheel installs only `flotilla`, and nothing loads `cluster` or `router` top-level."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import zipfile
from pathlib import Path

from devtools import REPO


def test_the_wheel_installs_only_the_flotilla_package(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("flotilla-*.whl")
    tops = {name.split("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"flotilla", next(t for t in tops if t.endswith(".dist-info"))}
    names = zipfile.ZipFile(wheel).namelist()
    assert "flotilla/cluster/leader.py" in names and "flotilla/router/ingress.py" in names
    assert "flotilla/cluster/eplb/controller.py" in names and "flotilla/router/policies/cache_aware.py" in names


def test_the_packages_import_from_any_directory(tmp_path: Path) -> None:
    probe = "import flotilla.cluster, flotilla.router, flotilla.cli; import importlib.util as u; "
    probe += "print(u.find_spec('cluster') is None and u.find_spec('router') is None)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"


def test_no_module_is_loaded_under_a_second_name() -> None:
    imported = []
    for package in ("flotilla", "flotilla.cluster", "flotilla.router"):
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, f"{package}."):
            imported.append(importlib.import_module(module.name).__name__)
    assert {"flotilla.launcher", "flotilla.cluster.eplb.controller", "flotilla.router.policies.cache_aware"} <= set(
        imported
    )
    assert not {"cluster", "router"} & set(sys.modules)
    assert not [name for name in sys.modules if name.startswith(("cluster.", "router."))]
