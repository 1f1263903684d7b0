"""The labels mask equals transformers' `assistant_masks` (what TRL's assistant-only loss trains on).

Reference: `tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)` over a template that marks each
assistant turn's content + `<|im_end|>` with `{% generation %}`: every token overlapping a marked span is trained.
With Qwen2's pre-tokenizer regex (`\\s*[\\r\\n]+` keeps a run of newlines in one piece), an answer that starts with
a newline shares its first token with the header's newline; the mask used to keep only tokens that start inside
the answer, so that token (the answer's first) was never trained.
"""
from __future__ import annotations

import copy

import pytest

from megatron_vlm.data.messages import Record
from megatron_vlm.data.processing import process_record

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
            "{% endfor %}")


@pytest.fixture(scope="module")
def qwen2_split_proc(proc):
    from tokenizers import Regex, pre_tokenizers

    out = copy.copy(proc)
    out.tokenizer = copy.deepcopy(proc.tokenizer)
    out.tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    out.chat_template = TEMPLATE
    return out


@pytest.mark.parametrize("answers", [("\n\nred", "  blue\n"), ("red", "\nblue"), ("red\n\n", "blue")])
def test_mask_equals_transformers_assistant_masks(qwen2_split_proc, answers):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answers[0]},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": answers[1]}]
    sample = process_record(Record(msgs, "m", 0), qwen2_split_proc, max_frames=4)
    ref = qwen2_split_proc.tokenizer.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True)
    assert sample.input_ids.tolist() == ref["input_ids"]
    assert sample.label_mask.int().tolist() == ref["assistant_masks"]
