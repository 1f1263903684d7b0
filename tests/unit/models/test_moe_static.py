"""Graph-safe MoE experts for static decode steps (models/common/moe_static.py).

The static forms (grouped GEMM on device offsets, dense batched matmuls) against the eager routed path
(`kernels.moe_permute` -> `grouped_mm` -> `moe_unpermute`), then whole greedy rollouts of tiny MoE policies
(Qwen3-VL-MoE, Qwen3-MoE text, the Nemotron-H hybrid with its MoE layer) through the static decode step
(what a CUDA graph captures; eager on the CPU, with the graph-safety probe on) against eager steps.
"""
import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.common.moe_static import experts_static, static_routing
from megatron_vlm.testing.synthesize import synthesize_model_folder


def _moe(hidden=32, experts=6, k=2, inter=16, gated=True, activation="silu", latent=None):
    torch.manual_seed(0)
    m = MoE(hidden, num_experts=experts, top_k=k, moe_intermediate_size=inter, activation=activation,
            gated_experts=gated, score_func="softmax", latent_size=latent).eval()
    m.reset_parameters(0.2)
    return m


@pytest.mark.parametrize("form", ["grouped", "dense"])
@pytest.mark.parametrize("gated,activation,latent", [(True, "silu", None), (False, "relu2", 16)])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_static_forms_equal_the_routed_path(form, gated, activation, latent, n):
    moe = _moe(gated=gated, activation=activation, latent=latent)
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        ref = moe(x)
        _, weights, ids = moe.gate(x)
        routed_in = x if moe.fc1_latent_proj is None else moe.fc1_latent_proj(x)
        eager, _ = moe.experts(routed_in, ids, weights)
        got = experts_static(moe.experts, routed_in, ids, weights, form=form)
        torch.testing.assert_close(got, eager.float(), atol=1e-5, rtol=1e-5)
        with static_routing():
            torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-5)


def test_an_expert_without_tokens_and_all_tokens_on_one_expert():
    moe = _moe(experts=5, k=1)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    ids = torch.full((4, 1), 3)
    w = torch.ones(4, 1)
    with torch.no_grad():
        eager, _ = moe.experts(x, ids, w)
        for form in ("grouped", "dense"):
            torch.testing.assert_close(experts_static(moe.experts, x, ids, w, form=form), eager.float(), atol=1e-5, rtol=1e-5)


def test_auto_takes_grouped_where_torch_grouped_mm_takes_the_operands():
    from megatron_vlm.kernels import static_experts as moe_static

    moe = _moe(hidden=32, inter=16)  # fp32: 32 * 4 and 16 * 4 bytes rows, 16-byte aligned
    first = moe.experts.gate_up_proj
    assert moe_static._grouped_mm_takes(torch.zeros(2, 32), (first, moe.experts.down_proj), (32, 16)) == hasattr(torch, "_grouped_mm")
    odd = _moe(hidden=30, inter=15)  # rows of 60 / 120 bytes: refused, dense instead
    assert not moe_static._grouped_mm_takes(torch.zeros(2, 30), (odd.experts.gate_up_proj, odd.experts.down_proj), (30, 15))


class _Tok:
    pad_token_id = 0
    eos_token_id = -1

    def decode(self, ids, skip_special_tokens=False):
        return ""


@pytest.mark.parametrize("kind", ["tiny_qwen3_vl_moe", "tiny_qwen3_moe", "tiny_nemotron_vl"])
def test_moe_policies_decode_in_static_steps_as_in_eager_steps(kind, tmp_path, monkeypatch):
    from megatron_vlm.models.common import moe as moe_module

    calls = []
    real = moe_module.experts_static
    monkeypatch.setattr(moe_module, "experts_static", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = load_hf_model(str(synthesize_model_folder(kind, tmp_path / kind, seed=0))).eval()
    assert any(isinstance(m, MoE) for m in model.modules())
    g = torch.Generator().manual_seed(0)
    prompts = [RolloutPrompt(torch.randint(10, 100, (k,), generator=g)) for k in (5, 9, 3)]
    params = SamplingParams(max_new_tokens=8, n=2, temperature=0.0)
    ref = PolicyRolloutEngine(model, _Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=5, cuda_graphs="off")).generate(prompts, params)
    static = PolicyRolloutEngine(model, _Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=5, cuda_graphs="on"))
    assert not calls  # eager steps route on the host-sized path
    got = static.generate(prompts, params)  # "on" on the CPU: the static step, probed for graph safety
    assert calls  # the static steps took the graph-safe experts
    for a, b in zip(ref.samples, got.samples):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)


def test_a_static_step_of_a_training_mode_block_counts_as_the_eager_one():
    """The static form returns no per-expert counts (they would be a host-sized by-product); a block in training
    mode still counts its tokens (and leaves router stats) as the eager path does, instead of failing."""
    eager, static = _moe().train(), _moe().train()
    eager.record_router_stats = static.record_router_stats = True
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = eager(x)
        with static_routing():
            got = static(x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(static.expert_load, eager.expert_load) and int(static.expert_load.sum()) == 5 * 2
    assert torch.equal(static.router_stats.tokens_per_expert, eager.router_stats.tokens_per_expert)
