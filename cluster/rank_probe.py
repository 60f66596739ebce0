"""What a vLLM worker process tells its group leader about itself.

vLLM mixes :class:`RankProbe` into every worker (its ``worker_extension_cls`` hook), so the leader
asks the ranks themselves through ``AsyncLLM.collective_rpc`` — one answer per rank, in rank order —
rather than looking for them in its process tree by title: full CI runs now and then found no rank
that way although the engine was serving.
"""

from __future__ import annotations

import os
from typing import Any

RANK_PROBE = f"{__name__}.RankProbe"
LAST_REARRANGE_ATTRIBUTE = "flotilla_last_rearrange_s"
"""Set on vLLM's ``EplbState`` by the CPU plugin's rearrangement wrapper (``vllm_cpu_eplb``): its duration."""


class RankProbe:
    def flotilla_rank_process(self) -> tuple[int, str]:
        """This rank's process id and title (``VLLM::Worker_TP0``; ``VLLM::EngineCore`` for a single rank).

        setproctitle cannot find the process's argv once the process has changed its first environment
        variable before vLLM named it (which one comes first depends on the parent's environment), and
        then reports no title; the name vLLM gave the EngineCore process (a rank that runs inside it,
        ``cpu.rank_in_engine_core``), else the rank's place in its TP and PP groups, names it instead."""
        import multiprocessing

        import setproctitle
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        title = setproctitle.getproctitle()
        process = multiprocessing.current_process().name
        if not title and process.startswith("EngineCore"):
            title = f"VLLM::{process}"
        elif not title:
            tp, pp = get_tp_group(), get_pp_group()
            places = [f"PP{pp.rank_in_group}"] if pp.world_size > 1 else []
            places += [f"TP{tp.rank_in_group}"] if tp.world_size > 1 else []
            title = "_".join(["Worker", *places])
        return os.getpid(), title

    def flotilla_skip_collection_at_exit(self) -> int:
        """This rank's process leaves its heap out of the interpreter's last collection (``atexit``).

        vLLM's shutdown unfreezes the start-up heap and collects it once, to free the device's memory;
        the interpreter's exit then walks the same heap again, for nothing: 2 s of the process's exit on
        2 cores, and its leader waits for the EngineCore to exit. Returns the process id.
        """
        import atexit
        import gc

        atexit.register(gc.freeze)
        return os.getpid()

    def flotilla_move_io_threads(self, cores: list[int]) -> int:
        """This pinned rank's threads that do not run the model move onto ``cores`` (``cpu_binding``)."""
        from flotilla.cluster.cpu_binding import move_io_threads

        return move_io_threads(set(cores))

    def flotilla_eplb_snapshot(self) -> dict[str, Any] | None:
        """vLLM's EPLB state on this rank (None without EPLB): the expert load this rank recorded under the
        current placement (the newest entries of vLLM's window: ``steps_recorded_under_this_placement``), per
        layer and physical slot, and over how many steps; which logical expert each slot holds; and one
        expert's weight bytes in one layer."""
        state = getattr(getattr(self, "model_runner", None), "eplb_state", None)
        if state is None or not state.model_states:
            return None
        model_state = next(iter(state.model_states.values()))
        model = model_state.model
        first_layer = model.expert_weights[0] if model.expert_weights else []
        local_slots = max(model.num_local_physical_experts, 1)
        window = model_state.expert_load_window
        recorded = steps_recorded_under_this_placement(
            int(state.expert_rearrangement_step), int(state.expert_rearrangement_step_interval), int(window.shape[0])
        )
        newest_first = [(int(state.expert_load_window_step) - 1 - i) % window.shape[0] for i in range(recorded)]
        return {
            "ranks": model.num_physical_experts // local_slots,
            "logical_experts": model.num_logical_experts,
            "window_steps": recorded,
            "steps_since_rebalance": int(state.expert_rearrangement_step),
            "load": window[newest_first].sum(dim=0).tolist(),
            "physical_to_logical": model_state.physical_to_logical_map.tolist(),
            "bytes_per_expert": sum(weights[0].numel() * weights.element_size() for weights in first_layer),
            "last_rearrange_s": getattr(state, LAST_REARRANGE_ATTRIBUTE, None),
        }


def steps_recorded_under_this_placement(steps_since_rebalance: int, step_interval: int, window_size: int) -> int:
    """How many of the newest entries of vLLM's EPLB load window were recorded since its last rearrangement.

    vLLM fills its load window (a ring of ``window_size`` steps) only during the last ``window_size`` steps
    before each rearrangement (``EplbState._should_record_current_step``, without ``log_balancedness``):
    right after a rebalance the window still holds the previous placement's load, indexed by the previous
    slot map, and read with the new map it would show the old balance as the new one. An idle DP rank's
    dummy steps count as steps but record nothing, so on such a rank this can count a few stale entries.
    """
    return max(0, min(window_size, steps_since_rebalance - (step_interval - window_size)))
