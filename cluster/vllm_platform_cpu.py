"""The CPU platform class that ``cluster.vllm_platform.register`` activates.

Kept apart from the registration module so that the entry point can run without
importing vLLM's platform classes.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform


class CpuRayPlatform(CpuPlatform):
    """vLLM's CPU platform, with Ray workers placed on fake "GPU" slots.

    ``get_accelerator_ids()`` only knows Ray's built-in accelerator names, so the key
    has to be ``"GPU"``; ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` stops Ray from
    exporting a ``CUDA_VISIBLE_DEVICES`` that would mean nothing on CPU.
    """

    ray_device_key: str = "GPU"
    ray_noset_device_env_vars: list[str] = ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """vLLM's CPU communicator plus the variable-size collectives of wide-EP (``vllm_cpu_ep``).

        Every worker builds its communicators before it loads the model, so this is also where the
        CPU fused-MoE experts learn to honour ``expert_map`` and vLLM's EPLB gets its CPU pieces
        (``vllm_cpu_eplb``; inert unless the engine enables EPLB), and the shared-memory collectives of
        TP and PP stop leaking segments when a rank is killed (``vllm_cpu_shm``).
        """
        from flotilla.cluster.vllm_cpu_ep import patch_cpu_experts
        from flotilla.cluster.vllm_cpu_eplb import patch_cpu_eplb
        from flotilla.cluster.vllm_cpu_shm import patch_cpu_shm

        patch_cpu_experts()
        patch_cpu_eplb()
        patch_cpu_shm()
        return "flotilla.cluster.vllm_cpu_ep.EpCpuCommunicator"

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """vLLM's CPU checks, after turning on the EPLB that vLLM's config check refuses on CPU
        (``vllm_cpu_eplb``: asked for through ``additional_config``)."""
        from flotilla.cluster.vllm_cpu_eplb import enable_in_config

        enable_in_config(vllm_config)
        super().check_and_update_config(vllm_config)
