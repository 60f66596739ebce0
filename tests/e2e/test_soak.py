"""A short soak (``bench/soak.py`` runs the long one): 64 clients for 45 s through 2 groups, cycling chat and
completions, streamed and not. Every request is answered completely (200, usage, ``[DONE]``), none is left
hanging, and the ingress and leaders do not pile up open files."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.soak import MODEL, SHAPES, soak
from tests.e2e.server import Server, flotilla_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STREAMS, DURATION_S = 64, 45


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("soak") / "two-groups.yaml"
    config.write_text(
        f"model: {models_dir / MODEL}\nserved_model_name: {MODEL}\ngroups: 2\ncpu: {{threads_per_worker: 1}}\n"
    )
    with flotilla_serve(str(config)) as running:
        yield running


def test_a_short_soak_loses_nothing_and_leaks_no_files(server: Server) -> None:
    result = asyncio.run(soak(server.url, STREAMS, DURATION_S, sample_every_s=5))
    assert result.failures == [], result.failures[:3]
    assert result.unfinished == 0
    assert set(result.requests) == set(SHAPES) and sum(result.requests.values()) >= 2 * STREAMS
    for role, growth in result.growth(warmup_s=10).items():
        # One file per request would add hundreds here; connections come and go within a few.
        assert growth["open_files_growth"] < STREAMS, (role, growth)
