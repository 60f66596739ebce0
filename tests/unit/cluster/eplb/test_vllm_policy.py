"""Flotilla's placement registered as a vLLM EPLB policy, checked against the installed vLLM."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from vllm.distributed.eplb.policy import EPLB_POLICIES, AbstractEplbPolicy, DefaultEplbPolicy

from flotilla.cluster.eplb import vllm_policy
from flotilla.cluster.eplb.expert_placement import plan_placement


@pytest.fixture
def restored_policies() -> Iterator[None]:
    saved = dict(EPLB_POLICIES)
    yield
    EPLB_POLICIES.clear()
    EPLB_POLICIES.update(saved)


def test_entry_point_is_a_vllm_general_plugin() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("flotilla_eplb_policy") == "flotilla.cluster.eplb.vllm_policy:register"


def test_vllm_plugin_loader_registers_the_policy(restored_policies: None) -> None:
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    plugins["flotilla_eplb_policy"]()
    assert EPLB_POLICIES[vllm_policy.POLICY_NAME] is vllm_policy.flotilla_policy_class()
    assert EPLB_POLICIES["default"] is DefaultEplbPolicy, "vLLM's default stays unless switched"


def test_switch_makes_vllms_default_name_resolve_to_flotilla(restored_policies: None, monkeypatch) -> None:
    monkeypatch.setenv(vllm_policy.POLICY_SWITCH_ENV, vllm_policy.POLICY_NAME)
    vllm_policy.register()
    assert EPLB_POLICIES["default"] is vllm_policy.flotilla_policy_class()


def test_vllm_eplb_config_accepts_the_switched_default_with_async() -> None:
    from vllm.config.parallel import EPLBConfig

    config = EPLBConfig(policy="default", use_async=True, num_redundant_experts=32)
    assert config.policy == "default"  # the name our switch takes over; vLLM accepts no other with async


def test_signature_matches_the_abstract_policy() -> None:
    policy = vllm_policy.flotilla_policy_class()
    assert issubclass(policy, AbstractEplbPolicy)
    assert not inspect.isabstract(policy)
    ours = inspect.signature(policy.rebalance_experts)
    theirs = inspect.signature(AbstractEplbPolicy.rebalance_experts)
    assert list(ours.parameters) == list(theirs.parameters)
    assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()]


def test_called_the_way_vllms_eplb_state_calls_it() -> None:
    # eplb_state.rearrange: the global load window (int64 counts, CPU) and the current map.
    layers, logical, physical, groups, nodes, ranks = 3, 64, 80, 8, 2, 16
    rng = np.random.default_rng(0)
    load = torch.from_numpy(rng.poisson(rng.permutation(np.arange(logical) ** 2) + 1, size=(layers, logical)))
    initial = torch.tensor([list(range(logical)) + [i % logical for i in range(physical - logical)]] * layers)
    policy = vllm_policy.flotilla_policy_class()
    result = policy.rebalance_experts(load, physical, groups, nodes, ranks, initial)
    assert isinstance(result, torch.Tensor)
    assert result.dtype == torch.int64 and result.device.type == "cpu"
    assert tuple(result.shape) == (layers, physical)
    expected = plan_placement(load.numpy(), physical, groups, nodes, ranks, initial.numpy())
    assert (result.numpy() == expected).all()
    default = DefaultEplbPolicy.rebalance_experts(load, physical, groups, nodes, ranks, initial)
    assert default.shape == result.shape and default.dtype == result.dtype


def test_without_an_old_map() -> None:
    result = vllm_policy.flotilla_policy_class().rebalance_experts(torch.ones(2, 16), 24, 4, 2, 8)
    assert tuple(result.shape) == (2, 24)
