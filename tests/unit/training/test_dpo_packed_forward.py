"""One packed varlen forward scores each sequence exactly as a forward of that sequence alone.

- DPO: chosen and rejected of several pairs in one pack; `cu_seqlens` keeps the sequences (and their
  images) apart, and `pair_sums` assigns every labelled token to its response. Only the response turn
  is labelled.
- SFT: the loss of a pack from the SFT loader (images of different sizes, a multi-turn answer, a
  text-only sample) equals the sum of its samples' losses, each processed and run alone: M-RoPE
  positions restart per sample, no label crosses a boundary, no prompt token is trained."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.batch import IGNORE_INDEX
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.messages import read_messages_jsonl
from megatron_vlm.data.packing import collate_pack
from megatron_vlm.data.preference_loader import build_preference_dataloader, response_only
from megatron_vlm.data.processing import ProcessedSample, process_record
from megatron_vlm.data.processor import load_processor
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.dpo.sequence import pair_sums
from megatron_vlm.training.lm_loss import TokenLogprobModel


def _sequence(pack: dict, s: int) -> ProcessedSample:
    """Sequence s of a pack as a sample (its tokens, its labels back as a mask, its image)."""
    cu = pack["cu_seqlens"]
    a, b = int(cu[s]), int(cu[s + 1])
    ids = pack["input_ids"][0, a:b]
    labels = pack["labels"][0, a:b]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[1:] = labels[:-1] != IGNORE_INDEX
    per_image = int(pack["image_grid_thw"][0].prod())  # the synthetic images all have one size
    return ProcessedSample(input_ids=ids, label_mask=mask, pixel_values=pack["pixel_values"][s * per_image:(s + 1) * per_image],
                           image_grid_thw=pack["image_grid_thw"][s:s + 1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return synthesize_model_folder("tiny_qwen2_5_vl", tmp_path_factory.mktemp("packed") / "model", seed=0)


def test_one_packed_forward_equals_separate_forwards(tmp_path, folder):
    cfg = DataConfig(type="synthetic_vqa", synthetic_dir=str(tmp_path / "data"), synthetic_train_size=12,
                     synthetic_eval_size=0, max_tokens_per_pack=512, num_workers=0, shuffle=False)
    pack = next(iter(build_preference_dataloader(cfg, load_processor(folder), seed=0, dp_rank=0, dp_size=1)))
    pairs = int(pack["num_pairs"])
    assert pairs >= 3 and len(pack["cu_seqlens"]) == 2 * pairs + 1 and int(pack["image_grid_thw"].shape[0]) == 2 * pairs
    model = TokenLogprobModel(load_hf_model(folder, dtype=torch.float64, device="cpu")).eval()
    with torch.no_grad():
        chosen, rejected, n_c, n_r = pair_sums(model(pack), pack)
        for k in range(pairs):
            for s, got, n in ((2 * k, chosen[k], n_c[k]), (2 * k + 1, rejected[k], n_r[k])):
                alone = collate_pack([_sequence(pack, s)])
                logp = model(alone)
                assert logp.numel() == int(n) >= 2  # the answer token(s) and the turn end
                torch.testing.assert_close(got, logp.sum(), rtol=1e-9, atol=1e-9)
    # chosen and rejected share the prompt (and image) and differ in the response only
    cu = pack["cu_seqlens"]
    c_ids, r_ids = pack["input_ids"][0, cu[0]:cu[1]], pack["input_ids"][0, cu[1]:cu[2]]
    per = int(pack["image_grid_thw"][0].prod())
    assert not torch.equal(c_ids, r_ids) and torch.equal(pack["pixel_values"][:per], pack["pixel_values"][per:2 * per])


def test_response_only_keeps_the_last_assistant_turn():
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    s = response_only(ProcessedSample(input_ids=torch.arange(9), label_mask=mask.clone()))
    assert s.label_mask.tolist() == [False] * 5 + [True] * 3 + [False]


def _sft_records(tmp_path) -> str:
    g = torch.Generator().manual_seed(0)
    for name, (w, h) in {"a.png": (56, 84), "b.png": (112, 56)}.items():
        px = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        Image.fromarray(px).save(tmp_path / name)
    rows = [
        [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Colour?"}]},
         {"role": "assistant", "content": "red"},
         {"role": "user", "content": "And the shape?"}, {"role": "assistant", "content": "a circle"}],
        [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "four"}],
        [{"role": "user", "content": [{"type": "text", "text": "Count them:"}, {"type": "image", "image": "b.png"}]},
         {"role": "assistant", "content": "3 shapes"}],
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return str(path)


def test_sft_pack_loss_is_the_sum_of_the_samples_losses_alone(tmp_path, folder):
    proc = load_processor(folder)
    path = _sft_records(tmp_path)
    cfg = DataConfig(type="messages_jsonl", train_path=path, max_tokens_per_pack=1024, num_workers=0, shuffle=False)
    pack = next(iter(build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)))
    assert int(pack["num_samples"]) == 3 and pack["image_grid_thw"].shape[0] == 2
    model = TokenLogprobModel(load_hf_model(folder, dtype=torch.float64, device="cpu")).eval()
    with torch.no_grad():
        packed = model(pack)
        alone = [model(collate_pack([process_record(r, proc, max_frames=4)])) for r in read_messages_jsonl(path)]
    assert packed.numel() == int(pack["num_label_tokens"]) == sum(x.numel() for x in alone)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-9, atol=1e-9)  # token by token, in sample order
    torch.testing.assert_close(packed.sum(), sum(x.sum() for x in alone), rtol=1e-12, atol=1e-9)
