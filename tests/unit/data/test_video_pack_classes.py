"""Videos of different tile sizes in SFT and preference packing: planned apart, never dropped.

Nemotron-VL keeps each video's frames at the video's own tile size ([frames, 3, H, W]), so videos of two aspect
ratios cannot share a pack. The packers planned by token count alone and dropped, as a "video" bad record, every
sample whose video could not join its pack: on mixed aspect ratios a large share of the data. The length pass now
also gives each record's pack class (from the same video headers) and the planner packs a class only with its own
or with class 0 (no such video), so every sample is trained; the plan stays a pure function of the data, the
seed and the epoch, and a resumed loader continues the same stream.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.packing import first_fit_pack, first_fit_pack_classes
from megatron_vlm.data.preference_loader import build_preference_dataloader
from megatron_vlm.data.processor import load_processor
from megatron_vlm.testing.tiny_nemotron_vl import add_tiny_video_processing, build_tiny_nemotron_vl_folder


def test_first_fit_with_classes():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 300)
    order = rng.permutation(300)
    assert first_fit_pack_classes(lengths, np.zeros(300, dtype=np.int64), order, 64, 8) == \
        first_fit_pack(lengths, order, 64, 8)  # no classes: plain first fit
    classes = rng.choice([0, 0, 5, 9], 300)
    packs = first_fit_pack_classes(lengths, classes, order, 64, 8)
    assert sorted(i for p in packs for i in p) == list(range(300))  # every sample once
    assert all(len({int(classes[i]) for i in p} - {0}) <= 1 for p in packs)  # never two classes in a pack
    assert all(sum(int(lengths[i]) for i in p) <= 64 for p in packs)
    assert any({int(classes[i]) for i in p} == {0, 5} for p in packs)  # class 0 joins the others


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return add_tiny_video_processing(build_tiny_nemotron_vl_folder(tmp_path_factory.mktemp("nem") / "nem", seed=0))


@pytest.fixture(scope="module")
def proc(folder):
    return load_processor(folder)


def _clip(folder, i: int, wide: bool) -> list[str]:
    rng = np.random.default_rng(i)
    size = (128, 48) if wide else (64, 48)  # 8:3 frames get another tile than 4:3 ones
    out = []
    for j in range(2):
        path = folder / f"c{i}_{j}.png"
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
        out.append(str(path))
    return out


def _video_turn(folder, i: int) -> dict:
    return {"role": "user", "content": [{"type": "video", "video": _clip(folder, i, wide=i % 3 == 0)},
                                        {"type": "text", "text": f"clip {i}"}]}


def test_sft_packs_every_video_and_resumes_the_same_stream(proc, tmp_path):
    lines = [json.dumps({"messages": [_video_turn(tmp_path, i), {"role": "assistant", "content": f"answer {i}"}]})
             for i in range(12)]
    lines += [json.dumps({"messages": [{"role": "user", "content": f"text {i}"}, {"role": "assistant", "content": "ok"}]})
              for i in range(4)]
    (tmp_path / "v.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(type="messages_jsonl", train_path=str(tmp_path / "v.jsonl"), max_tokens_per_pack=200,
                     num_workers=0, max_frames=2, shuffle=True)
    loader = build_sft_dataloader(cfg, proc, seed=3, dp_rank=0, dp_size=1)
    per_epoch = loader.packs_per_epoch
    it = iter(loader)
    packs = [next(it) for _ in range(per_epoch)]
    assert loader.bad_records.entries == []  # was: the videos that could not join their pack, as "video"
    assert sum(int(p["num_samples"]) for p in packs) == 16  # every record trained in the epoch
    assert any("pixel_values_videos" in p and p["pixel_values_videos"].shape[1:] != (3, 64, 64) for p in packs)
    # resume after 2 packs (another world size too): the stream goes on as the uninterrupted one
    for dp in (1, 2):
        first = build_sft_dataloader(cfg, proc, seed=3, dp_rank=0, dp_size=1)
        it = iter(first)
        for _ in range(2):
            next(it)
        state = first.state_dict()
        resumed = build_sft_dataloader(cfg, proc, seed=3, dp_rank=0, dp_size=dp)
        resumed.load_state_dict(state)
        got = next(iter(resumed))
        assert got["input_ids"].tolist() == packs[2]["input_ids"].tolist()
    # a checkpoint saved before pack classes (its state has no "pack_classes"; its packs mixed the tile sizes) or of
    # records with other classes: the position would point into another plan, refused
    for stale in ({k: v for k, v in state.items() if k != "pack_classes"}, {**state, "pack_classes": "0" * 16}):
        with pytest.raises(ValueError, match="pack classes"):
            build_sft_dataloader(cfg, proc, seed=3, dp_rank=0, dp_size=1).load_state_dict(stale)
    # text-only data has no classes: a state without the key (before the change) still resumes
    text_only = tmp_path / "t.jsonl"
    text_only.write_text("\n".join(lines[12:]) + "\n")
    tcfg = DataConfig(type="messages_jsonl", train_path=str(text_only), max_tokens_per_pack=200, num_workers=0)
    old_state = build_sft_dataloader(tcfg, proc, seed=3, dp_rank=0, dp_size=1).state_dict()
    assert old_state.pop("pack_classes") is None
    build_sft_dataloader(tcfg, proc, seed=3, dp_rank=0, dp_size=1).load_state_dict(old_state)


def test_preference_pairs_with_videos_of_two_tile_sizes_are_all_packed(proc, tmp_path):
    rows = [json.dumps({"messages": [_video_turn(tmp_path, i)], "chosen": f"right {i}", "rejected": f"wrong {i}"})
            for i in range(9)]
    (tmp_path / "p.jsonl").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(type="messages_jsonl", train_path=str(tmp_path / "p.jsonl"), max_tokens_per_pack=1200,
                     num_workers=0, max_frames=2, shuffle=False)
    loader = build_preference_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)
    it = iter(loader)
    packs = [next(it) for _ in range(loader.packs_per_epoch)]
    assert loader.bad_records.entries == []  # was: the pairs whose video could not join their pack
    assert sorted(i for p in packs for i in p["pair_index"].tolist()) == list(range(9))
    assert len({tuple(p["pixel_values_videos"].shape[1:]) for p in packs}) == 2


def test_held_out_answers_of_a_batch_of_two_tile_sizes(folder, proc, tmp_path):
    """The generation batches of held-out answer accuracy and benchmarks (`mode = "generation"`) concatenated their
    rows' vision tensors: a batch with videos of two tile sizes failed in its loader worker, and the evaluation with
    it. Such a batch now carries each row's own (`row_vision`), and the engine prefills each tile size apart: every
    row gets the answer it gets alone."""

    from megatron_vlm.checkpoint.hf import load_hf_model
    from megatron_vlm.data.loader import build_eval_dataloader
    from megatron_vlm.eval.answer_accuracy import batch_prompts
    from megatron_vlm.inference.engine import SamplingParams
    from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine

    lines = [json.dumps({"messages": [_video_turn(tmp_path, i), {"role": "assistant", "content": f"answer {i}"}]})
             for i in range(3)]  # clip 0 is 8:3, clips 1 and 2 are 4:3
    (tmp_path / "e.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(type="messages_jsonl", train_path=str(tmp_path / "e.jsonl"), eval_path=str(tmp_path / "e.jsonl"),
                     max_tokens_per_pack=600, num_workers=0, max_frames=2)
    loader = build_eval_dataloader(cfg, proc, dp_rank=0, dp_size=1, mode="generation", batch_size=3,
                                   padding_side="left")
    (batch,) = list(loader)  # was: RuntimeError from torch.cat in the batch's collate
    assert "row_vision" in batch and "pixel_values_videos" not in batch
    model = load_hf_model(str(folder)).eval()
    engine = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(pad_token_id=proc.pad_token_id,
                                                                      max_prompts_per_batch=0, eos_token_ids=[-1]))
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    prompts = batch_prompts(batch)
    together = engine.generate(prompts, params)
    assert together.stats["prefill_calls"] == 2  # the 8:3 clip, then the two 4:3 ones
    for p, s in zip(prompts, together.samples):
        assert engine.generate([p], params).samples[0].token_ids.tolist() == s.token_ids.tolist()
