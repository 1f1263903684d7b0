"""A resume refuses a pack plan whose samples' token lengths changed since the checkpoint.

The data state recorded the record count, pack size, seed and file contents, not the lengths the plan is made of:
a resume with another tokenizer, chat template or image size setting (here `data.max_pixels`: fewer image tokens per
record) planned other packs from the same records and continued silently at the checkpoint's position in that other
plan, training on other samples than the uninterrupted run. The state now holds a digest of the lengths and the
settings they were computed with; a different digest is exit 2 naming the setting that differs. A checkpoint written
before the digest resumes, with one warning."""
from __future__ import annotations

import json
import logging

import pytest

from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.errors import ConfigError
from megatron_vlm.training.sft import SFTStep


@pytest.fixture
def train_file(tmp_path, write_image):
    write_image(tmp_path / "x.png", size=(112, 112), seed=0)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "x.png"},
                                                       {"type": "text", "text": f"Question {i}?"}]},
                          {"role": "assistant", "content": "word " * (1 + i % 5)}]} for i in range(12)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _loader(path, proc, **data):
    cfg = DataConfig(train_path=str(path), max_tokens_per_pack=96, num_workers=0, **data)
    return build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1)


def _refusal(loader, state) -> str:
    step = SFTStep.__new__(SFTStep)
    step.loader = loader
    with pytest.raises(ConfigError) as e:
        step.load_data_state(state, 2)
    return str(e.value)


def test_a_resume_with_other_sample_lengths_is_refused_naming_the_setting(train_file, proc):
    before = _loader(train_file, proc)
    state = {**before.state_dict(), "global_packs_consumed": 2}
    _loader(train_file, proc).load_state_dict(state)  # the same settings: resumes

    smaller = _loader(train_file, proc, max_pixels=56 * 56)  # 4 image tokens a record, not 16
    assert (smaller.planner.lengths < before.planner.lengths).all()
    assert smaller.planner.lengths.size == before.planner.lengths.size  # the checks before saw nothing
    msg = _refusal(smaller, state)
    assert msg.startswith("data.min_pixels / data.max_pixels / data.video_min_pixels / data.video_max_pixels: the "
                          "samples' token lengths differ from the checkpoint's"), msg
    assert "would point at other samples" in msg and 'checkpoint.resume = "none"' in msg and "\n" not in msg, msg
    assert "3136" in msg  # the pixel bound now, beside the checkpoint's


def test_lengths_changed_under_the_same_settings_name_the_media(train_file, proc, write_image):
    state = {**_loader(train_file, proc).state_dict(), "global_packs_consumed": 2}
    write_image(train_file.parent / "x.png", size=(56, 56), seed=1)  # the image the records read is smaller now
    msg = _refusal(_loader(train_file, proc), state)
    assert msg.startswith("data.train_path: the samples' token lengths differ from the checkpoint's"), msg
    assert "images or videos" in msg, msg


def test_a_checkpoint_without_the_lengths_digest_resumes_with_one_warning(train_file, proc, caplog, monkeypatch):
    from megatron_vlm.data import plan_lengths

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(plan_lengths, "_warned", False)  # once per process: other tests may have warned already
    state = {**_loader(train_file, proc).state_dict(), "global_packs_consumed": 2}
    old = {k: v for k, v in state.items() if k != "plan_lengths"}
    with caplog.at_level(logging.WARNING, logger="megatron_vlm"):
        _loader(train_file, proc, max_pixels=56 * 56).load_state_dict(old)  # not detected: the warning says so
        _loader(train_file, proc).load_state_dict(old)
    warned = [r.getMessage() for r in caplog.records if "token lengths" in r.getMessage()]
    assert len(warned) == 1 and "written before" in warned[0], warned
