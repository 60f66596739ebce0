"""The CPU platform class that ``cluster.vllm_platform.register`` activates.

Kept apart from the registration module so that the entry point can run without
importing vLLM's platform classes.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform


class CpuRayPlatform(CpuPlatform):
    """vLLM's CPU platform, with Ray workers placed on fake "GPU" slots.

    ``get_accelerator_ids()`` only knows Ray's built-in accelerator names, so the key
    has to be ``"GPU"``; ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` stops Ray from
    exporting a ``CUDA_VISIBLE_DEVICES`` that would mean nothing on CPU.
    """

    ray_device_key: str = "GPU"
    ray_noset_device_env_vars: list[str] = ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]
