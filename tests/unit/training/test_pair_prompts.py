"""Preference packs with each pair's prompt computed once (training/pair_prompts.py) score and train exactly as the
plain packs: the DPO log-prob sums and the reward-model rewards, and their gradients, equal those of the plain pack
(float64: log-prob sums to 1e-9, gradients to float32 rounding), on a text model, a MoE model a text-only pack of a VLM family (M-RoPE positions) and
the preference loader's image pairs of three VLM families (one copy of the prompt's image kept); the layout itself holds
every label once, none in a prefix; packs or pairs that cannot share stay as they are; `pair_sharing` refuses the
models and layouts the shared layout does not hold for."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.batch import IGNORE_INDEX, VISION_KEYS
from megatron_vlm.data.packing import collate_pack
from megatron_vlm.data.processing import ProcessedSample
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.dpo.losses import sigmoid_loss
from megatron_vlm.training.dpo.sequence import pair_sums
from megatron_vlm.training.lm_loss import TokenLogprobModel
from megatron_vlm.training.pair_prompts import pair_sharing, share_pair_prompts
from megatron_vlm.training.reward.model import ScoreRoot
from megatron_vlm.training.reward.step import pair_rewards


def _pack(pairs: list[tuple[list[int], list[int], list[int]]]) -> dict:
    """A preference-loader pack: (prompt, chosen, rejected) ids per pair; responses labelled."""
    samples = []
    for prompt, *responses in pairs:
        for resp in responses:
            mask = torch.tensor([False] * len(prompt) + [True] * len(resp))
            samples.append(ProcessedSample(input_ids=torch.tensor(prompt + resp), label_mask=mask))
    pack = collate_pack(samples)
    pack["pair_index"], pack["num_pairs"] = torch.arange(len(pairs)), torch.tensor(len(pairs))
    return pack


def _random_pairs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(8, 900, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    return [(ids(3, 12), ids(1, 6), ids(1, 6)) for _ in range(n)]


def test_layout_holds_every_label_once_and_none_in_a_prefix():
    pairs = _random_pairs(3)
    plain = _pack(pairs)
    shared = share_pair_prompts(plain)
    assert shared["prefix_segments"].tolist() == [-1, 0, 0, -1, 3, 3, -1, 6, 6]
    assert shared["response_segments"].tolist() == [-1, 0, 1, -1, 2, 3, -1, 4, 5]
    cu = shared["cu_seqlens"].tolist()
    assert cu[-1] == plain["input_ids"].numel() - sum(len(p) - 1 for p, _, _ in pairs)
    labels = shared["labels"][0]
    for s in (0, 3, 6):  # the prefixes: the prompt less its last token, no label
        assert (labels[cu[s]:cu[s + 1]] == IGNORE_INDEX).all()
    keep = plain["labels"][0] != IGNORE_INDEX
    assert torch.equal(labels[labels != IGNORE_INDEX], plain["labels"][0][keep])
    assert shared["pair_index"] is plain["pair_index"] and int(shared["num_pairs"]) == 3


def test_pairs_that_cannot_share_stay_plain():
    mixed = _pack([([5, 6, 7], [8], [9]), ([5, 6, 7], [8, 9], [10])])
    mixed["input_ids"][0, 4] = 99  # pair 0's rejected sequence: another prompt token -> that pair stays plain
    shared = share_pair_prompts(mixed)
    assert shared["prefix_segments"].tolist() == [-1, -1, -1, 2, 2]
    assert shared["response_segments"].tolist() == [0, 1, -1, 2, 3]
    one_token_prompt = _pack([([5], [8], [9])])  # nothing before the first label: as it is
    assert share_pair_prompts(one_token_prompt) is one_token_prompt
    vision = _pack(_random_pairs(2))  # images without the loader's per-sequence rows: as it is
    vision["pixel_values"] = torch.zeros(4, 3)
    assert share_pair_prompts(vision) is vision
    empty = {"input_ids": torch.tensor([[0]]), "labels": torch.tensor([[IGNORE_INDEX]]),
             "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32), "num_pairs": torch.tensor(0)}
    assert share_pair_prompts(empty) is empty


@pytest.fixture(scope="module", params=["tiny_qwen2", "tiny_qwen2_5_vl", "tiny_qwen3_moe"])
def folder(request, tmp_path_factory):
    return synthesize_model_folder(request.param, tmp_path_factory.mktemp("pair_prompts") / "m", seed=0)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return out


def _assert_same_grads(a: dict, b: dict) -> None:
    """Equal to float32 rounding: the summation order of a shared prompt's gradient differs (float64 ulps), and
    parts of the float64 model round through float32, which turns those into float32 ulps (reordering the pairs of
    a plain pack does the same); a wrong layout would be off by O(1). A gradient that is zero but for rounding (an
    attention key bias: softmax ignores a shift shared by all keys) is compared in absolute terms (1e-15)."""
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        scale = float(a[name].abs().max())
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6 * scale + 1e-15, msg=lambda m, n=name: f"{n}: {m}")


def test_dpo_sums_and_gradients_equal_the_plain_pack(folder):
    plain = _pack(_random_pairs(3, seed=1))
    shared = share_pair_prompts(plain)
    assert "prefix_segments" in shared
    model = TokenLogprobModel(load_hf_model(folder, dtype=torch.float64, device="cpu")).train()
    results = []
    for pack in (plain, shared):
        c, r, n_c, n_r = pair_sums(model(pack), pack)
        loss = sigmoid_loss(c, r, c.detach() + 0.3, r.detach() - 0.2, n_c, n_r, beta=0.1).mean()
        loss.backward()
        results.append(((c.detach(), r.detach(), n_c, n_r), _grads(model)))
    for got, want in zip(results[1][0], results[0][0]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    _assert_same_grads(results[1][1], results[0][1])
    unlinked = {k: v for k, v in shared.items() if k != "prefix_segments"}  # continuations that do not see the prompt
    with torch.no_grad():
        assert (pair_sums(model(unlinked), unlinked)[0] - results[0][0][0]).abs().max() > 1e-2


def test_reward_model_rewards_and_gradients_equal_the_plain_pack(folder):
    plain = _pack(_random_pairs(3, seed=2))
    shared = share_pair_prompts(plain)
    root = ScoreRoot(load_hf_model(folder, dtype=torch.float64, device="cpu"), std=0.5, seed=1).double().train()
    results = []
    for pack in (plain, shared):
        chosen, rejected = pair_rewards(root(pack), pack)
        (-torch.nn.functional.logsigmoid(chosen - rejected)).mean().backward()
        results.append(((chosen.detach(), rejected.detach()), _grads(root)))
    # the head runs in float32 (as the scorer does): float64 hidden states equal to ~1e-15, rounded once to float32
    for got, want in zip(results[1][0], results[0][0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    _assert_same_grads(results[1][1], results[0][1])


@pytest.fixture(scope="module", params=["tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_internvl"])
def vl_pack(request, tmp_path_factory):
    from megatron_vlm.data.config import DataConfig
    from megatron_vlm.data.preference_loader import build_preference_dataloader
    from megatron_vlm.data.processor import load_processor

    tmp = tmp_path_factory.mktemp("pair_prompts_vl")
    folder = synthesize_model_folder(request.param, tmp / "m", seed=0)
    cfg = DataConfig(type="synthetic_vqa", synthetic_dir=str(tmp / "data"), synthetic_train_size=12,
                     synthetic_eval_size=0, max_tokens_per_pack=512, num_workers=0, shuffle=False)
    return folder, next(iter(build_preference_dataloader(cfg, load_processor(folder), seed=0, dp_rank=0, dp_size=1)))


def test_pairs_with_images_keep_one_copy_and_score_as_the_plain_pack(vl_pack):
    folder, plain = vl_pack
    pairs = int(plain["num_pairs"])
    shared = share_pair_prompts(plain)
    assert pairs >= 3 and shared["prefix_segments"].tolist()[:3] == [-1, 0, 0]
    keys = [k for k in VISION_KEYS if k in plain]
    assert "pixel_values" in keys
    for key in keys:  # the prompt's image once per pair
        assert shared[key].shape[0] * 2 == plain[key].shape[0], key
    model = TokenLogprobModel(load_hf_model(folder, dtype=torch.float64, device="cpu")).train()
    results = []
    for pack in (plain, shared):
        c, r, n_c, n_r = pair_sums(model(pack), pack)
        sigmoid_loss(c, r, c.detach() + 0.3, r.detach() - 0.2, n_c, n_r, beta=0.1).mean().backward()
        results.append(((c.detach(), r.detach(), n_c, n_r), _grads(model)))
    for got, want in zip(results[1][0], results[0][0]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    _assert_same_grads(results[1][1], results[0][1])
    assert any(name.startswith(("model.visual.", "model.vision_tower.")) for name in results[1][1])  # trained through
    other = dict(plain)  # pair 0's rejected sequence with another image: that pair stays plain, the others share
    rows = int(plain["vision_rows"][1, 0])
    start = int(plain["vision_rows"][0, 0])
    other["pixel_values"] = plain["pixel_values"].clone()
    other["pixel_values"][start:start + rows] += 1.0
    mixed = share_pair_prompts(other)
    assert mixed["prefix_segments"].tolist()[:4] == [-1, -1, -1, 2]
    assert mixed["pixel_values"].shape[0] == plain["pixel_values"].shape[0] - rows * (pairs - 1)
    assert share_pair_prompts({k: v for k, v in plain.items() if k != "vision_rows"})["input_ids"] is plain["input_ids"]


def test_sharing_is_refused_where_the_layout_does_not_hold():
    takes = SimpleNamespace(takes_input=lambda key: True)
    dims = SimpleNamespace(tp=1, cp=1)
    assert pair_sharing(SimpleNamespace(model=takes, dims=dims, moe_balancer=None, pipeline=None))[0]
    no_prefix = SimpleNamespace(takes_input=lambda key: False)  # a Mamba2 decoder
    assert not pair_sharing(SimpleNamespace(model=no_prefix, dims=dims, moe_balancer=None, pipeline=None))[0]
    assert not pair_sharing(SimpleNamespace(model=takes, dims=SimpleNamespace(tp=2, cp=1), moe_balancer=None,
                                            pipeline=None))[0]
    aux = SimpleNamespace(cfg=SimpleNamespace(aux_loss_coef=0.01))
    assert not pair_sharing(SimpleNamespace(model=takes, dims=dims, moe_balancer=aux, pipeline=None))[0]


def test_prompt_sharing_off_keeps_pair_packs_plain():
    """`dpo.prompt_sharing` / `reward.prompt_sharing = "off"`: the packs stay as the loader gives them (GRPO's
    rl.update.prompt_sharing counterpart: a way back to the plain layout, e.g. to compare or to rule it out)."""
    from megatron_vlm.training.dpo.config import DPOConfig
    from megatron_vlm.training.pair_step import PackScorer
    from megatron_vlm.training.reward.config import RewardTrainConfig

    takes = SimpleNamespace(takes_input=lambda key: True)
    bundle = SimpleNamespace(model=takes, dims=SimpleNamespace(tp=1, cp=1), moe_balancer=None, pipeline=None)
    on, _ = pair_sharing(bundle, "auto")
    off, why = pair_sharing(bundle, "off", key="dpo.prompt_sharing")
    assert on and not off and "dpo.prompt_sharing" in why
    for section, mode in ((DPOConfig, "dpo"), (RewardTrainConfig, "reward")):
        with pytest.raises(ValueError, match="prompt_sharing"):
            section(prompt_sharing="never").validate()
        for setting, shared in (("auto", True), ("off", False)):
            cfg = SimpleNamespace(train=SimpleNamespace(mode=mode), dpo=None, reward=None)
            setattr(cfg, mode, section(prompt_sharing=setting))
            scorer = PackScorer()
            scorer.bundle = bundle
            scorer._decide_sharing(SimpleNamespace(cfg=cfg, env=SimpleNamespace(rank=1)))
            assert scorer.share_prompts is shared
            pack = _pack(_random_pairs(2))
            assert ("prefix_segments" in scorer.prepared(pack)) is shared
