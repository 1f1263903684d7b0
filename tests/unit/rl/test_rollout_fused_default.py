"""The fused q / k / v default (`EngineOptions.fuse_projections` None = on for an engine decoding its own copy on CUDA)
in the places that build such an engine: forced here by making `_on_cuda` say yes, with CUDA graphs emulated on the
CPU (tests/fixtures/fake_cuda_graphs.py: a replay re-runs only the recorded ops on the same tensors, so a graph or a
writer holding stale weight tensors shows up as other tokens). Each engine's greedy tokens and log-probs must equal
those of an unfused eager engine on the weights it should hold."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import PolicyRolloutEngine
from megatron_vlm.models.common.attention import Attention
from megatron_vlm.models.common.fused_projections import fuse_qkv
from tests.fixtures.fake_cuda_graphs import fake_cuda_graphs
from tests.fixtures.rollout_engine import SilentTokenizer, make_engine, tiny_vl_model_and_prompts
from tests.unit.rl.test_async_weights import LoopbackBridge
from tests.unit.rl.test_decode_graph_replay import _same

PARAMS = SamplingParams(max_new_tokens=6, n=2, temperature=0.0)


def _reference(model, prompts):
    """Unfused eager tokens of `model`'s current weights (a copy, so nothing of the engine under test is touched)."""
    eng = make_engine(copy.deepcopy(model), SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4,
                      fuse_projections=False)
    return eng.generate(prompts, PARAMS).samples


def _attention_layers(model) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def _fused(model) -> bool:
    layers = _attention_layers(model)
    return bool(layers) and all(m._fused_qkv is not None and m._fused_qkv.intact(m.q_proj, m.k_proj, m.v_proj)
                                for m in layers)


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(PolicyRolloutEngine, "_on_cuda", staticmethod(lambda model, device: True))


def test_grpo_copy_refreshed_from_a_training_trainer_over_steps(on_cuda, monkeypatch):
    """rl.rollout.weights = "copy": the engine's own copy, refreshed from the trainer (`sync_from`) at every step while
    an optimizer updates the trainer; graphs kept across the steps."""
    trainer, prompts = tiny_vl_model_and_prompts(3)
    trainer.train()
    own = copy.deepcopy(trainer).eval().requires_grad_(False)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
    runners = fake_cuda_graphs(monkeypatch)
    eng = make_engine(own, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4, cuda_graphs="on", sync_from=trainer)
    assert eng.fuse_projections
    g = torch.Generator().manual_seed(5)
    runner = None
    for step in range(3):
        eng.load_weights(None, version=step)
        got = eng.generate(prompts, PARAMS).samples
        assert _fused(own)
        _same(_reference(trainer.eval(), prompts), got)
        runner = runner or eng._runner
        assert eng._runner is runner  # the graphs are kept: a replay must read the refreshed fused weights
        trainer.train()
        opt.zero_grad()
        for p in trainer.parameters():  # an update of every weight, the q / k / v projections' included
            p.grad = torch.randn(p.shape, generator=g) * 0.05
        opt.step()
    assert sum(b.graph.replays for r in runners for b in r.buckets.values() if b.graph is not None) > 0


def test_grpo_copy_with_lora_adapters(on_cuda, monkeypatch):
    """A LoRA run's copy (`mirror_lora`): adapted q / v layers stay three projections (a LoRALinear is not fused),
    the others fuse; the refreshed adapter factors and base weights reach the tokens."""
    from megatron_vlm.models.common.lora import apply_lora, mirror_lora

    trainer, prompts = tiny_vl_model_and_prompts(3)
    base = copy.deepcopy(trainer)
    names = [n for n, _ in trainer.named_modules() if n.startswith("language_model.layers.0.")
             and n.endswith(("q_proj", "v_proj"))]
    assert names
    apply_lora(trainer, names, r=2, alpha=4.0)
    own = base.eval().requires_grad_(False)
    mirror_lora(own, trainer)
    own.requires_grad_(False)
    fake_cuda_graphs(monkeypatch)
    eng = make_engine(own, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4, cuda_graphs="on", sync_from=trainer)
    g = torch.Generator().manual_seed(2)
    for step in range(2):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        eng.load_weights(None, version=step)
        got = eng.generate(prompts, PARAMS).samples
        _same(_reference(trainer.eval(), prompts), got)
    layers = _attention_layers(own)
    adapted = [m for m in layers if type(m.q_proj) is not torch.nn.Linear]
    assert adapted and all(m._fused_qkv is None for m in adapted)
    assert any(m._fused_qkv is not None for m in layers)


def _push(trainer, names=None):
    from megatron_vlm.rl.asynchronous.weights import push_weights

    bridge = LoopbackBridge()
    push_weights(trainer, bridge, 1, names=names)
    bridge.replaying = True
    return bridge, bridge.objects[-1]


def test_async_rollout_rank_receives_pushes_into_the_fused_weights(on_cuda, monkeypatch):
    """The asynchronous rollout rank: pushes written into its model in place (`receive_weights`), graphs kept."""
    from megatron_vlm.rl.asynchronous.weights import receive_weights, trainable_names

    trainer, prompts = tiny_vl_model_and_prompts(3)
    own = copy.deepcopy(trainer).eval().requires_grad_(False)
    fake_cuda_graphs(monkeypatch)
    eng = make_engine(own, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4, cuda_graphs="on")
    bridge, header = _push(trainer)  # the first push: every entry
    receive_weights(own, bridge, header, eng)
    _same(_reference(trainer, prompts), eng.generate(prompts, PARAMS).samples)
    assert _fused(own)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        bridge, header = _push(trainer, trainable_names(trainer))
        receive_weights(own, bridge, header, eng)
        _same(_reference(trainer, prompts), eng.generate(prompts, PARAMS).samples)


def test_async_push_while_the_first_rollout_fuses(on_cuda):
    """A push whose receive starts while the generating thread is in its first call (which fuses q / k / v under the
    step lock, before its first token): the pushed q / k / v must reach the fused weights the decode steps read,
    not the Parameters that the fusion replaced."""
    from megatron_vlm.rl.asynchronous.weights import receive_weights

    trainer, prompts = tiny_vl_model_and_prompts(3)
    own = copy.deepcopy(trainer).eval().requires_grad_(False)
    eng = make_engine(own, SilentTokenizer(), eos_token_ids=[-1], max_num_seqs=4)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.25)
    bridge, header = _push(trainer)
    paused = eng.paused

    def fused_first():  # the generating thread held the step lock first: it fused, then steps aside at a token
        fuse_qkv(own)
        return paused()

    eng.paused = fused_first
    receive_weights(own, bridge, header, eng)
    eng.paused = paused
    _same(_reference(trainer, prompts), eng.generate(prompts, PARAMS).samples)


def test_moving_a_fused_model_frees_the_fused_tensor():
    """A judge with `offload` moves its engine's model to the CPU between scoring calls (`.to()` re-makes every
    Parameter's data): the fused [q | k | v] tensors must go with them, not stay on the device the offload frees."""
    model, _ = tiny_vl_model_and_prompts(1)
    assert fuse_qkv(model) > 0
    model.to("cpu")  # already there: the views keep sharing the fused tensor, which stays
    assert _fused(model)
    refs = [weakref.ref(m._fused_qkv.weight) for m in _attention_layers(model)]
    model.double()  # stands in for .to("cpu"): new data for every Parameter
    gc.collect()
    assert all(r() is None for r in refs)
    assert all(m._fused_qkv is None for m in _attention_layers(model))
