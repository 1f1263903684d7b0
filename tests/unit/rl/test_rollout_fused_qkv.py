"""q / k / v in one GEMM over a fused weight the three projections view (models/common/fused_projections.py,
`EngineOptions.fuse_projections`): the rollout engine's tokens and log-probs equal its three-GEMM path's (greedy,
fp32, eager and static decode steps) on a family with q / k / v biases and images (Qwen2.5-VL), one with per-head
QK-norm (text Qwen3) and the hybrid (Nemotron: Mamba2 + attention); the state dict does not change; new weights
loaded into the engine reach the fused GEMM; a layer whose Parameters were re-made falls back to its three
projections; the trainer's model is refused."""
import pytest
import torch

from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models import build_model
from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.fused_projections import fuse_qkv, fused_projections
from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_vl_tokenizer, tiny_nemotron_vl_hf_config
from megatron_vlm.testing.tiny_text_model import tiny_qwen_text_hf_config
from tests.fixtures import tiny_qwen2_5_vl as F


class Tok:
    pad_token_id = 0
    eos_token_id = -1  # never drawn

    def decode(self, ids, skip_special_tokens=False):
        return ""


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(7)
    if family == "qwen2_5_vl":
        model = build_model(F.tiny_qwen2_5_vl_config_dict()).eval()
        prompts = []
        for parts in ([2, ("image", (1, 4, 4)), 3], [5, 1], [1, ("image", (1, 4, 6)), 1, 6, 2]):
            s = F.build_sample(parts, g)
            prompts.append(RolloutPrompt(torch.tensor(s["input_ids"]), s["pixel_values"], s["image_grid_thw"]))
        return model, prompts
    if family == "qwen3":
        model = build_model(tiny_qwen_text_hf_config("qwen3")).eval()
    else:
        cfg = tiny_nemotron_vl_hf_config(build_tiny_nemotron_vl_tokenizer())
        cfg["text_config"]["layers_block_type"] = ["linear_attention", "full_attention", "mlp", "linear_attention"]
        model = build_model(cfg).eval()
    return model, [RolloutPrompt(torch.randint(10, 200, (n,), generator=g)) for n in (5, 9, 3)]


def _generate(model, prompts, *, fuse: bool, graphs: str = "off"):
    eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=4, cuda_graphs=graphs,
                                                          fuse_projections=fuse))
    return eng, eng.generate(prompts, SamplingParams(max_new_tokens=6, n=2, temperature=0.0)).samples


def _q_proj_calls(model) -> list[int]:
    calls = [0]
    for m in model.modules():
        if isinstance(m, Attention):
            m.q_proj.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.token_ids, y.token_ids)
        torch.testing.assert_close(x.logprobs, y.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3", "nemotron_hybrid"])
def test_fused_rollouts_equal_three_projections(family, graphs):
    model, prompts = _model(family)
    _, ref = _generate(model, prompts, fuse=False, graphs=graphs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = _q_proj_calls(model)
    _, fused = _generate(model, prompts, fuse=True, graphs=graphs)
    assert calls[0] == 0  # every attention layer ran the fused GEMM (prompts and decode steps)
    _same(fused, ref)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    _, again = _generate(model, prompts, fuse=False, graphs=graphs)  # the views serve the three-GEMM path too
    assert calls[0] > 0
    _same(again, ref)


def test_loaded_weights_reach_the_fused_gemm():
    model, prompts = _model("qwen2_5_vl")
    eng, _ = _generate(model, prompts, fuse=True)
    other, _ = _model("qwen2_5_vl", seed=1)
    new = {k: v.clone() for k, v in other.state_dict().items()}
    eng.load_weights(new, version=1)
    fused = eng.generate(prompts, SamplingParams(max_new_tokens=6, n=2, temperature=0.0)).samples
    _, ref = _generate(other, prompts, fuse=False)
    _same(fused, ref)


def test_re_made_parameters_fall_back_then_fuse_again():
    model, prompts = _model("qwen3")
    assert fuse_qkv(model) == sum(isinstance(m, Attention) for m in model.modules()) > 0
    assert fuse_qkv(model) == 0  # already fused: nothing re-made
    layer = next(m for m in model.modules() if isinstance(m, Attention))
    assert layer._fused_qkv.intact(layer.q_proj, layer.k_proj, layer.v_proj)
    model.double()  # `.to()` re-makes every Parameter's data: the fused tensor is dropped with it
    assert layer._fused_qkv is None
    x = torch.randint(10, 200, (1, 7))
    with torch.no_grad():
        plain = model(x)
        with fused_projections():
            assert torch.equal(model(x), plain)
        assert fuse_qkv(model) > 0 and layer._fused_qkv.weight.dtype == torch.float64
        with fused_projections():
            torch.testing.assert_close(model(x), plain, rtol=0, atol=1e-10)
        # a Parameter assigned anew (not through `.to()`): the views no longer share the fused tensor
        layer.k_proj.weight = torch.nn.Parameter(layer.k_proj.weight.detach() * 2)
        assert not layer._fused_qkv.intact(layer.q_proj, layer.k_proj, layer.v_proj)
        plain = model(x)
        with fused_projections():
            assert torch.equal(model(x), plain)  # the three projections, not the stale fused weight
        assert fuse_qkv(model) > 0
        with fused_projections():
            torch.testing.assert_close(model(x), plain, rtol=0, atol=1e-10)


def test_trainer_forward_is_refused():
    model, _ = _model("qwen3")
    with pytest.raises(ValueError, match="fuse_projections"):
        PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], fuse_projections=True), forward=model)


@pytest.mark.parametrize("layout", [{"cuda_graphs": "on"}, {"kv_block_size": 4}])  # static slot steps; paged cache
def test_triton_cache_writes_give_the_same_rollouts(layout):
    """The Triton KV-cache write (interpreted here), which the fused variant of the decode benchmark times, against
    the torch backend's index_put: the same tokens and log-probs."""
    from megatron_vlm.kernels import use_backends

    model, prompts = _model("qwen2_5_vl")

    def run():
        eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], max_num_seqs=4, **layout))
        return eng.generate(prompts, SamplingParams(max_new_tokens=6, n=2, temperature=0.0)).samples

    ref = run()
    with use_backends({"kv_cache_write": "triton"}):
        _same(run(), ref)


def test_default_fuses_an_own_copy_on_cuda_only(monkeypatch):
    """None (the default): on for an engine decoding its own copy on CUDA (measured faster there), off on the CPU,
    and never for the trainer's model or a lock-step engine (no error: the default just stays off there)."""
    model, _ = _model("qwen3")
    assert PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1])).fuse_projections is False
    monkeypatch.setattr(PolicyRolloutEngine, "_on_cuda", staticmethod(lambda model, device: True))
    assert PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1])).fuse_projections is True
    assert PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], fuse_projections=False)).fuse_projections is False
    assert PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1]), forward=model).fuse_projections is False
    lockstep = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1]), all_ranks_active=lambda a: a)
    assert lockstep.fuse_projections is False
