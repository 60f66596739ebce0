"""Flotilla's placement as a vLLM EPLB policy, registered by a ``vllm.general_plugins`` entry point.

vLLM picks the policy class with ``EPLB_POLICIES[parallel_config.eplb_config.policy]`` when
an engine with ``--enable-eplb`` starts. That setting is a pydantic ``Literal["default"]``,
and async EPLB (vLLM's default) refuses any other name, so a new name cannot be selected
from the command line. ``register`` therefore always adds ``EPLB_POLICIES["flotilla"]``, and
with ``FLOTILLA_EPLB_POLICY=flotilla`` also makes ``"default"`` resolve to our policy. Off by
default: an unchanged environment keeps vLLM's own behaviour.

vLLM loads general plugins in every process (API server, engine core, workers) before the
engine builds its EPLB state; this module must stay import-light until ``register`` runs.
"""

from __future__ import annotations

import os
from typing import Any

POLICY_NAME = "flotilla"
POLICY_SWITCH_ENV = "FLOTILLA_EPLB_POLICY"


def register() -> None:
    """Entry point for ``vllm.general_plugins``; safe to call more than once."""
    try:
        from vllm.distributed.eplb.policy import EPLB_POLICIES
    except ImportError:  # a vLLM build without EPLB
        return
    policy = flotilla_policy_class()
    EPLB_POLICIES[POLICY_NAME] = policy
    if os.environ.get(POLICY_SWITCH_ENV, "default") == POLICY_NAME:
        EPLB_POLICIES["default"] = policy


def flotilla_policy_class() -> type[Any]:
    """The ``AbstractEplbPolicy`` subclass, built once (vLLM is imported only when asked)."""
    global _POLICY_CLASS
    if _POLICY_CLASS is None:
        _POLICY_CLASS = _build_policy_class()
    return _POLICY_CLASS


_POLICY_CLASS: type[Any] | None = None


def _build_policy_class() -> type[Any]:
    import torch
    from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy

    from flotilla.cluster.eplb.expert_placement import plan_placement

    class FlotillaEplbPolicy(AbstractEplbPolicy):
        """vLLM's ``rebalance_experts`` contract, exactly: ``old_global_expert_indices`` is the
        current ``physical_to_logical`` map ``[layers, num_replicas]`` (vLLM's docstring says
        ``num_logical_experts``, but the map is what it passes), and the return value is the new
        ``physical_to_logical`` map alone, an int64 CPU tensor."""

        @classmethod
        def rebalance_experts(
            cls,
            weight: torch.Tensor,
            num_replicas: int,
            num_groups: int,
            num_nodes: int,
            num_ranks: int,
            old_global_expert_indices: torch.Tensor | None = None,
        ) -> torch.Tensor:
            old = None if old_global_expert_indices is None else old_global_expert_indices.cpu().numpy()
            placement = plan_placement(
                weight.float().cpu().numpy(), num_replicas, num_groups, num_nodes, num_ranks, old
            )
            return torch.from_numpy(placement).to(torch.int64)

    return FlotillaEplbPolicy
