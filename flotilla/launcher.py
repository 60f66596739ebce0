"""``flotilla serve``: check the config, start Ray, start the groups, deploy the ingress.

Everything that can be checked without starting anything is checked first (layout rules,
engine argument names, slots), so a bad config fails in seconds with the rule it breaks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
from ray import serve
from ray.serve.schema import ApplicationStatus

from flotilla.cluster.config import ConfigError
from flotilla.cluster.contract import GroupState, Membership
from flotilla.cluster.engine import EngineSpec, Executor, default_worker_threads, unknown_engine_args
from flotilla.cluster.layout import LayoutViolation, check_capacity, check_layout
from flotilla.cluster.local_ray import LocalCluster, LocalClusterShape
from flotilla.cluster.model_spec import ModelSpec, UnsupportedModelError
from flotilla.cluster.placement import HEAD_NODE_RESOURCE
from flotilla.cluster.planner import GIB, ClusterSpec, LinkKind, Workload, choose_for_groups
from flotilla.cluster.ports import free_port
from flotilla.config import ServeConfig
from flotilla.haproxy_guard import guard_haproxy
from flotilla.router.api_keys import parse_keys

SERVE_APP_NAME = "flotilla"
HEARTBEAT_S = 10.0
PROGRESS_POLL_S = 0.5
COORDINATOR_SHUTDOWN_TIMEOUT_S = 120.0
INGRESS_REACHABLE_TIMEOUT_S = 60.0

Say = Callable[[str], None]


def group_name(index: int) -> str:
    return f"group-{index}"


def validate(config: ServeConfig) -> tuple[ServeConfig, ModelSpec, list[str]]:
    """Checks that need no cluster; raises ConfigError naming the broken rule.

    Returns the config with TP and PP resolved (by the planner when omitted), the model's
    spec, and the planner's reasons for its choice (empty when the config fixed TP and PP).
    """
    try:
        spec = ModelSpec.from_path(config.model_path, strict=False)
    except (OSError, KeyError, ValueError) as err:
        raise ConfigError(f"cannot read model {config.model_path}: {err}") from err
    notes: list[str] = []
    if config.tensor_parallel_size is None or config.pipeline_parallel_size is None:
        config, notes = _plan_layout(config)
    expert_parallel = config.tp * config.data_parallel_size if config.data_parallel_size > 1 else 1
    problems = check_layout(spec, config.tp, config.pp, ep=expert_parallel)
    local = config.cluster.local
    if config.cluster.address is None and local.slots_per_node is not None:
        problems += check_capacity(
            config.groups * config.slots_per_group,
            local.nodes * local.slots_per_node,
            config.layout_text,
        )
    problems += _check_wide_ep(config)
    if problems:
        raise ConfigError("invalid layout:\n" + "\n".join(f"  {p}" for p in problems))
    unknown = unknown_engine_args(config.engine_args)
    if unknown:
        raise ConfigError(f"engine_args has fields vLLM does not know: {unknown}")
    _check_serving(config)
    return config, spec, notes


def _check_wide_ep(config: ServeConfig) -> list[LayoutViolation]:
    """What a wide-EP group (one vLLM engine per DP rank) needs beyond the model's own rules."""
    if config.data_parallel_size == 1:
        return []
    problems = []
    if config.pp != 1:
        problems.append(LayoutViolation("wide-ep-pp", "a wide-EP group (data_parallel_size > 1) runs PP=1"))
    if config.executor == "ray":
        problems.append(
            LayoutViolation(
                "wide-ep-executor",
                "a wide-EP group runs each DP rank under vLLM's mp executor: set executor auto or mp",
            )
        )
    return problems


def _check_serving(config: ServeConfig) -> None:
    """The serving layer's flags, checked by vLLM's own rules; API keys present when asked for."""
    from flotilla.router.frontend import check_parsers, serving_args

    try:
        serving_args(config.serving, str(config.model_path), config.model_name)
        check_parsers(config.serving, str(config.engine_args.get("tokenizer", config.model_path)))
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"invalid serving config: {err}") from None
    if config.serving.api_keys_env and not _api_keys(config):
        raise ConfigError(f"serving.api_keys_env names {config.serving.api_keys_env}, which holds no API key")
    if (path := config.serving.api_keys_file) and not Path(path).is_file():
        raise ConfigError(f"serving.api_keys_file {path} is not a file")


def _api_keys(config: ServeConfig) -> tuple[str, ...]:
    if not config.serving.api_keys_env:
        return ()
    return parse_keys(os.environ.get(config.serving.api_keys_env, ""))


def _plan_layout(config: ServeConfig) -> tuple[ServeConfig, list[str]]:
    """Let the planner pick the omitted TP and/or PP for ``config.groups`` groups."""
    try:
        spec = ModelSpec.from_path(config.model_path)
    except UnsupportedModelError as err:
        raise ConfigError(f"{err}; set tensor_parallel_size and pipeline_parallel_size yourself") from err
    cluster = _planning_cluster(config)
    context = config.plan.context_len or min(spec.max_position_embeddings or 8192, 8192)
    workload = Workload(context, config.plan.concurrency, config.plan.latency_sensitive)
    result = choose_for_groups(spec, cluster, workload, config.groups)
    fits = [
        e
        for e in result.ranked
        if config.tensor_parallel_size in (None, e.layout.tp) and config.pipeline_parallel_size in (None, e.layout.pp)
    ]
    if not fits:
        rejected = "\n".join(f"  {r.layout}: {'; '.join(map(str, r.violations))}" for r in result.rejected)
        raise ConfigError(f"the planner found no layout for {config.groups} group(s):\n{rejected}")
    best = fits[0]
    chosen = config.model_copy(
        update={"tensor_parallel_size": best.layout.tp, "pipeline_parallel_size": best.layout.pp}
    )
    return chosen, [f"planner chose TP={best.layout.tp} PP={best.layout.pp}:", *best.reasons]


def _planning_cluster(config: ServeConfig) -> ClusterSpec:
    plan, local = config.plan, config.cluster.local
    if config.cluster.address is not None and (plan.nodes is None or plan.accelerators_per_node is None):
        raise ConfigError("with cluster.address, set plan.nodes and plan.accelerators_per_node (or TP and PP)")
    nodes = plan.nodes or local.nodes
    # A local cluster declares slots on demand: by default one per group on every node.
    per_node = plan.accelerators_per_node or local.slots_per_node or -(-config.groups // nodes)
    memory = plan.memory_gib
    if memory is None:
        if config.cluster.address is not None:
            raise ConfigError("with cluster.address, set plan.memory_gib (or TP and PP)")
        memory = psutil.virtual_memory().total / GIB / (nodes * per_node)
    return ClusterSpec(nodes, per_node, memory, LinkKind(plan.intra_link), LinkKind(plan.inter_link))


@dataclass
class Deployment:
    """A running Flotilla: cluster, coordinator (which owns the groups) and ingress."""

    config: ServeConfig
    cluster: LocalCluster | None
    coordinator: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def shutdown(self, say: Say) -> None:
        say("shutting down")
        try:
            serve.shutdown()
        except Exception as err:  # a half-started Serve must not block the rest of the teardown
            say(f"serve shutdown: {err}")
        if self.coordinator is not None:
            try:
                ray.get(self.coordinator.shutdown.remote(), timeout=COORDINATOR_SHUTDOWN_TIMEOUT_S)
            except Exception as err:
                say(f"coordinator shutdown: {err}")
            ray.kill(self.coordinator, no_restart=True)
        if self.cluster is not None:
            self.cluster.shutdown()
        else:
            ray.shutdown()
        say("stopped")


async def start(config: ServeConfig, say: Say, verbose: bool = False) -> Deployment:
    config, spec, notes = validate(config)
    for note in notes:
        say(note)
    say(f"model {config.model_name} ({spec.architecture}, {spec.num_hidden_layers} layers): {config.layout_text}")
    deployment = Deployment(config, cluster=_start_ray(config, say, verbose))
    try:
        _check_cluster_slots(config)
        deployment.coordinator = _start_coordinator(config, deployment.cluster)
        independent = config.groups_to_serve < config.groups
        if independent:  # a group that cannot start yet is retried, not fatal
            await deployment.coordinator.serving_started.remote()
        await deployment.coordinator.start.remote()
        # The ingress replicas load vLLM's frontend while the groups load their engines; each then waits for
        # the first ready group (it takes max_model_len and the block size from it).
        _begin_ingress(deployment)
        membership = await _wait_for_groups(deployment.coordinator, say, config.groups_to_serve)
        if not independent:
            await deployment.coordinator.serving_started.remote()
        await _wait_for_ingress(deployment, say)
        if (port := config.replica_metrics_port) is not None:
            last = port + config.ingress.replicas - 1
            say(
                f"each ingress replica's own metrics: http://{config.host}:{port}"
                + (f"..{last}" if last > port else "")
                + "/metrics (one port per replica on a node); the rest: /metrics?scope=cluster"
            )
        if waiting := [g.name for g in membership.groups if g.state is not GroupState.READY]:
            say(
                f"serving with {len(membership.ready())} of {len(membership.groups)} groups; "
                f"the others ({', '.join(waiting)}) join routing when ready (flotilla status shows their progress)"
            )
    except BaseException:
        deployment.shutdown(say)
        raise
    return deployment


def _start_ray(config: ServeConfig, say: Say, verbose: bool) -> LocalCluster | None:
    began = time.monotonic()
    if not verbose:  # our own progress lines say what Serve's INFO lines would
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    # Ray processes inherit this environment from the local cluster we start; an existing
    # cluster must have been started with it (see deploy/).
    os.environ.update(config.ingress.ray_env())
    if config.cluster.address is None and config.ingress.proxy == "haproxy":
        # HAProxy's stats and metrics listeners default to fixed ports (8404, 9101): a second
        # Flotilla on this machine would fail to start. Free ports, unless the operator chose.
        for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
            os.environ[name] = os.environ.get(name) or str(free_port())
        guard_haproxy()  # a killed `flotilla serve` leaves no HAProxy holding its port
    if config.cluster.address is not None:
        ray.init(address=config.cluster.address, namespace=config.cluster.namespace, log_to_driver=verbose)
        say(f"joined Ray cluster at {config.cluster.address}")
        return None
    shape = LocalClusterShape.for_groups(
        config.cluster.local, config.groups * config.slots_per_group, leaders=config.groups * config.data_parallel_size
    )
    cluster = LocalCluster(shape, config.cluster.namespace, log_to_driver=verbose)
    say(
        f"started local Ray cluster: {shape.nodes} node(s) × {shape.slots_per_node} slot(s) "
        f"at {cluster.address} in {time.monotonic() - began:.1f} s"
        + ("" if verbose else " (engine logs: /tmp/ray/session_latest/logs; --verbose shows them here)")
    )
    return cluster


def _check_cluster_slots(config: ServeConfig) -> None:
    available = int(ray.available_resources().get("GPU", 0))
    needed = config.groups_to_serve  # the other groups wait for their nodes to join
    problems = check_capacity(needed * config.slots_per_group, available, f"{needed} group(s)")
    if problems:
        raise ConfigError("\n".join(str(p) for p in problems))


def _engine_spec(config: ServeConfig, cluster: LocalCluster | None) -> EngineSpec:
    threads = config.cpu.threads_per_worker
    if threads is None and cluster is not None:
        # Simulated nodes share this machine's cores, so divide them over every worker.
        threads = default_worker_threads(os.cpu_count() or 1, config.groups * config.slots_per_group)
    engine_args = dict(config.engine_args)
    if config.serving.reasoning_parser:
        engine_args["reasoning_parser"] = config.serving.reasoning_parser
    return EngineSpec(
        model=str(config.model_path),
        served_model_name=config.model_name,
        tensor_parallel_size=config.tp,
        pipeline_parallel_size=config.pp,
        engine_args=engine_args,
        executor=executor_for(config),
        cpu_kv_cache_memory_bytes=config.cpu.kv_cache_memory_bytes,
        cpu_threads_per_worker=threads,
        cpu_bind_cores=config.cpu.bind_cores,
        cpu_rank_in_engine_core=config.cpu.rank_in_engine_core,
        kv_events=config.routing.kv_events,
        data_parallel_size=config.data_parallel_size,
    )


def executor_for(config: ServeConfig) -> Executor:
    """``auto``: vLLM's own executor (mp) where a group's ranks share a node, Ray's where stages may not."""
    if config.executor != "auto":
        return config.executor
    return "mp" if config.pp == 1 else "ray"


def _start_coordinator(config: ServeConfig, cluster: LocalCluster | None) -> Any:
    from flotilla.cluster.coordinator import Coordinator, coordinator_actor_options

    spec = _engine_spec(config, cluster)
    groups = {group_name(i): spec for i in range(config.groups)}
    namespace = config.cluster.namespace
    actor = ray.remote(Coordinator).options(**coordinator_actor_options(namespace))
    return actor.remote(groups, config.coordinator, config.startup_timeout_s, namespace)


async def _wait_for_groups(coordinator: Any, say: Say, needed: int) -> Membership:
    """Print each group's progress (once ``coordinator.start`` started them) until ``needed`` groups are ready;
    raise when too many cannot start."""
    started = last_heartbeat = time.monotonic()
    said: dict[str, int] = {}  # per group: the number of the last detail printed
    while True:
        membership: Membership = await coordinator.get_membership.remote()
        heartbeat = time.monotonic() - last_heartbeat >= HEARTBEAT_S
        gangs = {group.gang or group.name: group for group in membership.groups}  # DP ranks share their progress
        for name, group in gangs.items():
            unsaid = [(n, detail) for n, detail in group.recent_details if n > said.get(name, 0)]
            for number, detail in unsaid:
                say(f"[{name}] {detail}")
                said[name] = number
            if not unsaid and heartbeat and group.state is GroupState.STARTING:
                say(f"[{name}] {group.detail} ({time.monotonic() - started:.0f} s)")
        if heartbeat:
            last_heartbeat = time.monotonic()
        failed = [g for g in membership.groups if g.state is GroupState.FAILED]
        if len(membership.groups) - len(failed) < needed:
            raise RuntimeError("; ".join(f"{g.name} failed: {g.detail}" for g in failed))
        if len(membership.ready()) >= needed:
            return membership
        await asyncio.sleep(PROGRESS_POLL_S)


def _begin_ingress(deployment: Deployment) -> None:
    """Deploy the ingress without waiting for its replicas (``_wait_for_ingress`` does)."""
    from flotilla.router.ingress import SERVE_REPLICA_ENV, OpenAIIngress
    from flotilla.router.settings import IngressSettings

    config = deployment.config
    settings = IngressSettings(
        engine=_engine_spec(config, deployment.cluster),
        routing=config.routing,
        failover=config.failover,
        admin_token=os.environ.get(config.admin_token_env) or None,
        namespace=config.cluster.namespace,
        serving=config.serving,
        api_keys=_api_keys(config),
        api_keys_file=str(Path(config.serving.api_keys_file).resolve()) if config.serving.api_keys_file else None,
        metrics_port=config.replica_metrics_port,
        metrics_host=config.host,
    )
    on_head = config.ingress.placement == "head"
    serve.start(
        http_options={"host": config.host, "port": config.port},
        proxy_location="HeadOnly" if on_head else "EveryNode",
        detached=False,
    )
    actor_options: dict[str, Any] = {"num_cpus": 0, "runtime_env": {"env_vars": SERVE_REPLICA_ENV}}
    if on_head:
        actor_options["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    ingress = OpenAIIngress.options(  # type: ignore[attr-defined]
        num_replicas=config.ingress.replicas, ray_actor_options=actor_options
    )
    target = serve.RunTarget(target=ingress.bind(settings), name=SERVE_APP_NAME, route_prefix="/")
    serve.run_many([target], wait_for_applications_running=False)


async def _wait_for_ingress(deployment: Deployment, say: Say) -> None:
    """The ingress app running (its replicas built vLLM's frontend over the ready groups) and reachable.

    Bounded by ``startup_timeout_s`` from here (the groups are ready by now): a replica that hangs in its
    constructor leaves Serve's app DEPLOYING forever, and ``flotilla serve`` must say so, not wait with it.
    """
    timeout_s = deployment.config.startup_timeout_s
    started = last_heartbeat = time.monotonic()
    while True:
        app = (await asyncio.to_thread(serve.status)).applications.get(SERVE_APP_NAME)
        if app is not None and app.status == ApplicationStatus.RUNNING:
            break
        if app is not None and app.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
            raise RuntimeError(f"the ingress did not start: {app.message}")
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise RuntimeError(
                f"the ingress was not running {timeout_s:.0f} s after the groups were ready "
                f"({_replica_progress(app)}); raise startup_timeout_s if its replicas are only slow"
            )
        if time.monotonic() - last_heartbeat >= HEARTBEAT_S:
            say(f"[ingress] {_replica_progress(app)} ({waited:.0f} s)")
            last_heartbeat = time.monotonic()
        await asyncio.sleep(PROGRESS_POLL_S)
    await asyncio.to_thread(_wait_until_reachable, f"{deployment.url}/health", INGRESS_REACHABLE_TIMEOUT_S)


def _replica_progress(app: Any) -> str:
    """Serve's replica states of the ingress, e.g. ``replicas: 1 RUNNING, 1 STARTING``."""
    if app is None:
        return "its app is not deployed yet"
    states: dict[str, int] = {}
    for status in app.deployments.values():
        for state, count in status.replica_states.items():
            name = str(getattr(state, "value", state))
            states[name] = states.get(name, 0) + count
    listed = ", ".join(f"{count} {state}" for state, count in sorted(states.items()))
    return f"replicas: {listed or 'none yet'}" + (f"; {app.message}" if app.message else "")


def _wait_until_reachable(url: str, timeout_s: float) -> None:
    """The app being deployed is not enough: the HTTP front (HAProxy) must route to it."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s of deploying the ingress")
        time.sleep(0.2)


def run_forever(config: ServeConfig, say: Say, verbose: bool = False) -> None:
    """Start everything, print the endpoint, block until Ctrl-C or SIGTERM, then shut down."""
    stop = asyncio.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        starting = asyncio.create_task(start(config, say, verbose))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            say("interrupted during startup")
            starting.cancel()  # start() tears down what it had started
            await asyncio.gather(starting, return_exceptions=True)
            return
        stopping.cancel()
        deployment = starting.result()
        say(f"serving {config.model_name} at {deployment.url}/v1 (Ctrl-C to stop)")
        try:
            await stop.wait()
        finally:
            deployment.shutdown(say)

    asyncio.run(main())
