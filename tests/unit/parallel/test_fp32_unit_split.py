"""Selective checkpointing under FSDP2 mixed precision is split per child and piece only for blocks that hold an
fp32 unit (Nemotron-H's routers, whose FSDP2 hooks a block-wide selective replay refuses). An fp32 unit outside
every block (a reward model's score head, kept fp32 so that its export scores what training scored) split every
opaque block too, keeping ~10 % more activations for nothing."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_vlm.parallel.apply import parallelize_blocks


class _Opaque(nn.Module):  # a MoE experts' stand-in: compile-opaque
    compile_opaque = True

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.w


class _Router(nn.Linear):
    fp32_weight = True


class _Block(nn.Module):
    def __init__(self, router: bool):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.experts = _Opaque()
        self.router = _Router(4, 4) if router else None

    def forward(self, x):
        x = self.experts(self.proj(x))
        return x if self.router is None else x + self.router(x)


class _Root(nn.Module):
    def __init__(self, router_in_blocks: bool):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(router_in_blocks) for _ in range(2)])
        self.head = _Router(4, 1)  # fp32 by design, outside the blocks

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)



@pytest.mark.parametrize("router_in_blocks", [False, True])
def test_only_blocks_holding_an_fp32_unit_are_split(gloo_world_of_one, router_in_blocks):
    from torch.distributed.device_mesh import init_device_mesh

    root = _Root(router_in_blocks)
    blocks = list(root.blocks)
    parallelize_blocks(root, blocks, SimpleNamespace(compile=False, reshard_after_forward=True),
                       mesh=init_device_mesh("cpu", (1,)), activation_checkpointing="selective",
                       param_dtype=torch.bfloat16)
    block_wide = ["_mvlm_ac_forward" in b.__dict__ for b in blocks]  # a split block's checkpoint moved to its children
    assert block_wide == [not router_in_blocks] * 2
    root(torch.randn(3, 4)).sum().backward()  # and it trains
