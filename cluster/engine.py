"""How Flotilla configures one vLLM engine (a replica group's ``AsyncLLM``).

Everything here runs where vLLM is importable: in the leader actor, and at ``serve``
startup to reject unknown engine arguments before anything starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flotilla.cluster.cpu_binding import UNPINNED, CoreClaim, claim_cores, widen_to_machine
from flotilla.cluster.eplb.vllm_policy import POLICY_NAME, POLICY_SWITCH_ENV
from flotilla.cluster.rank_probe import RANK_PROBE

CPU_ENGINE_ENV = {
    # vLLM wraps VocabParallelEmbedding in torch.compile(inductor) when TP > 1: 3-4 s of
    # compile on CPU that enforce_eager does not disable.
    "TORCHDYNAMO_DISABLE": "1",
}
# On CPU, warm-up (which allocates PP's intermediate-tensor buffers) runs only when the
# compilation mode is not NONE; "trace once" with the eager backend runs the model eagerly.
CPU_COMPILATION_CONFIG = {"mode": 2, "backend": "eager"}
# Where nothing needs the warm-up (one PP stage, one DP rank), mode NONE skips it: it is one forward
# pass of max_num_batched_tokens dummy tokens, about 20 s of a start or gang restart for SmolLM2-135M
# on one core. Both run the model eagerly, yet decode steps took 2.4x as long under trace-once
# (docs/benchmarks.md, "The compilation setting, side by side").
CPU_EAGER_COMPILATION_CONFIG = {"mode": 0}


Executor = Literal["ray", "mp"]


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything a leader needs to build its engine; made by the driver from ServeConfig."""

    model: str
    served_model_name: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    engine_args: dict[str, Any] = field(default_factory=dict)
    cpu_kv_cache_memory_bytes: int = 512 << 20
    cpu_threads_per_worker: int | None = None
    cpu_bind_cores: bool = True
    """Pin each worker's model threads to cores no other group on the machine holds (``cpu_binding``; mp executor)."""
    cpu_rank_in_engine_core: bool = True
    """One rank under ``mp`` runs in vLLM's EngineCore process on CPU too (``engine_core_process``)."""
    kv_events: bool = True
    """Publish vLLM's KV-cache events (ZMQ) so routers can track this engine's cache exactly."""
    executor: Executor = "ray"
    """``ray``: one Ray worker actor per rank, in the group's bundles (any layout, across nodes).
    ``mp``: vLLM's own multiprocessing executor, ranks as child processes of the leader, which holds
    the group's accelerators in one bundle (groups on one node)."""
    data_parallel_size: int = 1
    """DP ranks of a wide-EP group: one engine (and leader) per rank, the MoE experts sharded over every
    rank of every engine (vLLM's DP with an external load balancer, ``enable_expert_parallel``)."""
    data_parallel_rank: int = 0
    data_parallel_address: str | None = None
    """Where rank 0's engine listens for the other ranks (its node's IP); set when the group starts."""
    data_parallel_rpc_port: int | None = None

    @property
    def world_size(self) -> int:
        """Ranks of one engine (one DP rank)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def wide_ep(self) -> bool:
        return self.data_parallel_size > 1

    @property
    def eplb(self) -> bool:
        """vLLM's expert-parallel load balancer runs in this group's engines (``enable_eplb``)."""
        return bool(self.engine_args.get("enable_eplb"))


def unknown_engine_args(engine_args: dict[str, Any]) -> list[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return sorted(set(engine_args) - known)


def running_on_flotilla_cpu() -> bool:
    from vllm.platforms import current_platform

    from flotilla.cluster.vllm_platform_cpu import CpuRayPlatform

    return isinstance(current_platform, CpuRayPlatform)


def kv_events_config(host: str, port: int, replay_port: int) -> dict[str, Any]:
    """vLLM's ZMQ KV-event publisher, with a replay socket for late subscribers.

    vLLM's publisher binds only wildcard endpoints (any other address it *connects* to), so the
    event socket binds every interface; subscribers reach it at ``tcp://{host}:{port}``.
    """
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://{host}:{replay_port}",
        "topic": KV_EVENTS_TOPIC,
    }


KV_EVENTS_TOPIC = "kv"


def cpu_compilation_config(pipeline_parallel_size: int, data_parallel_size: int) -> dict[str, Any]:
    """The model runs eagerly on CPU; the warm-up runs only where PP's buffers or DP's ranks need it. The
    benchmarks give vLLM's own servers the same, from here."""
    if pipeline_parallel_size > 1 or data_parallel_size > 1:
        return dict(CPU_COMPILATION_CONFIG)
    return dict(CPU_EAGER_COMPILATION_CONFIG)


def engine_kwargs(spec: EngineSpec, on_cpu: bool, kv_events: dict[str, Any] | None = None) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments: Flotilla's defaults under the user's engine_args."""
    defaults: dict[str, Any] = {"enable_prefix_caching": True, "disable_log_stats": False}
    if kv_events is not None:
        defaults["kv_events_config"] = kv_events
    fixed = {}
    if spec.wide_ep:
        defaults["enable_expert_parallel"] = True
        fixed = {
            "data_parallel_size": spec.data_parallel_size,
            "data_parallel_rank": spec.data_parallel_rank,
            "data_parallel_address": spec.data_parallel_address,
            "data_parallel_rpc_port": spec.data_parallel_rpc_port,
        }
    if on_cpu:
        defaults |= {
            "dtype": "float32",
            "kv_cache_memory_bytes": spec.cpu_kv_cache_memory_bytes,
            "enforce_eager": False,
            "compilation_config": cpu_compilation_config(spec.pipeline_parallel_size, spec.data_parallel_size),
        }
    user_args = spec.engine_args
    if on_cpu:
        from flotilla.cluster.vllm_cpu_eplb import engine_args_for_cpu

        user_args = engine_args_for_cpu(user_args)
    return (
        defaults
        | user_args
        | {
            "model": spec.model,
            "served_model_name": spec.served_model_name,
            "tensor_parallel_size": spec.tensor_parallel_size,
            "pipeline_parallel_size": spec.pipeline_parallel_size,
            "distributed_executor_backend": vllm_executor_backend(spec),
            "worker_extension_cls": RANK_PROBE,
        }
        | fixed
    )


def vllm_executor_backend(spec: EngineSpec) -> str:
    """vLLM's name for the spec's executor: one rank under ``mp`` runs inside EngineCore (vLLM's ``uni``)."""
    if spec.executor == "mp" and spec.world_size == 1:
        return "uni"
    return spec.executor


@contextlib.contextmanager
def engine_core_process(vllm_config: Any, spec: EngineSpec, on_cpu: bool) -> Iterator[None]:
    """Around ``AsyncLLM``'s construction: on CPU, a group of one rank runs that rank inside EngineCore.

    vLLM's CPU platform turns its single-rank executor (``uni``: the model in the EngineCore process, as on
    GPUs) into ``mp``, a worker process of its own, because the server that spawns EngineCore cannot give it
    the rank's OpenMP environment. EngineCore then busy-waits on that worker at every step, on the core the
    leader, the ingress and the client share (0.66 of a core under load, ``bench/cpu_breakdown.py``). A leader
    spawns its EngineCore itself, so it sets the rank's OpenMP threads and cores for that spawn, with vLLM's
    own ``OMPProcessManager`` (what vLLM's executor sets for its worker), and keeps ``uni``. Measured side by
    side: docs/benchmarks.md (``serve_overhead``).
    """
    if not (on_cpu and spec.cpu_rank_in_engine_core and vllm_executor_backend(spec) == "uni"):
        yield
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    vllm_config.parallel_config.distributed_executor_backend = "uni"
    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield


def default_worker_threads(node_cpus: float, node_workers: float) -> int:
    """OpenMP threads per CPU worker when the config sets none: the node's cores less one per worker
    (the leader, the ingress and, with more than one rank, EngineCore's scheduler loop), shared among them.

    vLLM's own CPU executor reserves the same (one core per local rank). Without the reserve, a
    worker's threads outnumber the free cores, and a parallel region waits for a thread the OS
    parked behind the scheduler loop: measured on 2 cores, one group of tiny-llama with 2 threads
    decoded at 25 tok/s with 198 ms ITL p99, with 1 thread at 71 tok/s and 26 ms.
    """
    workers = max(int(node_workers), 1)
    return max(1, (int(node_cpus) - workers) // workers)


def worker_env(spec: EngineSpec, on_cpu: bool, node_cpus: float, node_slots: float) -> dict[str, str]:
    """Environment for vLLM's worker actors (set at actor creation, before torch is imported)."""
    env = eplb_policy_env(spec)
    if not on_cpu:
        return env
    threads = spec.cpu_threads_per_worker or default_worker_threads(node_cpus, node_slots)
    return env | CPU_ENGINE_ENV | {"OMP_NUM_THREADS": str(threads)}


def eplb_policy_env(spec: EngineSpec) -> dict[str, str]:
    """With EPLB on, vLLM's rebalancer places experts by Flotilla's policy (``eplb.vllm_policy``), CPU or GPU,
    unless the environment already names one."""
    if not spec.eplb or POLICY_SWITCH_ENV in os.environ:
        return {}
    return {POLICY_SWITCH_ENV: POLICY_NAME}


def run_at_normal_priority() -> bool:
    """Undo Ray's worker niceness (15) for this process and the engine processes it spawns.

    Ray starts every worker at nice 15 so that its own daemons win; an engine that yields to every
    other process on its node stalls its decode steps whenever anything else runs (on this 2-core
    machine, vLLM's benchmark client beside it). Lowering niceness needs CAP_SYS_NICE (root in most
    containers); without it the engine keeps Ray's default. Returns whether it runs at nice 0.
    """
    # On Linux a nice value belongs to a thread: reset every thread the process has so far (threads
    # and processes started later inherit it), not only the calling one.
    tasks = Path("/proc/self/task")
    threads = [int(tid) for tid in os.listdir(tasks)] if tasks.is_dir() else [0]
    try:
        for thread in threads:
            os.setpriority(os.PRIO_PROCESS, thread, 0)
    except PermissionError:
        return False
    return True


def settle_after_startup() -> None:
    """What vLLM's processes do once they serve, for a leader or an ingress replica whose start-up is done.

    The start-up heap (vLLM, Ray, the tokenizer: 650k–700k objects) leaves the garbage collector's view, as
    vLLM's API server and EngineCore freeze theirs: a full collection over it paused every stream through the
    process for most of a second. And vLLM's environment settings are read once from here on, as EngineCore
    caches them: uncached, every output re-read ``os.environ`` (3.6 % of a leader's Python under load,
    2026-12-07). The environment must not change after this call; vLLM would not see it.
    """
    from vllm.envs import enable_envs_cache
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    enable_envs_cache()


TITLE_ANCHOR_ENV = "FLOTILLA_ENV_ANCHOR"
"""First variable of the environment the engine's processes inherit (``keep_spawned_titles_settable``)."""


def keep_spawned_titles_settable() -> None:
    """Let the processes this one spawns (EngineCore, vLLM's workers) take the titles vLLM gives them.

    setproctitle finds a process's argv by walking back from its first environment variable. A process that
    changes that variable before vLLM names it (vLLM and torch set several at import) keeps its command line,
    ``python -B -c from multiprocessing.spawn …``, in ``ps`` and ``top``: one group's EngineCore of two, in 7 of
    17 starts of two groups (2026-12-07), as Ray orders a worker's environment differently per start. Here a
    variable nobody changes goes first: Python's ``os.environ`` changes the C environment with setenv and
    unsetenv, so moving every other variable to the end leaves it at the front, which is what a child inherits.
    """
    if next(iter(os.environ), None) == TITLE_ANCHOR_ENV:
        return
    os.environ[TITLE_ANCHOR_ENV] = "1"
    for key in [key for key in os.environ if key != TITLE_ANCHOR_ENV]:
        os.environ[key] = os.environ.pop(key)


def apply_process_env(spec: EngineSpec, on_cpu: bool, node_cpus: float, node_slots: float) -> CoreClaim | None:
    """Environment for the leader process and the EngineCore (and, under ``mp``, worker) processes it spawns.

    Returns the cores claimed for the workers (``cpu_binding``), to be held while the engine runs."""
    keep_spawned_titles_settable()
    os.environ.update(eplb_policy_env(spec))
    if not on_cpu:
        return None
    os.environ.update(CPU_ENGINE_ENV)
    if spec.executor != "mp":
        return None
    env = worker_env(spec, on_cpu, node_cpus, node_slots)
    # vLLM's own binding (``auto``) sees only this engine's ranks and would pin every group to the same
    # cores: Flotilla claims distinct ones where asked. Wide-EP engines (vLLM slices the lists by DP rank)
    # run unpinned.
    claim = None
    if spec.cpu_bind_cores and spec.data_parallel_size == 1:
        claim = claim_cores(spec.world_size, int(env["OMP_NUM_THREADS"]))
        if claim is not None:
            widen_to_machine()  # the engine's processes start from this thread's mask, which must hold the claim
    os.environ.update(env | {"VLLM_CPU_OMP_THREADS_BIND": claim.omp_threads_bind() if claim else UNPINNED})
    return claim
