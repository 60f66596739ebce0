"""Joining an existing Ray cluster from a Flotilla process (CLI, tests, benchmarks)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

DEFAULT_TOKEN_PATH = Path.home() / ".ray" / "auth_token"


def connect(address: str, namespace: str | None = None) -> None:
    """``ray.init`` to ``address`` ("auto" or "host:port"), with the local auth token if there is one.

    Ray 2.60 clusters started by ``ray.init()`` require a token, and Ray turns token mode on
    by itself only when the address is "auto"; with an explicit address we do it here.
    """
    token_path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", DEFAULT_TOKEN_PATH))
    if "RAY_AUTH_MODE" not in os.environ and ("RAY_AUTH_TOKEN" in os.environ or token_path.is_file()):
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")  # RayConfig caches the mode when ray is imported; re-read it
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR)
