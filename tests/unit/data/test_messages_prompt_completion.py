"""TRL's conversational prompt-completion rows in a messages JSONL file (`data.type = "messages_jsonl"`).

TRL's vision SFT sets are written {"prompt": [messages without the reply], "completion": [the assistant message]
or a string, "images": [...]}; SFTTrainer trains the prompt's turns followed by the completion. The `hf` source read
them (columns = {prompt = "prompt", answer = "completion"}), but the messages reader refused every such line as
"no 'messages' or 'conversations' key", so a TRL file named as messages data was "no usable samples". Each line must
now train what transformers' chat template gives for the joined conversation: the same tokens, pixels and mask.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_vlm.data.bad_records import BadRecordError, BadRecordLog
from megatron_vlm.data.messages import read_messages_jsonl, record_from_messages_row
from megatron_vlm.data.processing import process_record

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
COMPLETION = [{"role": "assistant", "content": "Red."}]


def test_tokens_and_pixels_are_transformers_for_the_joined_conversation(proc, hf_processor, tmp_path, write_image):
    png = write_image(tmp_path / "x.png", size=(56, 56), seed=3)
    row = {"prompt": PROMPT, "completion": COMPLETION, "images": ["x.png"]}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    log = BadRecordLog()
    recs = read_messages_jsonl(tmp_path / "t.jsonl", bad_records=log)
    assert len(recs) == 1 and len(log) == 0
    ours = process_record(recs[0], proc, max_frames=4)
    conv = [{"role": "user", "content": [{"type": "image", "path": str(png)}, {"type": "text", "text": "What colour is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    ref = hf_processor.apply_chat_template(conv, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), rtol=0, atol=0)
    assert proc.tokenizer.decode(ours.input_ids[ours.label_mask]) == "Red.<|im_end|>"


@pytest.mark.parametrize("completion", ["Red.", COMPLETION, COMPLETION[0]])
def test_a_completion_is_a_string_or_one_assistant_message(completion):
    rec = record_from_messages_row({"prompt": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Colour?"}],
                                    "completion": completion, "id": 7}, lambda r: r, source="t", index=1)
    assert rec.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Colour?"},
                            {"role": "assistant", "content": "Red."}]
    assert rec.meta == {"id": 7}


@pytest.mark.parametrize("row, category, match", [
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "c"}], "completion": "d"}, "invalid_record", "assistant turn"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "d"}]},
     "invalid_record", "one assistant message"),
    ({"prompt": PROMPT, "completion": COMPLETION}, "placeholder_mismatch", "image"),      # an image item, no image
    ({"prompt": [{"role": "user", "content": "a"}], "completion": COMPLETION, "images": ["x.png"]},
     "placeholder_mismatch", "image"),
    ({"prompt": "The sky is", "completion": " blue."}, "invalid_record", "data.type"),  # TRL's standard (text) form
])
def test_rows_that_cannot_train_as_written_are_bad_records(row, category, match):
    with pytest.raises(BadRecordError, match=match) as e:
        record_from_messages_row(row, lambda r: r, source="t", index=1)
    assert e.value.category == category


def test_a_folder_takes_a_one_line_json_file_of_such_rows(tmp_path):
    row = {"prompt": [{"role": "user", "content": "Colour?"}], "completion": "Red."}
    (tmp_path / "a.json").write_text(json.dumps(row) + "\n")                 # one JSON line named .json
    (tmp_path / "dataset_info.json").write_text(json.dumps({"features": {}}))  # metadata beside it: not data
    recs = read_messages_jsonl(tmp_path)
    assert [r.messages[-1]["content"] for r in recs] == ["Red."]
