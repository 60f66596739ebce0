"""Expert-parallel load balancing (EPLB): placement, vLLM policy, CPU EP runtime, controller.

Modules, one responsibility each:

- ``balance``: balancedness and weight-movement measures of a placement.
- ``deepseek``: DeepSeek's published EPLB algorithm, the baseline we compare against.
- ``placement``: Flotilla's movement-aware placement (the algorithm we ship).
- ``vllm_policy``: registers the placement as a vLLM EPLB policy (``vllm.general_plugins``).
- ``transfers``: which slots need weights from which rank when a placement changes.
- ``moe``: the Mixtral MoE math shared by the EP runtime and its single-process reference.
- ``runtime``: the CPU EP runtime (one Ray actor per EP rank, gloo all-to-all).
- ``controller``: load windows, the rebalance trigger, planning and layer-by-layer migration.

A placement is a ``physical_to_logical`` map ``[layers, num_physical]``: physical slot ``s``
lives on rank ``s // (num_physical // num_ranks)`` and holds the weights of one logical expert.
"""
