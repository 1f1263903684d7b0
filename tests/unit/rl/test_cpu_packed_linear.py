"""MKL-packed Linear weights of the engine's CPU decode step (megatron_vlm/inference/cpu_packed_linear.py):

* inside `decoding()` (inference mode, fp32 CPU) a layer's output equals `F.linear` to fp32 rounding, a
  call with fewer rows than packed for (down to half) is padded and gives the same rows as the full call;
  everywhere else (outside the block, with autograd, too few rows) it is `F.linear` itself;
* a weight written in place, or replaced, is packed again before its next use (never a stale copy);
* the engine's greedy tokens with packing equal those without it, and after `load_weights` / an in-place
  push inside `paused()` they equal a freshly built engine's on the new weights.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm.inference.cpu_packed_linear import PackedLinears, packing_available
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.models import build_model
from tests.fixtures import tiny_qwen2_5_vl as tiny
from tests.fixtures.rollout_engine import make_engine

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no MKL packed-GEMM ops")


def _layers(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_packed_layers_equal_f_linear_and_pad_to_the_packed_rows():
    model = _layers()
    lin = model[0]
    packer = PackedLinears(model, rows=8)
    assert packer.num_layers == 2 and "forward" in lin.__dict__
    x = torch.randn(8, 1, 64, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, lin.weight, lin.bias)
    assert torch.equal(lin(x), ref)  # outside decoding(): F.linear itself
    with torch.inference_mode(), packer.decoding():
        full = lin(x)
        assert full.shape == (8, 1, 96)
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-6)
        assert len(packer._packs) == 1  # the packed path ran
        for m in (7, 4):  # padded to 8 rows: the same rows as the full call
            assert torch.equal(lin(x[:m]), full[:m])
        assert torch.equal(lin(x[:3]), F.linear(x[:3], lin.weight, lin.bias))  # below half: F.linear
        out = model(x)
        torch.testing.assert_close(out, F.linear(ref, model[1].weight), rtol=1e-5, atol=1e-6)
    with packer.decoding():  # autograd on: F.linear
        assert torch.equal(lin(x), ref)
    packer.restore()
    assert "forward" not in lin.__dict__ and torch.equal(lin(x), ref)


def test_a_changed_weight_is_packed_again():
    model = _layers()
    lin = model[0]
    packer = PackedLinears(model, rows=4)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), packer.decoding():
        before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # in place: the version counter moves
    with torch.inference_mode(), packer.decoding():
        after = lin(x)
        torch.testing.assert_close(after, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(before, after)
    lin.weight = nn.Parameter(torch.randn(96, 64) * 0.1)  # a new tensor
    with torch.inference_mode(), packer.decoding():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-6)
    packer.restore()


class _Tok:
    pad_token_id = tiny.PAD_TOKEN_ID
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"{int(i)}|" for i in ids)


def _model(seed):
    torch.manual_seed(seed)
    return build_model(tiny.tiny_qwen2_5_vl_config_dict()).eval()


def _tokens(eng, prompts, params):
    return [s.token_ids.tolist() for s in eng.generate(prompts, params).samples]


@pytest.fixture(scope="module")
def two_models():
    return _model(0), _model(1)


def test_engine_tokens_with_packed_weights_and_after_weight_updates(two_models):
    g = torch.Generator().manual_seed(3)
    prompts = [RolloutPrompt(torch.randint(10, 200, (n,), generator=g)) for n in (5, 9, 3)]
    params = SamplingParams(max_new_tokens=4, n=2, temperature=0.0)
    model, changed = two_models
    packed = make_engine(copy.deepcopy(model), _Tok(), eos_token_ids=[-1])
    plain = make_engine(copy.deepcopy(model), _Tok(), eos_token_ids=[-1], cpu_packed_gemm=False)
    first = _tokens(packed, prompts, params)
    assert packed._packs and not plain._packs  # the decode steps ran on packed weights
    assert first == _tokens(plain, prompts, params)
    # a weight push: tokens of the new weights, as an engine built fresh on them
    packed.load_weights(changed.state_dict(), version=1)
    fresh = _tokens(make_engine(copy.deepcopy(changed), _Tok(), eos_token_ids=[-1]), prompts, params)
    assert _tokens(packed, prompts, params) == fresh != first
    # in-place writes inside paused() (the asynchronous trainer's push), then the version
    with packed.paused(), torch.no_grad():
        for (_, p), (_, q) in zip(packed.model.named_parameters(), model.named_parameters()):
            p.copy_(q)
        packed.load_weights(None, version=2)
    assert _tokens(packed, prompts, params) == first
