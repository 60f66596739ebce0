"""The CPU shared-memory collectives of TP/PP groups leave no segment behind: vLLM's own
``_CPUSHMDistributed`` and C++ ops over a real 2-process gloo group, patched by ``patch_cpu_shm``."""

from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flotilla.cluster.vllm_cpu_shm import SHM_DIR, patch_cpu_shm, remove_segment, segment_path

WORLD = 2


def import_kernels() -> None:
    """vLLM's C++ ops (``torch.ops._C``, the shared-memory ones among them), the build for this CPU as vLLM
    picks it: ``import vllm._C`` is the AVX512-BF16 build and dies of an illegal instruction elsewhere."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()


def _shm_ranks(rank: int, init_file: str, ident: str, results: dict) -> None:
    import_kernels()
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    os.environ["VLLM_DIST_IDENT"] = ident  # vLLM puts the torch store's port here
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        patch_cpu_shm()
        communicator = SimpleNamespace(
            unique_name="tp:0", ranks=list(range(WORLD)), device_group=None, world_size=WORLD, rank=rank
        )
        shm = _CPUSHMDistributed(communicator)  # type: ignore[arg-type]
        dist.barrier()
        left_by_name = sorted(p.name for p in SHM_DIR.glob(glob.escape(shm.group_name) + "_*"))
        data = torch.full((1024,), float(rank + 1))
        shm.all_reduce(data)  # through the segments, after their names are gone
        results[rank] = (shm.group_name, left_by_name, data[:3].tolist())
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this system")
def test_segments_are_unlinked_once_mapped_and_a_dead_groups_leftover_does_not_block_the_start() -> None:
    import_kernels()
    if not hasattr(torch.ops._C, "init_shm_manager"):
        pytest.skip("vLLM's kernels for this CPU have no shared-memory collectives (its AVX2 build has none)")
    ident = f"flotilla-test-{os.getpid()}"
    group_name = f"{ident}-tp:0-[0-1]-cpushm"
    leftover = segment_path(group_name, 0)
    leftover.write_bytes(b"\0" * 4096)  # what a killed rank 0 of an earlier group on the same port left
    try:
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
            results = manager.dict()
            mp.start_processes(
                _shm_ranks, args=(os.path.join(tmp, "init"), ident, results), nprocs=WORLD, start_method="spawn"
            )
            results = dict(results)
    finally:
        for path in SHM_DIR.glob(glob.escape(group_name) + "_*"):  # whatever a failing run left
            remove_segment(path)
    for rank in range(WORLD):
        name, left_by_name, reduced = results[rank]
        assert name == group_name
        assert left_by_name == []  # nothing a SIGKILL could leak
        assert reduced == [3.0, 3.0, 3.0]  # 1 + 2: the collective works on the unlinked segments
    assert not list(SHM_DIR.glob(glob.escape(group_name) + "_*"))


def test_remove_segment_says_whether_there_was_one(tmp_path: Path) -> None:
    path = segment_path("123-pp:0-[0-1]-cpushm", 1, tmp_path)
    assert path.name == "123-pp:0-[0-1]-cpushm_1"
    assert remove_segment(path) is False
    path.write_bytes(b"x")
    assert remove_segment(path) is True and not path.exists()
