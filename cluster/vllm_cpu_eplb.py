"""vLLM's own EPLB on its CPU build: the four gaps the platform plugin fills, CPU only.

vLLM 0.32 rebalances experts in the engine (``EplbState``: record each expert's load, every
``step_interval`` steps run the policy and move weights between EP ranks, here over gloo). On CPU
it is refused, and would not run if it were not:

1. ``ParallelConfig`` rejects ``enable_eplb`` unless the platform is CUDA, ROCm or XPU, before any
   platform hook runs. Flotilla hands the request over in ``additional_config`` instead
   (:func:`engine_args_for_cpu`) and the platform turns EPLB on in ``check_and_update_config``
   (:func:`enable_in_config`), synchronous (async EPLB needs device streams), gloo communicator.
2. The router maps logical to physical experts and records their load in a Triton kernel; without
   Triton vLLM's fallback does neither (every token goes to the first replica, no load is seen).
   :func:`map_and_record` is the same computation in torch.
3. The CPU model runner's ``load_model`` never builds the ``EplbState`` the GPU runner builds.
4. ``EplbState.rearrange`` times itself with device events, and its gloo communicator waits on the
   accelerator's current stream: CPU torch has neither (host stand-ins while it runs).

Everything else (load window, policy, weight transfer, map updates, lockstep across DP ranks) is
vLLM's own code, so one EPLB path serves CPU and GPU. On a GPU the plugin steps aside and none of
this is imported. Written here because no released vLLM runs EPLB on CPU (0.32).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from flotilla.cluster.rank_probe import LAST_REARRANGE_ATTRIBUTE

ADDITIONAL_CONFIG_KEY = "flotilla_cpu_eplb"
KNUTH_MULTIPLIER = 2654435769  # vLLM's kernel spreads a token's choice over an expert's replicas with this hash
_PATCHED = "_flotilla_cpu_eplb"


# --- 1. the config ------------------------------------------------------------------------------


def engine_args_for_cpu(engine_args: dict[str, Any]) -> dict[str, Any]:
    """``enable_eplb`` and ``eplb_config`` moved into ``additional_config``, where vLLM's CPU config
    check does not see them and the platform plugin does."""
    if not engine_args.get("enable_eplb"):
        return engine_args
    args = dict(engine_args)
    del args["enable_eplb"]
    eplb = args.pop("eplb_config", None) or {}
    args["additional_config"] = dict(args.get("additional_config") or {}) | {ADDITIONAL_CONFIG_KEY: dict(eplb)}
    return args


def enable_in_config(vllm_config: Any) -> None:
    """Turn vLLM's EPLB on as the engine arguments asked (see :func:`engine_args_for_cpu`)."""
    from vllm.config.parallel import EPLBConfig

    settings = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if settings is None:
        return
    parallel = vllm_config.parallel_config
    if not parallel.enable_expert_parallel:
        raise ValueError("enable_expert_parallel must be True to use EPLB")
    parallel.eplb_config = EPLBConfig(**(dict(settings) | {"use_async": False, "communicator": "torch_gloo"}))
    parallel.enable_eplb = True


# --- 2. the router's logical → physical map and load record ---------------------------------------


def map_and_record(
    topk_ids: torch.Tensor,
    expert_load_view: torch.Tensor,
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's ``eplb_map_to_physical_and_record`` kernel in torch: each (token, choice) of a logical
    expert goes to one of its replicas (hashed on the token's index), and when recording is on every
    real token's choice adds one to its physical expert's load."""
    tokens, choices = topk_ids.shape[0], topk_ids.shape[-1]
    logical = topk_ids.reshape(-1).long()
    valid = (logical >= 0) & (logical < logical_replica_count.shape[0])
    safe = torch.where(valid, logical, torch.zeros_like(logical))
    replicas = logical_replica_count[safe].long().clamp_min(1)
    token_index = torch.arange(logical.numel(), device=logical.device) // choices
    replica = ((token_index * KNUTH_MULTIPLIER) & 0xFFFFFFFF) % replicas
    physical = logical_to_physical_map[safe, replica].long()
    physical = torch.where(valid, physical, torch.full_like(physical, -1))
    if bool(record_enabled):
        real = torch.ones_like(valid)
        if num_unpadded_tokens is not None:
            real = token_index < int(num_unpadded_tokens)
        counted = physical[real & (physical >= 0) & (physical < expert_load_view.shape[0])]
        expert_load_view.index_add_(0, counted, torch.ones_like(counted, dtype=expert_load_view.dtype))
    return physical.to(topk_ids.dtype).reshape(tokens, *topk_ids.shape[1:])


# --- 3 and 4: the model runner and the rearrangement timer -----------------------------------------


class _HostEvent:
    """``torch.Event`` for code that times itself with device events: wall-clock time on the host."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.at = 0.0

    def record(self, *args: Any, **kwargs: Any) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as torch's events


class _HostStream:
    """The accelerator's current stream, where the host is the device: every copy is already done."""

    def synchronize(self) -> None:
        pass


@contextmanager
def _host_device_stand_ins() -> Iterator[None]:
    device_event, current_stream = torch.Event, torch.accelerator.current_stream
    torch.Event = _HostEvent  # type: ignore[misc,assignment]
    torch.accelerator.current_stream = lambda *args, **kwargs: _HostStream()  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Event = device_event  # type: ignore[misc]
        torch.accelerator.current_stream = current_stream


def patch_cpu_eplb() -> None:
    """Pieces 2-4 in this (worker) process; idempotent, and inert unless the engine enables EPLB."""
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.model_executor.layers.fused_moe.router import base_router
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner.load_model, _PATCHED, False):
        return
    base_router.eplb_map_to_physical_and_record = map_and_record  # type: ignore[assignment]

    load_model = CPUModelRunner.load_model
    rearrange = EplbState.rearrange

    def load_model_with_eplb(self: Any, *args: Any, **kwargs: Any) -> None:
        load_model(self, *args, **kwargs)
        if not self.parallel_config.enable_eplb:
            return
        from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

        self._moe_model = get_mixture_of_experts_model(self.model)  # as the GPU runner's load_model sets them
        if self._moe_model is None:
            raise ValueError("EPLB is enabled but the model has no mixture-of-experts layers")
        self.eplb_state = EplbState(self.parallel_config, self.device)
        self.eplb_state.add_model(self._moe_model, self.model_config)

    def rearrange_on_host(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        with _host_device_stand_ins():
            result = rearrange(self, *args, **kwargs)
        if not kwargs.get("is_profile", False):
            setattr(self, LAST_REARRANGE_ATTRIBUTE, time.perf_counter() - started)
        return result

    setattr(load_model_with_eplb, _PATCHED, True)
    CPUModelRunner.load_model = load_model_with_eplb  # type: ignore[method-assign]
    EplbState.rearrange = rearrange_on_host  # type: ignore[method-assign]
