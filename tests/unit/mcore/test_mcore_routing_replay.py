"""Routing replay with `parallel.backend = "mcore"`: megatron-core's MoE layers record and replay routes.

Per tiny policy (Qwen3-MoE text with renormalised top-k weights, the same without renormalisation = megatron-core's
pre-softmax routing, and the Nemotron-H hybrid: sigmoid scores, expert bias, routed scaling, shared expert) the
megatron-core model is the native one with its layers swapped (`use_mcore_layers`), and the native model, whose
replay is checked against the router equations in plain torch (tests/unit/models/test_routing_replay_block.py),
is the reference:
- the rollout engine on the megatron-core model records the same routes as on the native model;
- unperturbed, the megatron-core training forward (packed) routes every token as the rollout did and its
  log-probs equal the rollout's within 1e-6;
- the router is perturbed (the expert bias for Nemotron-H, the router weight for Qwen3-MoE): free routing sends
  > 5 % of tokens x layers elsewhere (counted as the native model counts them); with replay every token goes to its
  recorded experts (read from megatron-core's own routing map, not from the ids replay recorded), and the
  log-probs and every gradient (the router's included, non-zero) equal the native model's under the same
  replay; for the bias perturbation the log-probs equal the rollout's within 1e-6 again (a perturbed router weight
  also moves the recomputed gate weights: there replay only brings them closer than free routing).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")  # installed by the dev extra

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine, vision_token_ids  # noqa: E402
from megatron_vlm.models.common.moe import moe_layers  # noqa: E402
from megatron_vlm.models.common.routing_replay import recording_routes, replaying_routes  # noqa: E402
from megatron_vlm.models.mcore.layer import use_mcore_layers  # noqa: E402
from megatron_vlm.rl.batching import TrainSample, pack_samples  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402

NEW = 6
VARIANTS = {"qwen3_moe_renorm": ("tiny_qwen3_moe", True), "qwen3_moe_pre_softmax": ("tiny_qwen3_moe", False),
            "nemotron_vl": ("tiny_nemotron_vl", None)}


def _rollout(model, tok, prompts):
    eng = PolicyRolloutEngine(model.eval(), tok, EngineOptions(eos_token_ids=[-1], record_routes=True))
    return eng.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=1.0),
                        generator=torch.Generator().manual_seed(3)).samples


def _forward(model, batch, routes, force, weights):
    """Log-probs, the routing map megatron-core (or the native block) used per layer [N, E], the plan's counts and
    the parameter gradients of one replayed training forward + backward."""
    maps: list[torch.Tensor] = []
    hooks = [m.router.register_forward_hook(lambda mod, a, out: maps.append(out[1].detach().reshape(-1, out[1].shape[-1])))
             for m in moe_layers(model) if hasattr(m, "router")]
    model.zero_grad(set_to_none=True)
    model.train()
    try:
        with replaying_routes(model, routes, force=force) as plan, recording_routes() as used:
            lp = TokenLogprobModel(model)(batch, masked_token_ids=vision_token_ids(model))  # as the engine: vision masked
            (lp * weights).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    if not maps:  # the native blocks: their routing map from the ids they used
        stacked = used.stacked().long()
        maps = [F.one_hot(stacked[:, i], moe_layers(model)[0].num_experts).sum(1).bool() for i in range(stacked.shape[1])]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), maps, plan.mismatch(), grads


def _router_grads(model):
    return [m.gate.weight.grad for m in moe_layers(model)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mcore_moe_layers_replay_the_recorded_routes(variant, mcore_state, tmp_path):
    kind, renorm = VARIANTS[variant]
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    native = load_hf_model(str(folder), dtype=torch.float32)
    if renorm is not None:
        for m in moe_layers(native):
            m.gate.norm_topk_prob = renorm
    mc = copy.deepcopy(native)
    use_mcore_layers(mc)
    layers = moe_layers(mc)
    assert layers and all(type(m).__mro__[1].__name__ == "MoELayer" for m in layers)
    tok = load_processor(str(folder)).tokenizer
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.randint(0, 64, (n,), generator=g)) for n in (7, 12, 4)]  # plain text ids

    out = _rollout(mc, tok, prompts)
    out_native = _rollout(native, tok, prompts)
    for a, b in zip(out, out_native):
        assert torch.equal(a.token_ids, b.token_ids)
        assert a.routes.dtype == torch.int8 and tuple(a.routes.shape) == (a.prompt_length + NEW - 1, len(layers),
                                                                           layers[0].top_k)
        assert torch.equal(a.routes.long().sort(-1).values, b.routes.long().sort(-1).values)
    samples = [TrainSample(prompts[s.prompt_index], s.token_ids, s.logprobs, 0.0, routes=s.routes) for s in out]
    behav = torch.cat([s.logprobs for s in out])
    batch = pack_samples(samples, share_prompts=False)
    routes = batch.pop("routes")
    weights = torch.randn(behav.numel(), generator=g)
    recorded = F.one_hot(routes.long(), layers[0].num_experts).sum(2).bool()  # [N, layers, E]

    lp, maps, (differ, total), _ = _forward(mc, batch, routes, False, weights)
    assert total == routes.shape[0] * len(layers) and differ == 0, (differ, total)
    torch.testing.assert_close(lp, behav, atol=1e-6, rtol=0)

    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # perturb the router between rollout and training, the same in both models
        for m_n, m_c in zip(moe_layers(native), layers):
            if m_n.gate.e_score_correction_bias is not None:
                delta = torch.randn(m_n.num_experts, generator=gen) * 0.5
                m_n.gate.e_score_correction_bias.add_(delta)
                m_c.gate.e_score_correction_bias.add_(delta)  # megatron-core's expert_bias, in place
            else:
                delta = torch.randn(m_n.gate.weight.shape, generator=gen) * 0.05
                m_n.gate.weight += delta
                m_c.gate.weight += delta
    free, maps, (differ, total), _ = _forward(mc, batch, routes, False, weights)
    assert differ / total > 0.05, (differ, total)
    assert any(not torch.equal(mp, recorded[:, i]) for i, mp in enumerate(maps))
    assert (differ, total) == _forward(native, batch, routes, False, weights)[2]

    lp, maps, counts, grads = _forward(mc, batch, routes, True, weights)
    assert counts == (differ, total)  # the natural routing, counted under replay too
    for i, mp in enumerate(maps):  # megatron-core dispatched each token to its recorded experts
        assert torch.equal(mp, recorded[:, i]), i
    assert all(gr is not None and gr.abs().sum() > 0 for gr in _router_grads(mc))
    lp_n, maps_n, _, _ = _forward(native, batch, routes, True, weights)
    torch.testing.assert_close(lp, lp_n, atol=1e-5, rtol=0)
    for a, b in zip(_router_grads(mc), _router_grads(native)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if kind == "tiny_nemotron_vl":  # only the choice moved: replay restores the rollout's log-probs
        torch.testing.assert_close(lp, behav, atol=1e-6, rtol=0)
    else:  # the recomputed gate weights moved with the router weight (its gradient path): closer, not equal
        assert float((lp - behav).abs().max()) < float((free - behav).abs().max())
