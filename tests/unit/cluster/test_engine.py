"""How Flotilla configures a group's vLLM engine on CPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.cluster.engine import default_worker_threads


@pytest.mark.parametrize(
    ("cpus", "workers", "threads"),
    [(2, 1, 1), (2, 2, 1), (8, 1, 7), (8, 2, 3), (16, 4, 3), (1, 1, 1)],
)
def test_cpu_workers_leave_a_core_each_to_their_engine_loop(cpus: int, workers: int, threads: int) -> None:
    assert default_worker_threads(cpus, workers) == threads


def test_engine_processes_leave_rays_worker_niceness_when_allowed() -> None:
    """In a child process at nice 5 with a second thread, as Ray starts workers at 15 (this one stays as it is)."""
    script = (
        "import os, threading; from flotilla.cluster.engine import run_at_normal_priority; os.nice(5); "
        "done = threading.Event(); other = threading.Thread(target=done.wait); other.start(); "
        "lowered = run_at_normal_priority(); "
        "print(lowered, os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, other.native_id)); "
        "done.set()"
    )
    lowered, priority, other_thread = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(priority) == int(other_thread) == (0 if lowered == "True" else 5)  # every thread, not the caller's
    if os.geteuid() == 0:
        assert lowered == "True"


def test_a_started_process_settles_as_vllm_does_heap_frozen_and_environment_read_once() -> None:
    """In a child process: enabling vLLM's environment cache here would hide other tests' environment changes."""
    script = (
        "import gc, os; import vllm.envs as envs; from flotilla.cluster.engine import settle_after_startup; "
        "settle_after_startup(); os.environ['VLLM_COMPUTE_NANS_IN_LOGITS'] = '1'; "
        "print(gc.get_freeze_count() > 0, envs.VLLM_COMPUTE_NANS_IN_LOGITS)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_COMPUTE_NANS_IN_LOGITS", "VLLM_RAISE_ON_LOGIT_NANS")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    frozen, nans_checked = result.stdout.split()[-2:]
    assert frozen == "True"
    assert nans_checked == "False"  # read once, before the change: as EngineCore does once started


SPAWN_AND_TITLE = """
import multiprocessing, os

def engine_core():
    for key in list(os.environ):  # as imports in the child may: every inherited variable changed but ours
        if key != "FLOTILLA_ENV_ANCHOR":
            os.environ[key] = os.environ[key] + ":"
    import setproctitle

    setproctitle.setproctitle("VLLM::EngineCore")  # as vLLM names it
    print(open("/proc/self/comm").read().strip(), flush=True)

if __name__ == "__main__":
    from flotilla.cluster.engine import keep_spawned_titles_settable

    keep_spawned_titles_settable()
    child = multiprocessing.get_context("spawn").Process(target=engine_core)
    child.start()
    child.join()
"""


def test_a_spawned_engine_process_takes_its_title_whatever_it_changes_in_its_environment(tmp_path: Path) -> None:
    """setproctitle finds argv from the first environment variable: a child that changed it kept its command line."""
    script = tmp_path / "spawn_and_title.py"
    script.write_text(SPAWN_AND_TITLE)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.split() == ["VLLM::EngineCor"]  # the kernel keeps 15 characters of a name


def test_a_dp_rank_of_a_wide_ep_group_is_an_external_lb_rank_with_expert_parallelism() -> None:
    from flotilla.cluster.engine import EngineSpec, engine_kwargs

    spec = EngineSpec("m", "m", 2, 1, executor="mp", data_parallel_size=2, data_parallel_rank=1)
    spec = dataclasses.replace(spec, data_parallel_address="10.0.0.1", data_parallel_rpc_port=23456)
    kwargs = engine_kwargs(spec, on_cpu=True)
    assert {k: kwargs[k] for k in kwargs if k.startswith("data_parallel")} == {
        "data_parallel_size": 2,
        "data_parallel_rank": 1,
        "data_parallel_address": "10.0.0.1",
        "data_parallel_rpc_port": 23456,
    }
    assert kwargs["enable_expert_parallel"] and kwargs["tensor_parallel_size"] == 2
    plain = engine_kwargs(dataclasses.replace(spec, data_parallel_size=1), on_cpu=True)
    assert not any(k.startswith("data_parallel") or k == "enable_expert_parallel" for k in plain)


def test_eplb_goes_to_the_cpu_platform_through_additional_config_and_uses_flotillas_policy(monkeypatch) -> None:
    from flotilla.cluster.engine import EngineSpec, engine_kwargs, worker_env
    from flotilla.cluster.vllm_cpu_eplb import ADDITIONAL_CONFIG_KEY

    monkeypatch.delenv("FLOTILLA_EPLB_POLICY", raising=False)
    eplb = {"enable_eplb": True, "eplb_config": {"step_interval": 64}}
    spec = EngineSpec("m", "m", 1, 1, engine_args=eplb, executor="mp", data_parallel_size=2)
    on_cpu = engine_kwargs(spec, on_cpu=True)
    assert "enable_eplb" not in on_cpu and on_cpu["additional_config"] == {ADDITIONAL_CONFIG_KEY: {"step_interval": 64}}
    on_gpu = engine_kwargs(spec, on_cpu=False)
    assert on_gpu["enable_eplb"] and on_gpu["eplb_config"] == {"step_interval": 64}
    assert worker_env(spec, on_cpu=False, node_cpus=8, node_slots=8) == {"FLOTILLA_EPLB_POLICY": "flotilla"}
    assert "FLOTILLA_EPLB_POLICY" not in worker_env(dataclasses.replace(spec, engine_args={}), True, 8, 8)
    monkeypatch.setenv("FLOTILLA_EPLB_POLICY", "default")  # an operator's choice stands
    assert worker_env(spec, on_cpu=False, node_cpus=8, node_slots=8) == {}


def engine_core_launch(model: Path, spec_kwargs: str) -> dict:
    """In a child process (vLLM's CPU platform rewrites its environment): the executor vLLM's config names, and
    the one and the OpenMP environment EngineCore is spawned with, for a group of ``EngineSpec(model, …)``."""
    script = f"""
import json, os
from vllm.engine.arg_utils import AsyncEngineArgs
from flotilla.cluster.engine import EngineSpec, engine_core_process, engine_kwargs
spec = EngineSpec({str(model)!r}, "m", {spec_kwargs})
config = AsyncEngineArgs(**engine_kwargs(spec, on_cpu=True)).create_engine_config()
configured = config.parallel_config.distributed_executor_backend
omp = lambda: {{k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))}}
outside = omp()
with engine_core_process(config, spec, on_cpu=True):
    spawned = {{"executor": config.parallel_config.distributed_executor_backend, "omp": omp()}}
mode = int(config.compilation_config.mode)
print(json.dumps({{"configured": configured, "spawned": spawned, "restored": omp() == outside, "mode": mode}}))
"""
    # A claim of core 1 and one thread, as ``apply_process_env`` sets them for a pinned group.
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_one_rank_runs_inside_engine_core_with_the_ranks_cores(tiny_llama: Path) -> None:
    launch = engine_core_launch(tiny_llama, "1, 1, executor='mp'")
    assert launch["configured"] == "mp"  # vLLM's CPU platform: the rank in a worker process of its own
    assert launch["spawned"]["executor"] == "uni"
    omp = launch["spawned"]["omp"]
    assert omp["OMP_NUM_THREADS"] == "1"
    assert omp.get("GOMP_CPU_AFFINITY") == "1" or (omp.get("OMP_PLACES"), omp.get("OMP_PROC_BIND")) == ("{1}", "true")
    assert launch["restored"]  # the leader's own environment is left as it was
    assert launch["mode"] == 0  # CompilationMode.NONE: vLLM's CPU worker skips the warm-up pass


def test_only_pp_and_wide_ep_groups_pay_for_the_warm_up_pass() -> None:
    """vLLM's CPU worker warms up (one forward pass of max_num_batched_tokens dummy tokens) unless the
    compilation mode is NONE; PP's intermediate buffers and DP's ranks need it, other layouts do not."""
    from flotilla.cluster.engine import EngineSpec, engine_kwargs

    def mode(spec: EngineSpec) -> int:
        return engine_kwargs(spec, on_cpu=True)["compilation_config"]["mode"]

    assert mode(EngineSpec("m", "m", 1, 1)) == 0
    assert mode(EngineSpec("m", "m", 2, 1, executor="mp")) == 0
    assert mode(EngineSpec("m", "m", 1, 2)) == 2
    assert mode(EngineSpec("m", "m", 1, 1, executor="mp", data_parallel_size=2)) == 2
    user_choice = {"compilation_config": {"mode": 2, "backend": "eager"}}  # the trace-once setting of before
    assert mode(EngineSpec("m", "m", 1, 1, engine_args=user_choice)) == 2
    assert "compilation_config" not in engine_kwargs(EngineSpec("m", "m", 1, 1), on_cpu=False)


@pytest.mark.parametrize(
    "spec_kwargs",
    ["1, 1, executor='mp', cpu_rank_in_engine_core=False", "2, 1, executor='mp'", "1, 1, executor='ray'"],
    ids=["switched-off", "two-ranks", "ray-executor"],
)
def test_other_layouts_keep_their_executor(tiny_llama: Path, spec_kwargs: str) -> None:
    launch = engine_core_launch(tiny_llama, spec_kwargs)
    assert launch["spawned"] == {"executor": launch["configured"], "omp": launch["spawned"]["omp"]}
    assert launch["configured"] in ("mp", "ray") and launch["restored"]
