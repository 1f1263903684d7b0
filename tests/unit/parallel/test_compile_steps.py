"""`parallel.compile` on a MoE block over training steps whose token counts change (packed SFT / RL batches).

The routed experts size their grouped GEMMs from per-expert counts read on the host; traced, that read breaks
the graph and the counts become constants of the code after it, so every step (new counts) compiled again
until dynamo's recompile limit sent the block back to eager. The expert part runs eagerly inside the compiled
block instead: after the first change of shape (dynamo then marks the token dim dynamic) no step compiles
anything, and the outputs, gradients and expert loads are those of the eager block.
"""
import copy

import torch
from torch._dynamo.utils import counters

from megatron_vlm.models.common.mlp import SwiGLUMLP
from megatron_vlm.models.common.moe import MoE


def _moe_block():
    """Qwen3-MoE's block shape (softmax router, top 2 of 4 experts) with a shared expert, tiny."""
    torch.manual_seed(0)
    block = MoE(32, num_experts=4, top_k=2, moe_intermediate_size=16, activation="silu", gated_experts=True,
                shared_experts=SwiGLUMLP(32, 24))
    block.reset_parameters(0.2)
    return block.train()


def test_compiled_moe_block_compiles_once_for_changing_token_counts():
    torch._dynamo.reset()
    counters.clear()
    eager = _moe_block()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="eager")  # dynamo alone: graphs, breaks and guards are its own
    g = torch.Generator().manual_seed(1)
    graphs = []
    for tokens in (11, 17, 6, 23):
        x = torch.randn(tokens, 32, generator=g)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        yc, ye = compiled(xc), eager(xe)
        torch.testing.assert_close(yc, ye, rtol=1e-6, atol=1e-6)
        yc.square().sum().backward()
        ye.square().sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], f"graphs compiled after each step: {graphs}"
    for (name, pc), pe in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-6, atol=1e-6, msg=name)
    assert torch.equal(compiled.expert_load, eager.expert_load) and int(eager.expert_load.sum()) == 2 * 57
    # the only break is the eager expert region (torch.compiler.disable), not a host read inside traced code
    assert all("disable" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])
