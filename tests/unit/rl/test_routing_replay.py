"""Routing replay end to end on the tiny MoE policies: the rollout engine records the experts of every token,
the packed training forward replays them.

Per family (Qwen3-MoE text, Qwen3-VL-MoE, Nemotron-H hybrid: Mamba2 / attention / MoE):
- the recorded routes cover prompt + generated tokens but the last, one row per MoE layer, int8; the static
  decode step (the CUDA-graph form, run eagerly here), unshared prefills, lock-step batches and the paged KV
  cache record the same routes;
- unperturbed, the training forward (packed, and prompt-shared where the family supports it) routes every
  token as the rollout did and its log-probs equal the rollout's within 1e-6 (fp32);
- the router is perturbed between rollout and training: without replay a measurable fraction of (token,
  layer) routes changes (asserted) and so do the log-probs; with replay every token goes to its recorded
  experts, the router gets a gradient, and — where the perturbation moves only the choice (Nemotron-H's
  score-correction bias, which the balancer moves between steps) — the log-probs equal the rollout's within
  1e-6 again. A perturbed softmax router weight also changes the recomputed gate weights (the router's
  gradient path): there replay must still bring the log-probs closer to the rollout's than free routing.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine, vision_token_ids
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.models.common.routing_replay import recording_routes, replaying_routes
from megatron_vlm.rl.batching import TrainSample, pack_samples
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.lm_loss import TokenLogprobModel

FAMILIES = ["tiny_qwen3_moe", "tiny_qwen3_vl_moe", "tiny_nemotron_vl"]
NEW = 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    return {kind: synthesize_model_folder(kind, root / kind, seed=0) for kind in FAMILIES}, root


def _prompts(kind, folder, root, vocab):
    if kind == "tiny_qwen3_moe":
        g = torch.Generator().manual_seed(1)
        return [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (7, 12, 4)]
    proc = load_processor(str(folder))
    vqa = write_synthetic_vqa(root / f"vqa_{kind}", 2, 3, seed=0)["eval"]
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=NEW, max_tokens=4096)
    return [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]


def _rollout(model, tok, prompts, lockstep=False, **options):
    engine_kw = {"forward": lambda **kw: model(**kw), "all_ranks_active": lambda active: active} if lockstep else {}
    eng = PolicyRolloutEngine(model, tok, EngineOptions(eos_token_ids=[-1], record_routes=True, **options), **engine_kw)
    return eng.generate(prompts, SamplingParams(max_new_tokens=NEW, n=2, temperature=1.0),
                        generator=torch.Generator().manual_seed(3)).samples


def _logp(wrap, batch, routes, force, *, grad=False):
    with torch.set_grad_enabled(grad), replaying_routes(wrap, routes, force=force) as plan, recording_routes() as used:
        lp = wrap(batch, masked_token_ids=vision_token_ids(wrap.model))  # the engine's distribution: vision masked
        if grad:
            lp.sum().backward()
    return lp.detach(), plan.mismatch(), used.stacked()


@pytest.mark.parametrize("kind", FAMILIES)
def test_replay_removes_the_rollout_training_routing_mismatch(kind, folders):
    by_kind, root = folders
    model = load_hf_model(str(by_kind[kind]), dtype=torch.float32).eval()
    tok = load_processor(str(by_kind[kind])).tokenizer
    layers = moe_layers(model)
    prompts = _prompts(kind, by_kind[kind], root, model.lm_head.weight.shape[0])
    out = _rollout(model, tok, prompts)
    for s in out:
        assert s.routes.dtype == torch.int8
        assert tuple(s.routes.shape) == (s.prompt_length + NEW - 1, len(layers), layers[0].top_k)
        assert int(s.routes.min()) >= 0 and int(s.routes.max()) < layers[0].num_experts
        top = s.routes.long().sort(-1).values
        assert bool((top[..., 1:] != top[..., :-1]).all())  # k distinct experts per token and layer
    # the static decode step (CUDA-graph form), unshared prefills, lock-step batches (the trainer's FSDP forward)
    # and the paged KV cache (attention-only decoders) record the same routes
    variants = [{"cuda_graphs": "on"}, {"share_prefix": False}, {"lockstep": True}]
    variants += [] if kind == "tiny_nemotron_vl" else [{"kv_block_size": 4}]
    for options in variants:
        again = _rollout(model, tok, prompts, **options)
        for a, b in zip(out, again):
            assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.routes, b.routes), options

    samples = [TrainSample(prompts[s.prompt_index], s.token_ids, s.logprobs, 0.0, routes=s.routes) for s in out]
    behav = torch.cat([s.logprobs for s in out])
    wrap = TokenLogprobModel(model)
    shared_ok = kind != "tiny_nemotron_vl"  # Nemotron-VL takes no shared-prompt packs
    for share in (False, True) if shared_ok else (False,):
        batch = pack_samples(samples, share_prompts=share)
        routes = batch.pop("routes")
        assert routes.shape[0] == batch["input_ids"].shape[1]
        lp, (differ, total), _ = _logp(wrap, batch, routes, force=False)
        assert total == int((routes[:, 0, 0] >= 0).sum()) * len(layers) > 0
        assert differ == 0, (share, differ, total)
        torch.testing.assert_close(lp, behav, atol=1e-6, rtol=0)

    # perturb the router between rollout and training
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in layers:
            if m.gate.e_score_correction_bias is not None:  # the choice only (what the balancer moves)
                m.gate.e_score_correction_bias += torch.randn(m.num_experts, generator=g) * 0.5
            else:
                m.gate.weight += torch.randn(m.gate.weight.shape, generator=g) * 0.05
    batch = pack_samples(samples, share_prompts=shared_ok)
    routes = batch.pop("routes")
    free, (differ, total), _ = _logp(wrap, batch, routes, force=False)
    assert differ / total > 0.05, (differ, total)  # a measurable fraction of tokens x layers routes elsewhere
    free_err = float((free - behav).abs().max())
    assert free_err > 1e-3
    model.train()
    model.zero_grad()
    replayed, (differ_r, total_r), used = _logp(wrap, batch, routes, force=True, grad=True)
    assert (differ_r, total_r) == (differ, total)  # the same natural routing, counted under replay too
    valid = routes[:, 0, 0] >= 0
    assert torch.equal(used[valid].long(), routes[valid].long())  # every recorded token went to its experts
    assert all(m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0 for m in layers)
    err = float((replayed - behav).abs().max())
    if kind == "tiny_nemotron_vl":
        torch.testing.assert_close(replayed, behav, atol=1e-6, rtol=0)
    else:
        assert err < free_err / 2, (err, free_err)
