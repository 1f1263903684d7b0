"""`data.chat_template_kwargs`: extra chat-template variables, as transformers' `apply_chat_template(**kwargs)` takes
them (verl's `data.apply_chat_template_kwargs`), in every rendering of a run.

Reference: the tokenizer's own `apply_chat_template(..., enable_thinking=False)` over a template written here after
the behaviour of Qwen3's (with `enable_thinking` false the generation prompt and an assistant turn get an empty think
block). A name the template never reads, or one the pipeline sets itself, exits 2 naming the key.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from megatron_vlm.config import load_config_dict
from megatron_vlm.data.lengths import lengths_cache_key
from megatron_vlm.data.messages import Record
from megatron_vlm.data.processing import process_record
from megatron_vlm.errors import ConfigError

THINK = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
         "{% if m['role'] == 'assistant' and enable_thinking is defined and not enable_thinking %}"
         "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n"
         "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
MSGS = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "red"}]


@pytest.fixture()
def think_proc(proc):
    out = copy.copy(proc)
    out.chat_template = THINK
    return out


def test_kwargs_reach_every_rendering_as_transformers_passes_them(think_proc):
    tok = think_proc.tokenizer
    off = think_proc.with_template_kwargs({"enable_thinking": False})
    assert think_proc.template_kwargs == {} and off is not think_proc
    for gen, msgs in ((False, MSGS), (True, MSGS[:1])):
        want = tok.apply_chat_template(msgs, chat_template=THINK, tokenize=False, add_generation_prompt=gen,
                                       enable_thinking=False)
        assert off.render(msgs, add_generation_prompt=gen) == want
        assert "<think>" in want and "<think>" not in think_proc.render(msgs, add_generation_prompt=gen)
    sample = process_record(Record(MSGS, "m", 0), off, max_frames=4)
    ref = tok.apply_chat_template(MSGS, chat_template=THINK, tokenize=True, return_dict=True, enable_thinking=False)
    assert sample.input_ids.tolist() == ref["input_ids"]
    prompt = process_record(Record(MSGS, "m", 0), off, max_frames=4, for_generation=True)  # the answer left out
    assert tok.decode(prompt.input_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_lengths_are_cached_per_template_kwargs(think_proc):
    class Source:
        name, rows = "s", []

        def __len__(self):
            return 0

        def identity(self):
            return {"files": []}

    on = lengths_cache_key(Source(), think_proc, max_frames=4, for_generation=False)
    off = lengths_cache_key(Source(), think_proc.with_template_kwargs({"enable_thinking": False}), max_frames=4,
                            for_generation=False)
    assert on != off


def test_a_name_the_template_never_reads_exits_2(think_proc):
    with pytest.raises(ConfigError, match=r"^data.chat_template_kwargs.enable_thinkng: the chat template .* never reads"):
        think_proc.with_template_kwargs({"enable_thinkng": False})


@pytest.mark.parametrize("name", ["add_generation_prompt", "tools", "chat_template"])
def test_names_the_pipeline_sets_itself_exit_2(name):
    with pytest.raises(ConfigError, match=rf"^data.chat_template_kwargs.{name}: set by the pipeline itself"):
        load_config_dict({"model": {"path": "/m"}, "train": {"max_steps": 1},
                          "data": {"train_path": "/d.jsonl", "chat_template_kwargs": {name: json.dumps(True)}}})


def test_check_refuses_a_name_the_folders_template_never_reads(tmp_path, tiny_dir):
    """`--check` reads the folder's chat template from its files (no tokenizer): a name it never reads fails there,
    as the job would at start; one it reads passes."""
    import io
    import shutil

    from megatron_vlm.config import load_config
    from megatron_vlm.plan.check import run_check

    folder = tmp_path / "m"
    shutil.copytree(tiny_dir, folder)
    (folder / "chat_template.jinja").write_text(THINK)
    demo = Path(__file__).resolve().parents[3] / "launch" / "configs" / "demo_sft.toml"
    for name, code in (("enable_thinking", 0), ("enable_thinkng", 2)):
        out, err = io.StringIO(), io.StringIO()
        cfg = load_config(demo, [f'model.path="{folder}"', f"data.chat_template_kwargs.{name}=false"])
        assert run_check(cfg, world_size=2, device_memory_gib=80.0, out=out, err=err) == code, err.getvalue()
        if code:
            assert err.getvalue().startswith(f"check failed: data.chat_template_kwargs.{name}: the chat template of")
