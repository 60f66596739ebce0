"""``flotilla eplb-demo``: a coordinator-owned CPU EP group serves a skewed token stream while EPLB rebalances it."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from flotilla.cluster.contract import EplbStatus, Membership
from flotilla.cluster.eplb.controller import EplbControllerConfig
from flotilla.cluster.eplb.ep_group import EpGroupConfig
from flotilla.cluster.eplb.moe import MoeCheckpoint

DEMO_CONFIG = EplbControllerConfig(
    window_ticks=8, min_window_ticks=4, trigger_balancedness=0.8, rearm_balancedness=0.85, min_interval_s=5.0
)
"""Short windows and interval so a rebalance happens within seconds; production defaults are minutes."""
DEMO_TICK_S = 0.5


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
    """Start a coordinator that owns one EP group, feed the group skewed tokens, report what EPLB does."""
    import ray
    from prometheus_client import CollectorRegistry, start_http_server

    from flotilla.cluster.contract import DEFAULT_NAMESPACE
    from flotilla.cluster.coordinator import Coordinator, coordinator_actor_options
    from flotilla.cluster.lifecycle import RecoveryConfig
    from flotilla.cluster.metrics import EplbCollector

    if not ray.is_initialized():
        ray.init(
            address="local",
            namespace=DEFAULT_NAMESPACE,
            num_cpus=max(num_ranks, 2),
            include_dashboard=False,
            log_to_driver=False,
        )
    config = EpGroupConfig(
        model=model_dir, ranks=num_ranks, redundant=num_redundant, tick_s=DEMO_TICK_S, controller=DEMO_CONFIG
    )
    interrupt_on_stop_signals()  # after ray.init, which puts its own SIGTERM handler in
    coordinator: Any = (
        ray.remote(Coordinator)
        .options(**coordinator_actor_options(DEFAULT_NAMESPACE))
        .remote({}, RecoveryConfig(), 600.0, DEFAULT_NAMESPACE, config)
    )
    try:
        ray.get(coordinator.start.remote())

        def membership() -> Membership:
            return cast(Membership, ray.get(coordinator.get_membership.remote()))

        if metrics_port is not None:
            registry = CollectorRegistry()
            registry.register(EplbCollector(lambda: membership().eplb))
            start_http_server(metrics_port, registry=registry)
            say(f"metrics on http://127.0.0.1:{metrics_port}/metrics")
        say(f"`flotilla status --address {ray.get_runtime_context().gcs_address}` shows the EPLB block")
        group = wait_for_ep_group(DEFAULT_NAMESPACE, timeout_s=300)
        say(f"{num_ranks} EP ranks up; serving skewed tokens, the coordinator ticks EPLB every {DEMO_TICK_S} s")
        checkpoint = MoeCheckpoint(model_dir)
        rng = np.random.default_rng(0)
        stream = skewed_tokens(checkpoint, 4 * tokens_per_step, hot_expert=5, rng=rng)
        started = time.monotonic()
        step, reported = 0, None
        while time.monotonic() - started < duration_s:
            batch = stream[rng.integers(0, stream.shape[0], tokens_per_step)]
            ray.get(group.forward.remote(batch, np.arange(step * tokens_per_step, (step + 1) * tokens_per_step)))
            step += 1
            eplb = next(iter(membership().eplb), None)
            if eplb is not None and ((eplb.state, eplb.rebalances) != reported or step % 20 == 0):
                say(f"step {step}: {describe(eplb)}")
                reported = (eplb.state, eplb.rebalances)
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        ray.get(coordinator.shutdown.remote())
        ray.kill(coordinator, no_restart=True)
    return 0


def interrupt_on_stop_signals() -> None:
    """Ctrl-C and SIGTERM both raise KeyboardInterrupt, so the demo ends through its cleanup.

    Started as a shell's background job the process inherits SIGINT ignored, and Python then raises
    nothing on Ctrl-C; Ray's own SIGTERM handler exits without saying why.
    """
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.default_int_handler)


def wait_for_ep_group(namespace: str, timeout_s: float) -> Any:
    """The coordinator's EP group, once it answers (its ranks have loaded their experts)."""
    import ray

    from flotilla.cluster.eplb.ep_group import EP_GROUP_NAME

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            group = ray.get_actor(EP_GROUP_NAME, namespace=namespace)
            ray.get(group.status.remote(), timeout=max(deadline - time.monotonic(), 1))
            return group
        except ValueError:  # not created yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"the EP group did not start within {timeout_s:.0f} s") from None
            time.sleep(0.2)


def describe(eplb: EplbStatus) -> str:
    balance = "-" if eplb.balancedness is None else f"{eplb.balancedness:.3f}"
    line = f"{eplb.state}, balancedness {balance}"
    last = eplb.last_rebalance
    if last is not None:
        line += (
            f"; rebalances {eplb.rebalances}, last {last.balancedness_before:.3f} -> planned "
            f"{last.balancedness_planned:.3f}, {last.experts_moved} experts / {last.bytes_moved / 1e6:.1f} MB "
            f"moved in {last.duration_s:.2f} s"
        )
    return line
