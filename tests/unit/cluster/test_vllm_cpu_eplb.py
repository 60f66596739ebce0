"""vLLM's EPLB on its CPU build: the engine-argument hand-over, the config switch, and the router's
logical → physical map with load recording against a per-element reference of vLLM's Triton kernel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flotilla.cluster.vllm_cpu_eplb import (
    ADDITIONAL_CONFIG_KEY,
    KNUTH_MULTIPLIER,
    enable_in_config,
    engine_args_for_cpu,
    map_and_record,
)


def kernel_reference(topk_ids, load, logical_to_physical, replica_count, record, unpadded):
    """vLLM's ``_eplb_map_and_record_i32_kernel``, one element at a time."""
    out = torch.empty_like(topk_ids).reshape(-1)
    choices = topk_ids.shape[-1]
    for offset, expert in enumerate(topk_ids.reshape(-1).tolist()):
        valid = 0 <= expert < replica_count.shape[0]
        count = max(int(replica_count[expert if valid else 0]), 1)
        token = offset // choices
        physical = int(logical_to_physical[expert, ((token * KNUTH_MULTIPLIER) & 0xFFFFFFFF) % count]) if valid else -1
        out[offset] = physical
        if record and (unpadded is None or token < unpadded) and 0 <= physical < load.shape[0]:
            load[physical] += 1
    return out.reshape(topk_ids.shape)


@pytest.mark.parametrize("record", [True, False])
@pytest.mark.parametrize("unpadded", [None, 5])
def test_map_and_record_equals_vllms_kernel(record: bool, unpadded: int | None) -> None:
    # 4 logical experts in 6 physical slots: experts 1 and 3 have a second replica.
    logical_to_physical = torch.tensor([[0, -1], [1, 4], [2, -1], [3, 5]])
    replica_count = torch.tensor([1, 2, 1, 2])
    generator = torch.Generator().manual_seed(0)
    topk_ids = torch.randint(0, 4, (9, 2), generator=generator, dtype=torch.int32)
    topk_ids[8, 1] = -1  # an invalid choice maps to -1 and is never counted

    load = torch.zeros(6, dtype=torch.int64)
    expected_load = torch.zeros(6, dtype=torch.int64)
    got = map_and_record(
        topk_ids,
        load,
        logical_to_physical,
        replica_count,
        torch.tensor(record),
        None if unpadded is None else torch.tensor(unpadded),
    )
    expected = kernel_reference(topk_ids, expected_load, logical_to_physical, replica_count, record, unpadded)
    assert torch.equal(got, expected) and got.dtype == topk_ids.dtype
    assert torch.equal(load, expected_load)
    assert (got >= 4).any(), "no token went to a second replica: the case is not covered"
    assert (int(load.sum()) > 0) == record


def test_eplb_engine_args_move_into_additional_config_only_when_asked() -> None:
    plain = {"max_num_seqs": 8}
    assert engine_args_for_cpu(plain) is plain
    args = {
        "enable_eplb": True,
        "eplb_config": {"step_interval": 40, "num_redundant_experts": 2},
        "additional_config": {"other": 1},
        "max_num_seqs": 8,
    }
    moved = engine_args_for_cpu(args)
    assert moved == {
        "additional_config": {"other": 1, ADDITIONAL_CONFIG_KEY: {"step_interval": 40, "num_redundant_experts": 2}},
        "max_num_seqs": 8,
    }
    assert args["enable_eplb"] is True, "the caller's arguments are not changed"


def test_the_platform_turns_eplb_on_synchronous_over_gloo() -> None:
    parallel = SimpleNamespace(enable_expert_parallel=True, enable_eplb=False, eplb_config=None)
    config = SimpleNamespace(
        additional_config={ADDITIONAL_CONFIG_KEY: {"step_interval": 40, "use_async": True}}, parallel_config=parallel
    )
    enable_in_config(config)
    assert parallel.enable_eplb
    eplb = parallel.eplb_config
    assert (eplb.step_interval, eplb.use_async, eplb.communicator) == (40, False, "torch_gloo")

    untouched = SimpleNamespace(additional_config={}, parallel_config=SimpleNamespace(enable_eplb=False))
    enable_in_config(untouched)
    assert not untouched.parallel_config.enable_eplb

    parallel.enable_expert_parallel = False
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        enable_in_config(config)
