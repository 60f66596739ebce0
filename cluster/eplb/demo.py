"""``flotilla eplb-demo``: the CPU EP runtime serving a skewed token stream while the controller rebalances."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cluster.eplb.controller import EplbController, EplbControllerConfig, EplbState
from cluster.eplb.moe import MoeCheckpoint

DEMO_CONFIG = EplbControllerConfig(
    window_ticks=8, min_window_ticks=4, trigger_balancedness=0.8, rearm_balancedness=0.85, min_interval_s=5.0
)
"""Short windows and interval so a rebalance happens within seconds; production defaults are minutes."""


def skewed_tokens(checkpoint: MoeCheckpoint, count: int, hot_expert: int, rng: np.random.Generator) -> np.ndarray:
    """Hidden states pulled towards ``hot_expert``'s gate row in every layer, so it is chosen far more often."""
    shape = checkpoint.shape
    x = torch.from_numpy(rng.standard_normal((count, shape.hidden)).astype(np.float32))
    for layer in range(shape.num_layers):
        row = checkpoint.gate(layer)[hot_expert]
        x += 3.0 * row / row.norm()
    return x.numpy()


def run_demo(
    model_dir: Path,
    num_ranks: int,
    num_redundant: int | None,
    duration_s: float,
    tokens_per_step: int,
    metrics_port: int | None,
    say: Callable[[str], None],
) -> int:
    import ray
    from prometheus_client import CollectorRegistry, start_http_server

    from cluster.eplb.runtime import CpuEpRuntime

    registry = CollectorRegistry()
    if metrics_port is not None:
        start_http_server(metrics_port, registry=registry)
        say(f"metrics on http://127.0.0.1:{metrics_port}/metrics")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(num_ranks, 2), include_dashboard=False, log_to_driver=False)
    checkpoint = MoeCheckpoint(model_dir)
    runtime = CpuEpRuntime(model_dir, num_ranks=num_ranks, num_redundant=num_redundant)
    controller = EplbController(runtime, DEMO_CONFIG, registry)
    say(f"{num_ranks} EP ranks, {runtime.num_physical} slots for {runtime.num_logical} experts; serving skewed tokens")
    rng = np.random.default_rng(0)
    stream = skewed_tokens(checkpoint, 4 * tokens_per_step, hot_expert=5, rng=rng)
    started = time.monotonic()
    step, state = 0, EplbState.IDLE
    try:
        while time.monotonic() - started < duration_s:
            batch = stream[rng.integers(0, stream.shape[0], tokens_per_step)]
            runtime.forward(batch, np.arange(step * tokens_per_step, (step + 1) * tokens_per_step))
            new_state = controller.tick()
            step += 1
            if new_state is not state or step % 20 == 0:
                _report(controller, step, say)
            state = new_state
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        runtime.shutdown()
    _report(controller, step, say)
    return 0


def _report(controller: EplbController, step: int, say: Callable[[str], None]) -> None:
    snapshot = controller.describe()
    line = f"step {step}: {snapshot['state']}, balancedness {snapshot['balancedness_overall']:.3f}"
    last = snapshot["last_rebalance"]
    if last is not None:
        line += (
            f"; rebalances {snapshot['rebalances']}, last {last['balancedness_before']:.3f} -> planned "
            f"{last['balancedness_planned']:.3f}, {last['experts_moved']} experts / {last['bytes_moved'] / 1e6:.1f} MB "
            f"moved in {last['duration_s']:.2f} s"
        )
    say(line)
