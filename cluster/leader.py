"""The leader of a replica group: a Ray actor that hosts vLLM's ``AsyncLLM``.

The leader runs in the group's leader bundle. vLLM's EngineCore process, spawned by
``AsyncLLM``, joins the same Ray cluster and its Ray executor creates one worker actor per
rank inside the group's placement group, at the bundles we chose (``VLLM_RAY_BUNDLE_INDICES``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

from flotilla.cluster.contract import (
    EngineErrorKind,
    EngineInfo,
    EnginePhase,
    GroupEngineError,
    InboxHeader,
    LeaderDescription,
    LeaderHealth,
    LoadReport,
    RankProcess,
    to_wire,
)
from flotilla.cluster.cpu_binding import CoreClaim, fence_claimed_cores, fence_cores
from flotilla.cluster.engine import (
    EngineSpec,
    apply_process_env,
    engine_core_process,
    engine_kwargs,
    kv_events_config,
    run_at_normal_priority,
    running_on_flotilla_cpu,
    settle_after_startup,
    worker_env,
)
from flotilla.cluster.output_channel import OutputChannel
from flotilla.cluster.ports import free_ports
from flotilla.cluster.rank_probe import RankProbe
from flotilla.cluster.request_inbox import RequestInbox

logger = logging.getLogger(__name__)


class GroupLeader:
    def __init__(
        self, group_name: str, spec: EngineSpec, placement_group: Any, bundle_indices: str, generation: int = 0
    ) -> None:
        self.group_name = group_name
        self.generation = generation
        self.spec = spec
        self.placement_group = placement_group
        self.bundle_indices = bundle_indices
        self.phase = EnginePhase.STARTING_ENGINE
        self.error: str | None = None
        self.engine: Any = None
        self.info: EngineInfo | None = None
        self.vllm_instance_id: str | None = None
        self._channels: dict[str, OutputChannel] = {}
        self._scheduler_stats = SchedulerStatsRecorder()
        self._ranks: list[tuple[str, Any]] = []
        self._core_claim: CoreClaim | None = None
        self._inbox: RequestInbox | None = None

    def describe(self) -> LeaderDescription:
        return LeaderDescription(
            group_name=self.group_name,
            phase=self.phase,
            error=self.error,
            tensor_parallel_size=self.spec.tensor_parallel_size,
            pipeline_parallel_size=self.spec.pipeline_parallel_size,
            rank_bundles=[int(b) for b in self.bundle_indices.split(",")],
            vllm_instance_id=self.vllm_instance_id,
            info=self.info,
            generation=self.generation,
            executor=self.spec.executor,
            rank_processes=self._rank_processes() if self.spec.executor == "mp" else [],
        )

    def _rank_processes(self) -> list[RankProcess]:
        return [RankProcess(name, process.pid, _process_state(process)) for name, process in self._ranks]

    async def _ask_ranks(self) -> list[tuple[str, Any]]:
        """The ``mp`` executor's rank processes, in rank order, as each rank reports itself (see ``rank_probe``)."""
        import psutil

        ranks = []
        for pid, title in await self.engine.collective_rpc(RankProbe.flotilla_rank_process.__name__):
            ranks.append((title, psutil.Process(pid)))
        return ranks

    async def _fence_claimed_cores(self) -> None:
        """The workers are pinned now: everything else of Ray's on this machine leaves their cores (``cpu_binding``)."""
        assert self._core_claim is not None
        self._core_claim.record_workers([process.pid for _, process in self._ranks])
        moved = await asyncio.to_thread(fence_claimed_cores)
        io_cores = sorted(await asyncio.to_thread(fence_cores))
        freed = await self.engine.collective_rpc(RankProbe.flotilla_move_io_threads.__name__, args=(io_cores,))
        logger.info(
            "group %s: workers pinned to cores %s; %d other threads moved off them, and %d of the ranks' I/O threads",
            self.group_name,
            self._core_claim.omp_threads_bind(),
            moved,
            sum(freed),
        )

    def data_parallel_master(self) -> tuple[str, int]:
        """Wide EP, DP rank 0: this node's address and a free port where its engine will meet the other ranks."""
        import ray

        return ray.util.get_node_ip_address(), free_ports(1)[0]

    async def start(self, data_parallel_master: tuple[str, int] | None = None) -> EngineInfo:
        if data_parallel_master is not None:
            address, port = data_parallel_master
            self.spec = dataclasses.replace(self.spec, data_parallel_address=address, data_parallel_rpc_port=port)
        self.phase = EnginePhase.STARTING_ENGINE
        try:
            # AsyncLLM's constructor blocks until every worker is up; a thread keeps this
            # actor answering describe() meanwhile.
            self.info = await asyncio.to_thread(self._build_engine)
        except Exception as err:
            self.phase, self.error = EnginePhase.FAILED, f"{type(err).__name__}: {err}"
            raise
        # A graceful stop (Ctrl-C, a drained restart) waits for the EngineCore to exit: 2 s less of it.
        await self.engine.collective_rpc(RankProbe.flotilla_skip_collection_at_exit.__name__)
        if self.spec.executor == "mp":
            # Kept for the engine's life: a rank that dies is listed DEAD (then the group restarts).
            self._ranks = await self._ask_ranks()
        if self._core_claim is not None:
            await self._fence_claimed_cores()
        import ray

        self._inbox = RequestInbox(ray.util.get_node_ip_address(), self._accept, self.abort)
        self.info = dataclasses.replace(self.info, inbox_endpoint=self._inbox.endpoint)
        settle_after_startup()
        self.phase = EnginePhase.READY
        return self.info

    def _build_engine(self) -> EngineInfo:
        import ray
        from ray.runtime_env import RuntimeEnv
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        run_at_normal_priority()  # on a cluster Flotilla did not start, Ray's workers run at nice 15
        on_cpu = running_on_flotilla_cpu()
        node_resources = _node_resources(ray.get_runtime_context().get_node_id())
        node_cpus, node_slots = node_resources.get("CPU", 1), node_resources.get("GPU", 1)
        self._core_claim = apply_process_env(self.spec, on_cpu, node_cpus, node_slots)  # held for the engine's life
        on_ray = self.spec.executor == "ray"
        if on_ray:
            # The spawned EngineCore must join this cluster, not start its own.
            os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = self.bundle_indices

        host = ray.util.get_node_ip_address()
        events = None
        if self.spec.kv_events:
            # Not OS-assigned ports: another socket could take one before the engine binds it.
            port, replay_port = free_ports(2)
            # vLLM adds the DP rank to both ports (one publisher per rank on a shared node); undo it here.
            rank = self.spec.data_parallel_rank
            events = kv_events_config(host, port - rank, replay_port - rank)
        args = AsyncEngineArgs(**engine_kwargs(self.spec, on_cpu, events))
        vllm_config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        if on_ray:
            vllm_config.parallel_config.placement_group = self.placement_group
            env = worker_env(self.spec, on_cpu, node_cpus, node_slots)
            if env:
                vllm_config.parallel_config.ray_runtime_env = RuntimeEnv(env_vars=env)
        self.vllm_instance_id = vllm_config.instance_id
        with engine_core_process(vllm_config, self.spec, on_cpu):
            self.engine = AsyncLLM.from_vllm_config(
                vllm_config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                stat_loggers=[self._scheduler_stats.logger_factory],
            )
        cache = vllm_config.cache_config
        return EngineInfo(
            max_model_len=vllm_config.model_config.max_model_len,
            block_size=cache.block_size,
            num_kv_blocks=cache.num_gpu_blocks or 0,
            vllm_instance_id=vllm_config.instance_id,
            startup_s=time.monotonic() - started,
            kv_events_endpoint=f"tcp://{host}:{port}" if events else None,
            kv_events_replay_endpoint=f"tcp://{host}:{replay_port}" if events else None,
        )

    def _accept(self, header: InboxHeader, request: Any) -> None:
        """Start a request from the inbox (a ``vllm.v1.engine.EngineCoreRequest``, rendered and validated by the
        ingress); its outputs are pushed, tagged with its key, to the ingress channel the header names."""
        channel = self._channel(header.channel_id, header.address)
        if request is None:
            channel.fail(header.key, EngineErrorKind.INTERNAL, "the request did not decode in the group")
            return
        if self.phase is not EnginePhase.READY:
            channel.fail(header.key, EngineErrorKind.ENGINE_DEAD, f"group {self.group_name} is {self.phase.value}")
            return
        if self.num_unfinished_requests() == 0:
            self._scheduler_stats.progressed()  # an idle engine has made no progress for good reason
        channel.requests[header.key] = asyncio.create_task(self._run(channel, header.key, request))

    async def attach(self, channel_id: str, address: str) -> None:
        """Held open by an ingress for its channel's life; it fails only if this actor dies.

        Cancelling the call (the ingress closing its channel) aborts the channel's requests.
        """
        channel = self._channel(channel_id, address)
        try:
            await channel.closed()
        finally:
            if self._channels.get(channel_id) is channel:  # not a newer channel of the same id
                del self._channels[channel_id]
            channel.close()

    def abort(self, key: str) -> None:
        for channel in self._channels.values():
            task = channel.requests.get(key)
            if task is not None:
                task.cancel()  # AsyncLLM.generate aborts the engine request when cancelled

    def _channel(self, channel_id: str, address: str) -> OutputChannel:
        channel = self._channels.get(channel_id)
        if channel is None or channel.stopped:  # a stopped one would drop this request's outputs
            if channel is not None:
                channel.close()
            channel = self._channels[channel_id] = OutputChannel(channel_id, address)
        return channel

    async def _run(self, channel: OutputChannel, key: str, request: Any) -> None:
        """Stream one request's outputs to its channel; every way it can end sends the ingress a last item."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        finished = False
        try:
            # An EngineCoreRequest skips AsyncLLM's input processing: the ingress already did it.
            async for output in self.engine.generate(request, request.params, request.request_id):
                finished = output.finished
                channel.put(to_wire(key, output, request.prompt_token_ids))
            if not finished:
                raise GroupEngineError(EngineErrorKind.INTERNAL, "the engine ended the request without finishing it")
        except EngineDeadError as err:
            self.phase, self.error = EnginePhase.FAILED, str(err)
            channel.fail(key, EngineErrorKind.ENGINE_DEAD, str(err))
        except (VLLMClientError, ValueError) as err:
            channel.fail(key, EngineErrorKind.BAD_REQUEST, str(err))
        except GroupEngineError as err:
            channel.fail(key, err.kind, err.message)
        except asyncio.CancelledError:  # aborted; the ingress may still be waiting if the abort came from elsewhere
            channel.fail(key, EngineErrorKind.INTERNAL, "the request was aborted in the group")
            raise
        except Exception as err:  # anything else still ends the request at the ingress, never a silent hang
            logger.exception("request %s failed in group %s", request.request_id, self.group_name)
            channel.fail(key, EngineErrorKind.INTERNAL, f"{type(err).__name__}: {err}")
        finally:
            channel.requests.pop(key, None)

    async def check_health(self) -> None:
        if self.engine is None:
            raise GroupEngineError(EngineErrorKind.ENGINE_DEAD, f"group {self.group_name} has no engine")
        await self.engine.check_health()

    async def health(self) -> LeaderHealth:
        """Engine liveness (vLLM marks it dead when a worker dies) and progress (a frozen rank stalls it)."""
        error = None
        if self.engine is None or self.phase is not EnginePhase.READY:
            error = self.error or f"group {self.group_name} is {self.phase.value}"
        else:
            try:
                await self.engine.check_health()
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
            # vLLM's mp executor notices a dead worker only once a collective times out; the process table
            # tells at once (under the Ray executor the coordinator asks Ray's state API instead).
            dead = [f"{name} (pid {process.pid})" for name, process in self._ranks if _process_state(process) == "DEAD"]
            if error is None and dead:
                error = f"worker process(es) dead: {', '.join(dead)}"
        return LeaderHealth(
            engine_alive=error is None,
            error=error,
            unfinished_requests=self.num_unfinished_requests(),
            seconds_since_progress=time.monotonic() - self._scheduler_stats.progress_at,
        )

    def load(self) -> LoadReport:
        stats = self._scheduler_stats.latest
        return LoadReport(
            running=stats.num_running_reqs if stats else 0,
            waiting=stats.num_waiting_reqs if stats else 0,
            kv_usage=stats.kv_cache_usage if stats else 0.0,
            vllm_instance_id=self.vllm_instance_id if self.phase is EnginePhase.READY else None,
        )

    async def watch_load(self, known: LoadReport | None, timeout_s: float) -> LoadReport:
        """The load once it differs from ``known``, or after ``timeout_s`` as it is: a long poll.

        Each ingress replica follows every group's load. Polled, an idle group answered the same
        report five times a second per replica; watched, it answers once a step changes the load.
        """
        deadline = time.monotonic() + timeout_s
        while (report := self.load()) == known and (left := deadline - time.monotonic()) > 0:
            await self._scheduler_stats.load_change(left)
        return report

    async def eplb_snapshot(self) -> list[dict[str, Any] | None]:
        """Every rank's view of vLLM's EPLB state (``RankProbe.flotilla_eplb_snapshot``); empty without EPLB."""
        if self.engine is None or self.phase is not EnginePhase.READY or not self.spec.eplb:
            return []
        return list(await self.engine.collective_rpc(RankProbe.flotilla_eplb_snapshot.__name__))

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (benchmarks start each arm cold); False if requests hold blocks."""
        if self.engine is None:
            return False
        return bool(await self.engine.reset_prefix_cache())

    def engine_metrics(self) -> bytes:
        """vLLM's own Prometheus metrics of this engine (``vllm:*``), in text exposition format."""
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(REGISTRY)

    def num_unfinished_requests(self) -> int:
        return 0 if self.engine is None else self.engine.output_processor.get_num_unfinished_requests()

    def shutdown(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._core_claim is not None:
            self._core_claim.release()
        self.phase = EnginePhase.STOPPED


class SchedulerStatsRecorder:
    """Keeps the engine's latest scheduler stats; registered as a vLLM stat logger."""

    def __init__(self) -> None:
        self.latest: Any = None
        self.progress_at = time.monotonic()
        self._load_changed: asyncio.Event | None = None

    def progressed(self) -> None:
        self.progress_at = time.monotonic()

    def recorded(self, scheduler_stats: Any) -> None:
        previous, self.latest = self.latest, scheduler_stats
        if self._load_changed is not None and (previous is None or _load_of(previous) != _load_of(scheduler_stats)):
            self._load_changed.set()
            self._load_changed = None

    async def load_change(self, timeout_s: float) -> None:
        """Returns once a step changes the engine's load (``_load_of``), or after ``timeout_s``."""
        if self._load_changed is None:
            self._load_changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._load_changed.wait(), timeout_s)
        except TimeoutError:
            pass

    def logger_factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
            ) -> None:
                recorder.progressed()
                if scheduler_stats is not None:
                    recorder.recorded(scheduler_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)


def _load_of(stats: Any) -> tuple[int, int, float]:
    return stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage


def _process_state(process: Any) -> str:
    """Ray's actor vocabulary for a process: ALIVE while it runs (or sleeps, or is stopped), else DEAD."""
    import psutil

    try:
        return "DEAD" if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else "ALIVE"
    except psutil.Error:
        return "DEAD"


def _node_resources(node_id: str) -> dict[str, float]:
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return dict(node["Resources"])
    return {}
