"""TRL's conversational prompt-completion layout for SFT ({"prompt": [messages], "completion": [assistant message]},
+ "images"), read with `columns = {prompt = "prompt", answer = "completion"}`: the conversation is the prompt's turns
then the completion, as TRL's SFTTrainer joins them, and it trains on the completion only. It was refused row by
row ("column 'prompt': expected text, got list"), so a whole TRL set was "no usable samples" (exit 2)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.hf_source import HFRecords, record_from_columns
from megatron_vlm.data.processing import process_record

COLS = {"prompt": "prompt", "answer": "completion", "images": "images"}
PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
COMPLETION = [{"role": "assistant", "content": "Red."}]


def test_tokens_and_pixels_are_transformers_for_the_joined_conversation(proc, hf_processor, tmp_path, write_image):
    png = write_image(tmp_path / "x.png", size=(56, 56), seed=3)
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": PROMPT, "completion": COMPLETION, "images": ["x.png"]}) + "\n")
    rec = HFRecords(tmp_path / "t.jsonl", COLS).get(0)
    ours = process_record(rec, proc, max_frames=4)
    conv = [{"role": "user", "content": [{"type": "image", "path": str(png)}, {"type": "text", "text": "What colour is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    ref = hf_processor.apply_chat_template(conv, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    trained = proc.tokenizer.decode(ours.input_ids[ours.label_mask])
    assert trained == "Red.<|im_end|>"
    assert rec.meta["answer"] == "Red."


@pytest.mark.parametrize("completion", ["Red.", [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]])
def test_a_completion_is_a_string_or_one_assistant_message(tmp_path, completion):
    rec = record_from_columns({"prompt": [{"role": "user", "content": "Colour?"}], "completion": completion}, COLS,
                              root=tmp_path, source="t.jsonl", index=1)
    assert rec.messages == [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "Red."}]


@pytest.mark.parametrize("row, category", [
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "c"}], "completion": "d"}, "invalid_record"),  # would train the prompt's turn
    ({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "d"}]}, "invalid_record"),
    ({"prompt": PROMPT, "completion": COMPLETION}, "placeholder_mismatch"),                  # an image item, no image
    ({"prompt": [{"role": "user", "content": "a"}], "completion": COMPLETION, "images": ["x.png"]}, "placeholder_mismatch"),
])
def test_rows_that_cannot_train_as_written_are_bad_records(tmp_path, row, category):
    with pytest.raises(BadRecordError) as e:
        record_from_columns(row, COLS, root=tmp_path, source="t.jsonl", index=1)
    assert e.value.category == category
