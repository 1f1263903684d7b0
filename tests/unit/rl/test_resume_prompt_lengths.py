"""A GRPO / PPO resume refuses train prompts whose token lengths changed since the checkpoint.

The prompt order is a function of the prompts kept at start-up (those that fit `data.max_tokens_per_pack` minus the
generation budget), `train.seed` and `rl.batch.prompts_per_step`; the data state recorded the kept count, not which
prompts were kept. Another image size setting (here `data.min_pixels` / `data.max_pixels`: a small image grows, a
large one shrinks) made the filter keep another prompt in place of one of the checkpoint's, with as many kept: the
resume drew other prompts at the same positions, silently. The state now holds a digest of every prompt's length
and the settings they were measured with; a different digest is exit 2 naming the setting that differs. A
checkpoint written before the digest resumes, with one warning.
"""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from PIL import Image

from megatron_vlm.data.config import DataConfig
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.prompts.data_state import grpo_data_state, grpo_data_state_refusal
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.lengths import drop_unusable_prompts
from megatron_vlm.rl.prompts.sets import PromptSets
from megatron_vlm.rl.trainer import GRPOLoopStep

SIZE_KEYS = "data.min_pixels / data.max_pixels / data.video_min_pixels / data.video_max_pixels"


def _row(image: str, words: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                                 {"type": "text", "text": "word " * words}]},
                                    {"role": "assistant", "content": "x"}]}) + "\n"


@pytest.fixture
def prompts(tmp_path):
    Image.new("RGB", (28, 28), (200, 30, 30)).save(tmp_path / "small.png")
    Image.new("RGB", (224, 224), (30, 200, 30)).save(tmp_path / "big.png")
    path = tmp_path / "p.jsonl"
    path.write_text(_row("small.png", 20) + _row("big.png", 10) + _row("small.png", 1))
    return path


def _kept(path, proc, **pixels):
    """The train set a run keeps at start-up: budget 112 - 12 = 100 prompt tokens."""
    data_cfg = DataConfig(type="messages_jsonl", max_tokens_per_pack=112)
    rl_cfg = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=8), eval=SimpleNamespace(max_new_tokens=12))
    sets = PromptSets(load_prompt_dataset(path, schema="messages"), None)
    return drop_unusable_prompts(sets, proc.with_overrides(**pixels), data_cfg, rl_cfg).train


def _step(train_set) -> GRPOLoopStep:
    step = GRPOLoopStep.__new__(GRPOLoopStep)
    step.seed, step.train_set = 0, train_set
    step.rl = SimpleNamespace(batch=SimpleNamespace(prompts_per_step=1))
    step._files = None
    step._lengths = getattr(train_set, "start_lengths", None)
    return step


THEN = dict(min_pixels=56 * 56, max_pixels=224 * 224)
NOW = dict(min_pixels=112 * 112, max_pixels=112 * 112)


def test_another_image_size_keeping_other_prompts_is_refused_naming_the_setting(prompts, proc):
    then, now = _kept(prompts, proc, **THEN), _kept(prompts, proc, **NOW)
    # the small image's prompt no longer fits, the large one's now does: as many prompts, other ones
    assert [s.index for s in then.samples] == [1, 3] and [s.index for s in now.samples] == [2, 3]
    saved = grpo_data_state(5, **_step(then)._order(), prompt_lengths=_step(then)._prompt_lengths())
    assert saved["num_prompts"] == 2 and "prompt_lengths" in saved
    # what the data state held before: the count, which is the checkpoint's
    assert grpo_data_state_refusal({k: v for k, v in saved.items() if k != "prompt_lengths"},
                                   **_step(now)._order()) is None
    with pytest.raises(ConfigError) as e:
        _step(now).check_data_state(saved)
    msg = str(e.value)
    assert msg.startswith(f"{SIZE_KEYS}: the train prompts' token lengths differ from the checkpoint's"), msg
    assert "other prompts" in msg and 'checkpoint.resume = "none"' in msg and "\n" not in msg, msg
    _step(_kept(prompts, proc, **THEN)).check_data_state(saved)  # the same settings: resumes


def test_a_checkpoint_without_the_lengths_digest_resumes_with_one_warning(prompts, proc, caplog, monkeypatch):
    from megatron_vlm.rl.prompts import data_state

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(data_state, "_warned", False)
    old = {"next_step": 5, "seed": 0, "num_prompts": 2, "prompts_per_step": 1}
    with caplog.at_level(logging.WARNING, logger="megatron_vlm"):
        _step(_kept(prompts, proc, **NOW)).check_data_state(old)
        _step(_kept(prompts, proc, **THEN)).check_data_state(old)
    warned = [r.getMessage() for r in caplog.records if "token lengths" in r.getMessage()]
    assert len(warned) == 1 and "written before" in warned[0], warned


def test_another_prompt_set_leaves_the_count_refusal_its_say(prompts, proc, tmp_path):
    """A set of other size under the same settings (a synthetic set resized): the kept-count refusal names it, not
    a change of images."""
    then = _kept(prompts, proc, **THEN)
    saved = grpo_data_state(5, **_step(then)._order(), prompt_lengths=_step(then)._prompt_lengths())
    more = tmp_path / "more.jsonl"
    more.write_text(prompts.read_text() + _row("small.png", 2))
    with pytest.raises(ConfigError, match=r"^data\.train_path: the checkpoint was written drawing from 2 train prompts, "
                                          r"this run has 3 "):
        _step(_kept(more, proc, **THEN)).check_data_state(saved)
