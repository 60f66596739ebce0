"""The Mixtral sparse-MoE block, on flat per-expert weight tensors, plus a single-process reference.

An expert's weights travel between EP ranks as one flat tensor: ``w1`` then ``w3`` (both
``[ffn, hidden]``) then ``w2`` (``[hidden, ffn]``), as in the checkpoint
(``model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}.weight``). Routing is Mixtral's:
softmax over the gate logits, top-k, weights renormalised to sum to 1.

The EP runtime applies the MoE blocks of every layer in turn with their residual connection,
``x = x + moe_layer(x)``; attention is not part of EP and is left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open


@dataclass(frozen=True, slots=True)
class MoeShape:
    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    ffn: int

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> MoeShape:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if not config.get("num_local_experts"):
            raise ValueError(f"{model_dir} is not a Mixtral-style MoE model (no num_local_experts)")
        return cls(
            num_layers=config["num_hidden_layers"],
            num_experts=config["num_local_experts"],
            top_k=config["num_experts_per_tok"],
            hidden=config["hidden_size"],
            ffn=config["intermediate_size"],
        )

    @property
    def expert_numel(self) -> int:
        return 3 * self.ffn * self.hidden


class MoeCheckpoint:
    """Reads gates and single experts from a Mixtral safetensors checkpoint, tensor by tensor."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.shape = MoeShape.from_model_dir(self.model_dir)
        self._files = sorted(self.model_dir.glob("*.safetensors"))

    def _tensor(self, name: str) -> torch.Tensor:
        for file in self._files:
            with safe_open(str(file), framework="pt") as handle:
                if name in handle.keys():
                    return handle.get_tensor(name).float()
        raise KeyError(f"{name} not in {self.model_dir}")

    def gate(self, layer: int) -> torch.Tensor:
        return self._tensor(f"model.layers.{layer}.block_sparse_moe.gate.weight")

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return torch.cat([self._tensor(f"{prefix}.{name}.weight").reshape(-1) for name in ("w1", "w3", "w2")])


def route(gate: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert ids [T, k], weights [T, k])`` for tokens ``x [T, hidden]``."""
    probabilities = F.softmax(x @ gate.T, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def expert_forward(flat_weights: torch.Tensor, x: torch.Tensor, shape: MoeShape) -> torch.Tensor:
    ffn_hidden = shape.ffn * shape.hidden
    w1 = flat_weights[:ffn_hidden].view(shape.ffn, shape.hidden)
    w3 = flat_weights[ffn_hidden : 2 * ffn_hidden].view(shape.ffn, shape.hidden)
    w2 = flat_weights[2 * ffn_hidden :].view(shape.hidden, shape.ffn)
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def reference_forward(checkpoint: MoeCheckpoint, x: torch.Tensor) -> torch.Tensor:
    """All layers' MoE blocks in one process, every expert local: what EP must reproduce."""
    shape = checkpoint.shape
    for layer in range(shape.num_layers):
        ids, weights = route(checkpoint.gate(layer), x, shape.top_k)
        out = torch.zeros_like(x)
        for expert in range(shape.num_experts):
            token, choice = torch.nonzero(ids == expert, as_tuple=True)
            if token.numel():
                y = expert_forward(checkpoint.expert(layer, expert), x[token], shape)
                out.index_add_(0, token, y * weights[token, choice, None])
        x = x + out
    return x
