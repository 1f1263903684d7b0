"""The fused routed experts of the engine's CPU decode step (megatron_vlm/inference/cpu_packed_experts.py):

* inside `decoding()` (inference mode, fp32 CPU) a `GroupedExperts` call equals the module's own forward to fp32
  rounding; everywhere else (outside the block, with autograd) it is the module's forward itself;
* a weight written in place is packed again before its next use (never a stale copy);
* the engine's greedy tokens with the fused experts equal those without them on the tiny Qwen3-MoE policy, the
  recorded routes too (routing replay), and after `load_weights` they equal a freshly built engine's.
"""
import copy

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.inference.cpu_packed_experts import PackedExperts, fused_experts_available
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.models.common.moe import GroupedExperts, moe_layers
from megatron_vlm.testing.synthesize import synthesize_model_folder
from tests.fixtures.rollout_engine import make_engine

pytestmark = pytest.mark.skipif(not fused_experts_available(), reason="megatron_vlm._C without the moe_experts op")


def _experts(gated=True, activation="silu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mod = GroupedExperts(6, 24, 10, activation=activation, gated=gated)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return mod


def _inputs(seed=1, n=9, e=6, k=2, hidden=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return torch.randn(n, hidden, generator=g), ids, torch.rand(n, k, generator=g)


@pytest.mark.parametrize("gated,activation", [(True, "silu"), (False, "relu2")])
def test_patched_experts_equal_the_module_inside_decoding_only(gated, activation):
    mod = _experts(gated, activation)
    x, ids, w = _inputs()
    with torch.no_grad():
        ref, ref_counts = GroupedExperts.forward(mod, x, ids, w)
    packer = PackedExperts(torch.nn.Sequential(mod))
    assert packer.num_modules == 1 and "forward" in mod.__dict__
    with torch.no_grad():
        out, _ = mod(x, ids, w)  # outside decoding(): the module's own forward
    assert torch.equal(out, ref) and not packer._packs
    with torch.inference_mode(), packer.decoding():
        out, counts = mod(x, ids, w)
    assert len(packer._packs) == 1  # the fused path ran
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts, ref_counts)
    with packer.decoding():  # autograd on: the module's forward, with its graph
        out, _ = mod(x, ids, w)
    assert out.requires_grad and torch.equal(out.detach(), ref)
    packer.restore()
    assert "forward" not in mod.__dict__


def test_subclasses_and_patched_modules_are_left_alone():
    class Sharded(GroupedExperts):  # e.g. expert parallelism's class swap: its own forward (all-to-all)
        pass

    sharded, plain = _experts(), _experts()
    sharded.__class__ = Sharded
    packer = PackedExperts(torch.nn.Sequential(sharded, plain))
    assert packer.num_modules == 1 and "forward" not in sharded.__dict__ and "forward" in plain.__dict__
    assert PackedExperts(torch.nn.Sequential(plain)).num_modules == 0  # already patched by the first one
    packer.restore()


def test_a_changed_expert_weight_is_packed_again():
    mod = _experts()
    x, ids, w = _inputs()
    packer = PackedExperts(torch.nn.Sequential(mod))
    with torch.inference_mode(), packer.decoding():
        before, _ = mod(x, ids, w)
    with torch.no_grad():
        mod.down_proj.mul_(-2.0)  # in place: the version counter moves
        ref, _ = GroupedExperts.forward(mod, x, ids, w)
    with torch.inference_mode(), packer.decoding():
        after, _ = mod(x, ids, w)
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after, -2.0 * before, rtol=1e-5, atol=1e-6)
    packer.restore()


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory):
    folder = synthesize_model_folder("tiny_qwen3_moe", tmp_path_factory.mktemp("moe") / "m", seed=0)
    model = load_hf_model(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():  # at the synthesized init (std 0.02) the experts barely move the greedy tokens
        for m in moe_layers(model):
            m.experts.gate_up_proj.mul_(5.0)
            m.experts.down_proj.mul_(5.0)
    return model, load_processor(str(folder)).tokenizer


def _run(eng, prompts, params):
    out = eng.generate(prompts, params).samples
    return [s.token_ids.tolist() for s in out], [s.routes for s in out]


def test_engine_tokens_and_routes_with_fused_experts(moe_policy):
    model, tok = moe_policy
    assert moe_layers(model)
    vocab = model.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(3)
    prompts = [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (7, 12, 4)]
    params = SamplingParams(max_new_tokens=6, n=3, temperature=0.0)
    fused = make_engine(copy.deepcopy(model), tok, eos_token_ids=[-1], record_routes=True)
    plain = make_engine(copy.deepcopy(model), tok, eos_token_ids=[-1], record_routes=True, cpu_fused_experts=False)
    tokens, routes = _run(fused, prompts, params)
    assert any(v[0] == "experts" for v in fused._packs.values() if isinstance(v[0], str))  # the fused path ran
    assert not any(isinstance(v[0], str) for v in plain._packs.values())
    assert all("forward" not in m.__dict__ for m in fused.model.modules())  # restored after the call
    plain_tokens, plain_routes = _run(plain, prompts, params)
    assert tokens == plain_tokens
    assert all(torch.equal(a, b) for a, b in zip(routes, plain_routes))
    # a weight push (different expert weights): the tokens of an engine built fresh on them
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for m in moe_layers(changed):
            m.experts.gate_up_proj.mul_(4.0)
    fused.load_weights(changed.state_dict(), version=1)
    fresh, _ = _run(make_engine(copy.deepcopy(changed), tok, eos_token_ids=[-1], record_routes=True,
                                cpu_fused_experts=False), prompts, params)
    again, _ = _run(fused, prompts, params)
    assert again == fresh != tokens
