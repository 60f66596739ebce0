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
        then reports no title; the rank's place in its TP and PP groups names it instead."""
        import setproctitle
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        title = setproctitle.getproctitle()
        if not title:
            tp, pp = get_tp_group(), get_pp_group()
            places = [f"PP{pp.rank_in_group}"] if pp.world_size > 1 else []
            places += [f"TP{tp.rank_in_group}"] if tp.world_size > 1 else []
            title = "_".join(["Worker", *places])
        return os.getpid(), title

    def flotilla_eplb_snapshot(self) -> dict[str, Any] | None:
        """vLLM's EPLB state on this rank (None without EPLB): the expert load this rank recorded over the
        window, per layer and physical slot, which logical expert each slot holds, and one expert's weight
        bytes in one layer."""
        state = getattr(getattr(self, "model_runner", None), "eplb_state", None)
        if state is None or not state.model_states:
            return None
        model_state = next(iter(state.model_states.values()))
        model = model_state.model
        first_layer = model.expert_weights[0] if model.expert_weights else []
        local_slots = max(model.num_local_physical_experts, 1)
        return {
            "ranks": model.num_physical_experts // local_slots,
            "logical_experts": model.num_logical_experts,
            "window_steps": int(model_state.expert_load_window.shape[0]),
            "steps_since_rebalance": int(state.expert_rearrangement_step),
            "load": model_state.expert_load_window.sum(dim=0).tolist(),
            "physical_to_logical": model_state.physical_to_logical_map.tolist(),
            "bytes_per_expert": sum(weights[0].numel() * weights.element_size() for weights in first_layer),
            "last_rearrange_s": getattr(state, LAST_REARRANGE_ATTRIBUTE, None),
        }
