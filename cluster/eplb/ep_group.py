"""An expert-parallel group: the CPU EP runtime and its EPLB controller in one Ray actor.

The coordinator creates it and drives its control loop; it is not on the request path.
Data path: callers send hidden states to ``forward`` (the rank actors dispatch and combine).
Control path: the coordinator calls ``tick`` every ``tick_s``; the controller drains the
per-slot load counters and advances its trigger, or the migration by one layer step, and
``tick`` returns the :class:`EplbStatus` the coordinator publishes (``flotilla status``,
ingress metrics). A lock keeps one forward and one tick step apart, so a rebalance proceeds
layer by layer between batches while the group keeps serving.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from flotilla.cluster.contract import EplbStatus
from flotilla.cluster.eplb.controller import EplbController, EplbControllerConfig

EP_GROUP_NAME = "flotilla-ep-group"


class EpGroupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Path = Field(description="Mixtral-style MoE model folder (config.json + safetensors).")
    ranks: int = Field(4, ge=1, description="EP ranks, one Ray actor each.")
    redundant: int | None = Field(None, ge=0, description="Redundant expert slots; default one per rank.")
    tick_s: float = Field(
        1.0, gt=0, description="How often the coordinator ticks the controller (one load sample, one migration step)."
    )
    controller: EplbControllerConfig = Field(default_factory=EplbControllerConfig)


class EpGroup:
    """Runs as a threaded Ray actor (``ep_group_actor_options``): forward and tick may arrive together."""

    def __init__(self, config: EpGroupConfig) -> None:
        from flotilla.cluster.eplb.runtime import CpuEpRuntime

        self.runtime = CpuEpRuntime(config.model, num_ranks=config.ranks, num_redundant=config.redundant)
        self.controller = EplbController(self.runtime, config.controller)
        self._lock = threading.Lock()

    def forward(self, x: np.ndarray, token_index: np.ndarray | None = None) -> np.ndarray:
        with self._lock:
            return self.runtime.forward(x, token_index)

    def tick(self) -> EplbStatus:
        with self._lock:
            self.controller.tick()
            return self.controller.status()

    def status(self) -> EplbStatus:
        with self._lock:
            return self.controller.status()

    def shutdown(self) -> None:
        with self._lock:
            self.runtime.shutdown()


def ep_group_actor_options(namespace: str) -> dict[str, Any]:
    """Named and detached like the groups' leaders: it outlives a coordinator restart, which adopts it."""
    return {
        "name": EP_GROUP_NAME,
        "namespace": namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        "max_concurrency": 4,
        "num_cpus": 0,
    }
