"""vLLM's CPU shared-memory collectives without leaked segments.

For TP and PP groups on one machine, vLLM's CPU communicator moves tensors through POSIX shared
memory: each rank creates ``/dev/shm/<port>-<group>-[<ranks>]-cpushm_<rank>`` (``O_EXCL``), every rank
maps every other's, and the segments are unlinked only by the C++ destructor at a clean exit.
Flotilla's ranks rarely exit cleanly: a gang restart kills the actors, and a SIGKILLed rank is the
fault it recovers from. So every restart leaked the group's segments (4 MB per rank) and their names,
and a later group whose torch-distributed port (the name's first part) came round to a leaked one
failed to start: ``create shm in SHMManager failed. errno: 17`` (EEXIST).

:func:`patch_cpu_shm` wraps the setup, for CPU only (``CpuRayPlatform`` applies it):

* before a rank creates its segment it removes a leftover of the same name. Such a leftover is
  always dead: the name carries the port of this group's torch store, which this group holds bound
  from before the setup until it ends, so no live group can be using the same name;
* once every rank has mapped every segment (the setup ends with a barrier after the join), each rank
  unlinks its own name. The memory stays while any rank maps it and goes when the last one exits,
  however it exits; nothing is ever opened by name again.

Written here because vLLM 0.32 has no such cleanup; the patch leaves the collectives themselves alone.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_PATCHED = "_flotilla_unlinks_segments"


def segment_path(group_name: str, rank: int, shm_dir: Path = SHM_DIR) -> Path:
    """Where ``shm_open`` puts a rank's segment (vLLM's ``SHMManager::get_shm_name``: name + _rank)."""
    return shm_dir / f"{group_name}_{rank}"


def remove_segment(path: Path) -> bool:
    """Unlink ``path`` if it exists; whether it did."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def patch_cpu_shm(shm_dir: Path = SHM_DIR) -> None:
    """Idempotent; a no-op where vLLM has no CPU shared-memory communicator."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm_class: Any = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm_class is None or getattr(shm_class, _PATCHED, False):
        return
    setup = shm_class._init_cpu_shm

    @functools.wraps(setup)
    def setup_without_leaks(self: Any) -> int:
        own = segment_path(self.group_name, self.communicator.rank, shm_dir)
        if remove_segment(own):
            logger.info("removed %s, left by a group that did not exit cleanly", own)
        handle: int = setup(self)
        remove_segment(own)  # every rank has mapped it: the memory lives exactly as long as the mappings
        return handle

    shm_class._init_cpu_shm = setup_without_leaks
    setattr(shm_class, _PATCHED, True)
