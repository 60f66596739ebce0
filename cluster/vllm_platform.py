"""vLLM platform plugin that lets vLLM's Ray executor run on CPU.

vLLM's CPU platform declares no Ray device key, so ``distributed_executor_backend="ray"``
refuses to start on CPU. This plugin swaps in a ``CpuPlatform`` subclass whose Ray
device key is ``"GPU"``: every vLLM worker actor then asks Ray for one "GPU", and
Flotilla's local CPU clusters declare one fake GPU slot per worker.

The plugin is registered through the ``vllm.platform_plugins`` entry point, so vLLM
resolves it in every process, Ray worker actors included. It switches itself off when
any real accelerator platform (CUDA, ROCm, XPU, TPU) is detected, so the same package
runs unchanged on GPU nodes, and when ``FLOTILLA_CPU_RAY_PLUGIN=0``.

This module must stay import-light: vLLM calls ``register`` in every process.
"""

from __future__ import annotations

import os

PLUGIN_SWITCH_ENV = "FLOTILLA_CPU_RAY_PLUGIN"
PLATFORM_QUALNAME = "flotilla.cluster.vllm_platform_cpu.CpuRayPlatform"
_ACCELERATOR_PLUGINS = ("tpu", "cuda", "rocm", "xpu")


def register() -> str | None:
    """Entry point for ``vllm.platform_plugins``: our platform's qualname, or None."""
    if os.environ.get(PLUGIN_SWITCH_ENV, "1") == "0":
        return None
    from vllm.platforms import builtin_platform_plugins

    for name in _ACCELERATOR_PLUGINS:
        if _detects(builtin_platform_plugins[name]):
            return None
    if builtin_platform_plugins["cpu"]() != "vllm.platforms.cpu.CpuPlatform":
        return None
    return PLATFORM_QUALNAME


def _detects(plugin: object) -> bool:
    try:
        return callable(plugin) and plugin() is not None
    except Exception:
        return False
