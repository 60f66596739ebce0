"""`flotilla serve` refuses bad configs before starting anything; every command exits without a last collection."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.cli import main

REPO = Path(__file__).resolve().parents[3]


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "serve", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            "tensor_parallel_size: 3",
            "[heads-divisible-by-tp] 4 attention heads cannot be split evenly over TP=3",
        ),
        ("pipeline_parallel_size: 8", "[layers-vs-pp] 4 layers cannot fill PP=8 stages"),
        ("groups: 0", "groups: Input should be greater than or equal to 1"),
    ],
)
def test_bad_layout_exits_2_naming_the_rule_without_starting_ray(tmp_path, tiny_llama, fields, expected) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(f"model: {tiny_llama}\n{fields}\n")
    result = serve(config)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Ray cluster" not in result.stdout + result.stderr


def test_make_model_is_a_no_op_when_up_to_date(models_dir, smollm2) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "make-model", "--out", str(models_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    for name in ("tiny-llama", "tiny-mixtral", "smollm2-135m-instruct"):
        assert f"{name}: up to date" in result.stdout


def test_a_command_leaves_what_it_made_out_of_the_collection_at_exit(tiny_llama) -> None:
    gc.unfreeze()
    try:
        command = ["plan", "--model", str(tiny_llama), "--nodes", "1", "--accelerators-per-node", "1"]
        assert main(command + ["--memory-gib", "80"]) == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
