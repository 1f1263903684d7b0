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
from megatron_vlm.data.processing import estimate_length, process_record

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


@pytest.fixture(scope="module")
def bos_proc(proc):
    """A tokenizer whose post-processor adds a BOS (as Llama-style tokenizers do) under a template that writes
    `{{ bos_token }}` itself."""
    from tokenizers import processors

    out = copy.copy(proc)
    out.tokenizer = copy.deepcopy(proc.tokenizer)
    out.tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = out.tokenizer.convert_tokens_to_ids("<s>")
    out.tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    out.chat_template = "{{ bos_token }}" + TEMPLATE
    return out


def test_a_template_that_writes_the_bos_gets_one_bos(bos_proc):
    """transformers' `apply_chat_template(tokenize=True)` (tokenizer's and processor's) adds no special tokens to a
    rendering that starts with the BOS; the pipeline added the tokenizer's own in front: two BOS ids per sample."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "red"}]
    record = Record(msgs, "m", 0)
    sample = process_record(record, bos_proc, max_frames=4)
    ref = bos_proc.tokenizer.apply_chat_template(msgs, chat_template=bos_proc.chat_template, tokenize=True,
                                                 return_dict=True)
    assert sample.input_ids.tolist() == ref["input_ids"]
    assert estimate_length(record, bos_proc, max_frames=4) == len(ref["input_ids"])
    assert bos_proc.tokenizer.decode(sample.input_ids[sample.label_mask]) == "red<|im_end|>"


def test_a_multi_turn_reply_chunk_gets_no_bos(bos_proc):
    """A multi-turn rollout's reply chunk continues a conversation: tokenized with the tokenizer's special tokens
    on, a BOS-adding tokenizer put a BOS inside the conversation at every turn."""
    from megatron_vlm.rl.env.base import Observation
    from megatron_vlm.rl.env.turns import TurnEncoder

    proc = copy.copy(bos_proc)  # the template writes the BOS at the start of the conversation, before any reply
    proc.chat_template = bos_proc.chat_template + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    bos = proc.tokenizer.convert_tokens_to_ids("<s>")
    chunk, _ = TurnEncoder(proc).encode([{"role": "user", "content": "q"}], "red", True, Observation(text="again"))
    assert bos not in chunk.input_ids.tolist() and len(chunk.input_ids) > 0
