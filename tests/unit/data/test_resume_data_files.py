"""A resume refuses a train file whose content changed, even with as many records and the same byte size.

The data state used to record the record count alone (SFT, the pair trainers) or the prompt count (GRPO): a train
file replaced by another of equal size and record count resumed silently, its position pointing into other
data. The state now records each file's size and a digest of its first and last MiB (`content_signatures`); a
changed file is exit 2 naming it, a copy of the same data elsewhere resumes, and a checkpoint written before the
field existed resumes as before."""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace as NS

import pytest

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.loader import build_sft_dataloader
from megatron_vlm.data.preference_loader import build_preference_dataloader
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.trainer import GRPOLoopStep
from megatron_vlm.training.pair_step import PairStep
from megatron_vlm.training.sft import SFTStep

ANSWERS = ["red", "tan", "sky", "oak", "ivy", "elm"]


def _messages(path, answers):
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: which word?"},
                          {"role": "assistant", "content": a}]} for i, a in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pairs(path, answers):
    rows = [{"prompt": f"Question {i}: which word?", "chosen": a, "rejected": "no"} for i, a in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _swap(path, write):
    """The same file name, size, record count and modification time, other answers."""
    st = path.stat()
    before = path.stat().st_size
    write(path, ANSWERS[::-1])
    assert path.stat().st_size == before
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _cfg(path):
    return DataConfig(train_path=str(path), max_tokens_per_pack=256, num_workers=0)


def _refused(step_cls, loader, state):
    step = step_cls.__new__(step_cls)
    step.loader = loader
    with pytest.raises(ConfigError) as e:
        step.load_data_state(state, 2)
    return str(e.value)


@pytest.mark.parametrize("write, build, step_cls", [
    (_messages, lambda cfg, proc: build_sft_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1), SFTStep),
    (_pairs, lambda cfg, proc: build_preference_dataloader(cfg, proc, seed=0, dp_rank=0, dp_size=1), PairStep),
], ids=["sft", "pairs"])
def test_a_packed_loader_refuses_a_changed_file_of_the_same_size(tmp_path, proc, write, build, step_cls):
    path = write(tmp_path / "train.jsonl", ANSWERS)
    state = {**build(_cfg(path), proc).state_dict(), "global_packs_consumed": 2}

    copy = tmp_path / "elsewhere" / "train.jsonl"  # the same data copied to another folder: resumes
    copy.parent.mkdir()
    shutil.copy(path, copy)
    build(_cfg(copy), proc).load_state_dict(state)
    old = {k: v for k, v in state.items() if k not in ("data_files", "plan_lengths")}  # written before the fields
    _swap(path, write)
    changed = build(_cfg(path), proc)
    changed.load_state_dict(old)

    msg = _refused(step_cls, changed, state)
    assert msg.startswith(f"data.train_path: {path.resolve()} is not the file the checkpoint was written reading: "
                          "other content of the same size"), msg
    assert 'checkpoint.resume = "none"' in msg and "\n" not in msg


def _grpo_step(tmp_path, train_set):
    cfg = NS(train=NS(seed=0), rl=NS(batch=NS(prompts_per_step=2)))
    ctx = NS(cfg=cfg, run_dir=tmp_path, env=NS(is_main=True))
    return GRPOLoopStep(ctx, train_set, NS(shards=NS(rank=0, world=1), policy=NS(critic=None, bundle=NS())), bad_records=BadRecordLog())


def test_grpo_refuses_a_changed_prompt_file_of_the_same_size(tmp_path):
    path = _messages(tmp_path / "prompts.jsonl", ANSWERS)
    state = _grpo_step(tmp_path, load_prompt_dataset(path, schema="messages")).data_state(2)
    old = {k: v for k, v in state.items() if k != "data_files"}
    _swap(path, _messages)
    changed = _grpo_step(tmp_path, load_prompt_dataset(path, schema="messages"))
    changed.load_data_state(old, 2)  # a checkpoint written before the field resumes
    with pytest.raises(ConfigError) as e:
        changed.load_data_state(state, 2)
    assert str(e.value).startswith(f"data.train_path: {path.resolve()} is not the file the checkpoint was written "
                                   "reading: other content of the same size"), str(e.value)


def test_content_signatures_read_both_ends_of_a_large_file(tmp_path):
    from megatron_vlm.data.data_files import changed_data_file, content_signatures

    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (3 << 20))
    before = content_signatures([big])
    data = bytearray(big.read_bytes())
    data[(3 << 20) // 2] = ord("y")  # inside, past both windows: not read (the documented limit)
    big.write_bytes(bytes(data))
    assert changed_data_file(before, content_signatures([big])) is None
    data[-1] = ord("y")
    big.write_bytes(bytes(data))
    assert "other content of the same size" in changed_data_file(before, content_signatures([big]))
    assert changed_data_file(before, content_signatures([big, big])).startswith(
        "the checkpoint was written reading 1 data files, this run reads 2")


def test_a_resume_reading_other_json_files_of_a_folder_says_which_and_how_to_keep_the_old_set(tmp_path, proc):
    """A folder whose .json files were skipped (or read) when the checkpoint was written and are read (skipped) now
    was refused with the record counts alone ("written reading 6 train records, this run reads 8"), naming no file
    and no way to resume. The refusal names the files and, where a glob keeps the checkpoint's set, that glob."""
    from megatron_vlm.data.data_files import content_signatures

    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    _messages(root / "a.jsonl", ANSWERS[:3])
    _messages(root / "sub" / "b.jsonl", ANSWERS[3:])
    (root / "sub" / "llava.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}] * 2))
    jsonl_only = build_sft_dataloader(_cfg(root / "**" / "*.jsonl"), proc, seed=0, dp_rank=0, dp_size=1)
    state = {**jsonl_only.state_dict(), "global_packs_consumed": 2}  # the .json files were not read then

    msg = _refused(SFTStep, build_sft_dataloader(_cfg(root), proc, seed=0, dp_rank=0, dp_size=1), state)
    glob = f'data.train_path = "{root.resolve()}/**/*.jsonl"'
    assert msg.startswith("data.train_path: the checkpoint was written reading 2 data files, this run reads 3: "
                          "this run also reads sub/llava.json"), msg
    assert ".json file" in msg and f"Set {glob} to resume it" in msg and "\n" not in msg, msg
    build_sft_dataloader(_cfg(f"{root.resolve()}/**/*.jsonl"), proc, seed=0, dp_rank=0, dp_size=1).load_state_dict(state)

    # the checkpoint read a .json file this run leaves out (skipped as not data now): named, no glob brings it back
    loader = build_sft_dataloader(_cfg(root), proc, seed=0, dp_rank=0, dp_size=1)
    info = root / "info.json"
    info.write_text(json.dumps({"version": 2}) + "\n")
    files = [root / "a.jsonl", info, root / "sub" / "b.jsonl", root / "sub" / "llava.json"]
    old = {**loader.state_dict(), "global_packs_consumed": 2, "num_records": 9, "data_files": content_signatures(files)}
    msg = _refused(SFTStep, loader, old)
    assert msg.startswith("data.train_path: the checkpoint was written reading 4 data files, this run reads 3: "
                          "the checkpoint also read info.json, which this run does not"), msg
    assert "skipped as not data" in msg and 'checkpoint.resume = "none"' in msg, msg


def test_grpo_names_the_json_files_read_now_and_the_glob_that_keeps_the_old_set(tmp_path):
    from megatron_vlm.data.data_files import content_signatures
    from megatron_vlm.rl.prompts.data_state import grpo_data_state_refusal

    path = _messages(tmp_path / "prompts.jsonl", ANSWERS)
    (tmp_path / "more.json").write_text(json.dumps([{"messages": [{"role": "user", "content": "q"}], "answer": "a"}]))
    old, now = content_signatures([path]), content_signatures([tmp_path / "more.json", path])
    msg = grpo_data_state_refusal({"next_step": 2, "seed": 0, "num_prompts": 6, "prompts_per_step": 2,
                                   "data_files": old}, seed=0, num_prompts=7, prompts_per_step=2, data_files=now)
    assert msg.startswith("data.train_path: the checkpoint was written reading 1 data files, this run reads 2: this "
                          "run also reads more.json"), msg
    assert f'Set data.train_path = "{tmp_path.resolve()}/**/*.jsonl" to resume it' in msg, msg
