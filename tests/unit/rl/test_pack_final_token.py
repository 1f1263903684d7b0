"""GRPO packs leave out every completion's final token (`rl.batching` module docstring): the log-probs and
the gradients equal those of the pack with the final tokens in it (the layout before the change, rebuilt
here by putting each final token back at the end of its segment with no label), on plain and
prompt-shared packs of a text model and on plain packs of a VLM with images (M-RoPE positions)."""
import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.inference.engine import RolloutPrompt
from megatron_vlm.models import build_model
from megatron_vlm.rl.batching import TrainSample, group_by_prompt, pack_samples
from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder
from megatron_vlm.training.lm_loss import TokenLogprobModel
from tests.fixtures import tiny_qwen2_5_vl as F


def _with_final_tokens(batch: dict, samples) -> dict:
    """`batch` with each completion's final token appended to its segment (label -100): the full pack."""
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    cu = batch["cu_seqlens"].tolist()
    prefix = batch.get("prefix_segments", torch.full((len(cu) - 1,), -1)).tolist()
    heads = {p for p in prefix if p >= 0}
    finals = iter(s.response_ids[-1:] for s in samples)
    out_ids, out_labels, out_cu = [], [], [0]
    for seg, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        parts, lab = [ids[a:b]], [labels[a:b]]
        if seg not in heads:  # a completion segment: its final token goes back
            parts.append(next(finals))
            lab.append(torch.tensor([-100]))
        out_ids += parts
        out_labels += lab
        out_cu.append(out_cu[-1] + sum(int(t.numel()) for t in parts))
    assert next(finals, None) is None
    full = dict(batch, input_ids=torch.cat(out_ids)[None], labels=torch.cat(out_labels)[None],
                cu_seqlens=torch.tensor(out_cu, dtype=torch.int32))
    assert full["input_ids"].shape[1] == batch["input_ids"].shape[1] + len(samples)
    return full


def _logp_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    wrapper = TokenLogprobModel(model).train()
    logp = wrapper({k: v for k, v in batch.items() if k != "num_response_tokens"}, temperature=0.9)
    weights = torch.linspace(-1.0, 1.0, logp.numel())
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, samples, share_prompts: bool):
    trimmed = pack_samples(samples, share_prompts=share_prompts)
    full = _with_final_tokens(trimmed, samples)
    lp_t, g_t = _logp_and_grads(model, trimmed)
    lp_f, g_f = _logp_and_grads(model, full)
    assert lp_t.numel() == sum(s.response_length for s in samples)
    torch.testing.assert_close(lp_t, lp_f, atol=1e-6, rtol=0)
    assert g_t.keys() == g_f.keys() and g_t
    for name in g_f:
        torch.testing.assert_close(g_t[name], g_f[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_text_pack_without_final_tokens_equals_full_pack(share_prompts, tmp_path):
    folder = build_tiny_qwen_text_folder(tmp_path / "qwen2", model_type="qwen2")
    model = load_hf_model(str(folder), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = model.lm_head.weight.shape[0]
    prompts = [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (9, 5, 13)]
    samples = [TrainSample(prompt=p, response_ids=torch.randint(0, vocab, (int(n),), generator=g),
                           behav_logp=torch.zeros(int(n)), advantage=0.0)
               for p in prompts for n in torch.randint(1, 7, (3,), generator=g)]
    _assert_same(model, group_by_prompt(samples), share_prompts)


def test_vlm_pack_without_final_tokens_equals_full_pack():
    torch.manual_seed(0)
    model = F.randomize_constants_(build_model(F.tiny_qwen2_5_vl_config_dict()))
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, parts in enumerate(([2, ("image", (1, 4, 6)), 3], [4], [1, ("image", (1, 4, 4)), 2])):
        s = F.build_sample(parts, g)
        prompt = RolloutPrompt(torch.tensor(s["input_ids"]), s["pixel_values"], s["image_grid_thw"])
        resp = torch.tensor(F.text_tokens(2 + i, g))
        samples.append(TrainSample(prompt=prompt, response_ids=resp, behav_logp=torch.zeros(len(resp)), advantage=0.0))
    _assert_same(model, samples, share_prompts=False)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_empty_completion_keeps_its_segment(share_prompts):
    prompt = RolloutPrompt(torch.tensor([5, 6, 7]))
    samples = [TrainSample(prompt=prompt, response_ids=torch.tensor([8, 9], dtype=torch.long), behav_logp=torch.zeros(2),
                           advantage=0.0),
               TrainSample(prompt=prompt, response_ids=torch.zeros(0, dtype=torch.long), behav_logp=torch.zeros(0),
                           advantage=0.0)]
    batch = pack_samples(samples, share_prompts=share_prompts)
    cu = batch["cu_seqlens"].tolist()
    assert all(b > a for a, b in zip(cu[:-1], cu[1:]))  # no empty segment
    if share_prompts:  # [5, 6] | [7, 8] (9 left out) | [7]
        assert batch["input_ids"][0].tolist() == [5, 6, 7, 8, 7] and cu == [0, 2, 4, 5]
    else:  # [5, 6, 7, 8] | [5, 6, 7]
        assert batch["input_ids"][0].tolist() == [5, 6, 7, 8, 5, 6, 7] and cu == [0, 4, 7]
    assert batch["labels"][0].tolist().count(-100) == batch["input_ids"].shape[1] - 2
