"""`ValueModel`: a scalar value head on a family model's final hidden states (PPO's critic).

The values are read at exactly the positions whose log-probs the policy's `TokenLogprobModel` returns (the
positions with a label: each predicts a response token), in the same order, so V_t is the value of the state
before response token t — the layout of a pack's log-probs, split back per sample by `split_by_response`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_vlm.data.batch import label_positions, model_inputs

__all__ = ["ValueModel", "hidden_size_of"]


def hidden_size_of(model: nn.Module) -> int:
    """The width of the family model's final hidden states (the input width of its lm_head)."""
    head: Any = getattr(model, "lm_head", None)
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__}: no lm_head to read the hidden size from")
    return int(head.weight.shape[1])


class ValueModel(nn.Module):
    """`forward(batch) -> values [N]` (float32), one per labelled position of the packed batch.

    The head starts at zero (weight and bias): every value is 0 before the first update, the baseline of no
    knowledge, and the first updates fit the head before they move the backbone much."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone: Any = backbone
        self.value_head = nn.Linear(hidden_size_of(backbone), 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        head: Any = backbone.lm_head  # a family model's output Linear: the dtype and device of the weights
        self.value_head.to(dtype=head.weight.dtype, device=head.weight.device)

    def forward(self, batch: dict) -> torch.Tensor:
        hidden = self.backbone(**model_inputs(batch), return_hidden=True)
        # the trained positions from the labels' host copy (megatron_vlm/host_copies.py): no read of a bool mask's count
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, label_positions(batch["labels"]))
        return self.value_head(h).squeeze(-1).float()
