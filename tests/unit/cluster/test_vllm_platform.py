from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from flotilla.cluster import vllm_platform


def test_entry_point_is_registered_for_vllm() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.platform_plugins")}
    assert plugins.get("flotilla_cpu_ray") == "flotilla.cluster.vllm_platform:register"


def test_active_on_a_cpu_only_machine() -> None:
    assert vllm_platform.register() == vllm_platform.PLATFORM_QUALNAME


def test_switch_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv(vllm_platform.PLUGIN_SWITCH_ENV, "0")
    assert vllm_platform.register() is None


@pytest.mark.parametrize("accelerator", ["cuda", "rocm", "xpu", "tpu"])
def test_steps_aside_when_a_real_accelerator_is_present(monkeypatch, accelerator: str) -> None:
    from vllm.platforms import builtin_platform_plugins

    monkeypatch.setitem(builtin_platform_plugins, accelerator, lambda: f"vllm.platforms.{accelerator}.Platform")
    assert vllm_platform.register() is None


def test_platform_class_places_workers_on_gpu_slots() -> None:
    from vllm.platforms.cpu import CpuPlatform

    from flotilla.cluster.vllm_platform_cpu import CpuRayPlatform

    assert issubclass(CpuRayPlatform, CpuPlatform)
    assert CpuRayPlatform.ray_device_key == "GPU"
