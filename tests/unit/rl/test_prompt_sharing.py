"""Prompt sharing in the GRPO training forwards (`rl.update.prompt_sharing`): a pack holding each prompt once
with its group's completions gives the log-probs and gradients of the plain pack (every completion
with its own copy of the prompt, images included), on every family that accepts it; the pack is
smaller; Nemotron-VL's hybrid decoder does not accept it."""
import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.processor import load_processor
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.models.common.prefix_sharing import PrefixLayout, accepts_prefix_segments, shift_positions
from megatron_vlm.rl.batching import TrainSample, group_by_prompt, pack_samples, plan_shared_micro_batches
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.lm_loss import TokenLogprobModel


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return write_synthetic_vqa(tmp_path_factory.mktemp("vqa"), 2, 3, seed=0)["eval"]


def _samples(prompts, vocab: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in prompts:
        for _ in range(group):
            n = int(torch.randint(1, 6, (1,), generator=g))
            out.append(TrainSample(prompt=p, response_ids=torch.randint(0, vocab, (n,), generator=g),
                                   behav_logp=torch.zeros(n), advantage=0.0))
    # interleave the groups as a shuffled mini-batch would; group_by_prompt puts them back together
    return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]


def _logp_and_grads(model, batch, weights):
    model.zero_grad(set_to_none=True)
    wrapper = TokenLogprobModel(model).train()
    logp = wrapper({k: v for k, v in batch.items() if k != "num_response_tokens"})
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_internvl", "tiny_qwen3_moe"])
def test_shared_pack_equals_plain_pack(kind, vqa, tmp_path):
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    model = load_hf_model(str(folder), dtype=torch.float32)
    vocab = model.lm_head.weight.shape[0]
    if kind == "tiny_qwen3_moe":  # text-only: prompts of random token ids
        g = torch.Generator().manual_seed(1)
        prompts = [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (7, 12, 4)]
    else:
        encoder = PromptEncoder(load_processor(str(folder)), max_frames=4, fps=2.0, max_new_tokens=5, max_tokens=4096)
        prompts = [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]
        assert all(p is not None and p.pixel_values is not None for p in prompts)
    assert accepts_prefix_segments(model)
    samples = group_by_prompt(_samples(prompts, vocab, group=3))
    plain = pack_samples(samples)
    shared = pack_samples(samples, share_prompts=True)
    assert "prefix_segments" in shared and "prefix_segments" not in plain
    assert shared["input_ids"].shape[1] == plain["input_ids"].shape[1] - sum(2 * (len(p) - 1) for p in prompts)
    assert shared["num_response_tokens"] == plain["num_response_tokens"]
    if "pixel_values" in plain:  # each image once instead of once per completion
        assert shared["pixel_values"].shape[0] * 3 == plain["pixel_values"].shape[0]
    weights = torch.randn(plain["num_response_tokens"], generator=torch.Generator().manual_seed(2))
    lp_plain, g_plain = _logp_and_grads(model, plain, weights)
    lp_shared, g_shared = _logp_and_grads(model, shared, weights)
    torch.testing.assert_close(lp_shared, lp_plain, atol=2e-5, rtol=0)
    assert g_shared.keys() == g_plain.keys()
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=2e-5, rtol=1e-4, msg=name)


def test_nemotron_does_not_accept_prefix_segments(tmp_path):
    folder = synthesize_model_folder("tiny_nemotron_vl", tmp_path / "n", seed=0)
    assert not accepts_prefix_segments(load_hf_model(str(folder)))


def test_layout_positions_and_planning():
    cu = torch.tensor([0, 3, 5, 9, 11], dtype=torch.int32)  # prefix of 3, two continuations, a plain segment
    prefix = torch.tensor([-1, 0, 0, -1])
    layout = PrefixLayout.build(cu, prefix)
    assert layout.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert layout.cu_seqlens_k.tolist() == [0, 3, 8, 15, 17] and layout.max_seqlen_k == 7
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1]])
    mrope = torch.stack([pos, pos + torch.tensor([[0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0]]), pos])  # an image lifts one axis
    assert shift_positions(pos, cu, prefix).tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1]]
    assert shift_positions(mrope, cu, prefix)[:, 0, 3].tolist() == [6, 6, 6]  # max over every axis + 1
    with pytest.raises(ValueError, match="earlier segment"):
        PrefixLayout.build(cu, torch.tensor([-1, 0, 3, -1]))
    with pytest.raises(ValueError, match="continues another"):
        PrefixLayout.build(cu, torch.tensor([-1, 0, 1, -1]))
    p1, p2 = RolloutPrompt(torch.arange(10)), RolloutPrompt(torch.arange(4))
    samples = [TrainSample(p, torch.ones(n, dtype=torch.long), torch.zeros(n), 0.0) for p, n in
               ((p1, 3), (p1, 2), (p1, 4), (p2, 3))]
    # costs: 13, 3, 5 (sharing p1), then 7 for p2's first sample
    assert plan_shared_micro_batches(samples, 21) == [[0, 1, 2], [3]]
    assert plan_shared_micro_batches(samples, 28) == [[0, 1, 2, 3]]
    # a prompt ending in a vision placeholder is never split
    assert "prefix_segments" not in pack_samples(samples[:2], share_prompts=True, vision_token_ids=frozenset({9}))
    assert plan_shared_micro_batches(samples, 21, vision_token_ids=frozenset({9})) == [[0], [1], [2, 3]]


def _moe_update(folder, sharing: str, aux: float):
    """One GRPO update (SGD) of the tiny Qwen3-MoE with `rl.update.prompt_sharing = sharing` and the [moe]
    auxiliary loss weighted `aux`: the parameters after it."""
    from types import SimpleNamespace as NS

    from megatron_vlm.rl.grpo_step import GRPOStep
    from megatron_vlm.training.moe_balancing import MoEConfig, MoELoadBalancer
    from megatron_vlm.training.optim import OptimState

    model = load_hf_model(str(folder), dtype=torch.float32)
    wrapper = TokenLogprobModel(model)
    vocab = model.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (9, 14)]
    samples = group_by_prompt(_samples(prompts, vocab, group=4))
    with torch.no_grad():
        for i, s in enumerate(samples):
            s.advantage = float(i % 3) - 1.0
            s.old_logp = wrapper.eval()(pack_samples([s]))  # on-policy: ratio 1
    wrapper.train()  # as PolicyUpdate.train leaves it (a training forward records the router statistics)
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.5)
    ctx = NS(env=NS(device=torch.device("cpu"), rank=0, world_size=1),
             cfg=NS(data=NS(max_tokens_per_pack=256), train=NS(seed=5, max_grad_norm=0.0)), to_device=lambda b: b)
    cfg = MoEConfig(enable_moe_load_balancing_training=False, aux_loss_coef=aux)
    bundle = NS(dims=NS(dp_size=1), wrapper=wrapper, model=model, trainable_params=list(wrapper.parameters()),
                moe_balancer=MoELoadBalancer(model, cfg))
    rl = NS(accuracy_label=lambda: "acc", policy_loss="clip", advantage="grpo", allocation=None, recompute_logprobs=False,
            batch=NS(ppo_epochs=1, mini_batches_per_step=1, group_size=4), rollout=NS(temperature=1.0, max_new_tokens=8),
            loss=NS(loss_agg="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, kl_coef=0.0, kl_estimator="k3",
                    entropy_coef=0.0, rollout_correction="none", rollout_correction_cap=2.0),
            advantages=NS(overlong_buffer=0, dynamic_sampling=False, normalize_std=None, drop_equal_reward_groups=False,
                          kl_in_reward=None),
            update=NS(mask_truncated=False, prompt_sharing=sharing, skip_zero_advantage=True),
            asynchronous=NS(max_head_offpolicyness=0), eval=NS(correct_threshold=1.0))
    grpo = GRPOStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), rl,
                    engine=None, encoder=NS(skipped=0), manager=NS(labels=["acc"], metrics=lambda: {}))
    grpo.policy.update(0, samples, samples[0])
    return grpo.policy.share_prompts, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_moe_aux_loss_update_is_the_plain_packs(tmp_path):
    """The [moe] auxiliary loss is a function of every token a pack routes: a shared prompt is routed once instead of
    once per completion, so its gradient is not the plain pack's (after one SGD update of the tiny Qwen3-MoE the
    parameters were 1.5e-2 apart, 6e-8 without the aux loss).
    "auto" therefore packs plainly when the aux loss is on (the update then equals "off"), and still shares without it
    (log-probs and gradients equal the plain pack's: above)."""
    folder = synthesize_model_folder("tiny_qwen3_moe", tmp_path / "m", seed=0)
    start = {n: p.detach() for n, p in load_hf_model(str(folder), dtype=torch.float32).named_parameters()}
    shared, auto = _moe_update(folder, "auto", aux=0.5)
    plain, off = _moe_update(folder, "off", aux=0.5)
    assert not shared and not plain
    assert any(not torch.equal(off[n], start[n]) for n in off)
    for name in off:
        torch.testing.assert_close(auto[name], off[name], atol=1e-6, rtol=1e-5, msg=name)
    assert _moe_update(folder, "auto", aux=0.0)[0]  # without the aux loss prompts are shared
