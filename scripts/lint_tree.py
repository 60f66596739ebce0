"""Mirror the installed package layout (pyproject's ``package-dir``) as a tree of symlinks, for the linters.

``cluster/`` and ``router/`` are the packages ``flotilla.cluster`` and ``flotilla.router``; the
editable install maps them with an import hook, which mypy and import-linter (grimp) do not run.
They read this tree instead, where every file is a symlink to its source:

    python -m scripts.lint_tree build/lint    # then: mypy build/lint/flotilla; lint-imports
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build(dest: Path) -> Path:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    shutil.rmtree(dest, ignore_errors=True)
    for package in setuptools["packages"]:
        source = _source_dir(package, package_dir)
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for path in sorted(source.glob("*.py")) + sorted(source.glob("py.typed")):
            (target / path.name).symlink_to(path)
    return dest


def _source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """Where ``package``'s files live: the longest mapped prefix, then its sub-folders."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in package_dir:
            return REPO / package_dir[prefix] / Path(*parts[cut:])
    return REPO / Path(*parts)


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "build" / "lint"))
