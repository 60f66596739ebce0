"""Shared fixtures: the tiny models (built once per session if `make` has not built them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.cluster.tiny_models import TINY_MODELS, make_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def models_dir() -> Path:
    root = REPO / "models"
    for name, spec in TINY_MODELS.items():
        make_model(spec, root / name)  # no-op when `make` already built it
    return root


@pytest.fixture(scope="session")
def tiny_llama(models_dir: Path) -> Path:
    return models_dir / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_mixtral(models_dir: Path) -> Path:
    return models_dir / "tiny-mixtral"
