"""GRPO messages rows read image items under the keys SFT reads them (transformers' "url" / "path" / "base64",
qwen-vl-utils' "file://" paths): the same file must give both the same images. They were counted bad
("placeholder_mismatch": an item "without a path", or "image file not found: .../file:/...")."""
import base64
import json

from PIL import Image

from megatron_vlm.rl.prompts.dataset import load_prompt_dataset


def test_messages_rows_read_every_image_item_key(tmp_path):
    Image.new("RGB", (28, 28), "red").save(tmp_path / "a.png")
    raw = (tmp_path / "a.png").read_bytes()
    items = [{"type": "image", "url": "a.png"}, {"type": "image", "path": str(tmp_path / "a.png")},
             {"type": "image", "image": f"file://{tmp_path / 'a.png'}"},
             {"type": "image", "base64": base64.b64encode(raw).decode()}]
    rows = [{"messages": [{"role": "user", "content": [it, {"type": "text", "text": "Colour?"}]}], "answer": "red"}
            for it in items]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompt_dataset(tmp_path / "m.jsonl")
    assert [(b.index, b.category) for b in got.bad_records.entries] == []
    assert [s.images() for s in got.samples] == [[str(tmp_path / "a.png")]] * 3 + [[raw]]


def test_a_message_that_is_no_object_is_an_invalid_record(tmp_path):
    """A messages row holding something other than a message object is the invalid record SFT counts, naming the
    message; it was an AttributeError counted as "unexpected_error"."""
    good = {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    rows = [good, {"messages": [{"role": "user", "content": "2+2?"}, "oops"], "answer": "4"},
            {"messages": ["oops", {"role": "user", "content": "2+2?"}], "answer": "4"}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompt_dataset(tmp_path / "m.jsonl")
    assert [(b.index, b.category) for b in got.bad_records.entries] == [(2, "invalid_record"), (3, "invalid_record")]
    assert ["messages[1]" in b.detail for b in got.bad_records.entries] == [True, False]


def test_a_rows_image_columns_are_its_images_not_reward_metadata(tmp_path):
    """A messages row's top-level "images" / "image" are placed in its turns; they were also handed to every reward
    call as metadata (a parquet image struct with its bytes, on every call), unlike a table row's image column."""
    Image.new("RGB", (28, 28), "red").save(tmp_path / "a.png")
    rows = [{"messages": [{"role": "user", "content": "<image>Colour?"}], "answer": "red", key: value, "level": 3}
            for key, value in (("images", ["a.png"]), ("image", "a.png"))]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompt_dataset(tmp_path / "m.jsonl")
    assert [s.images() for s in got.samples] == [[str(tmp_path / "a.png")]] * 2
    assert [s.metadata for s in got.samples] == [{"level": 3}] * 2
