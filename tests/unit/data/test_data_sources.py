"""Sources: messages JSONL (data/messages.py format, relative paths, malformed lines logged by line), HF
datasets from local parquet / jsonl / arrow with column mappings, the bad-records summary, and the
[data] config's validation."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_vlm.data.bad_records import BadRecordLog
from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.messages import read_messages_jsonl


def _line(messages, **extra):
    return json.dumps({"messages": messages, **extra})


def test_messages_jsonl_paths_turns_and_bad_lines(tmp_path, write_image):
    write_image(tmp_path / "img/a.png")
    good = _line([{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "image", "image": "img/a.png"},
                                               {"type": "video", "video": ["img/a.png", "img/a.png"]},
                                               {"type": "text", "text": "What?"}]},
                  {"role": "assistant", "content": "A."},
                  {"role": "user", "content": "More?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "No."}]}], answer="A.")
    lines = [
        good,
        "{not json",
        "",
        json.dumps([1, 2]),
        json.dumps({"msgs": []}),
        _line([{"role": "user", "content": "only a question"}]),
        _line([{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]),
        _line([{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}, {"role": "assistant", "content": "y"}]),
        good,
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    log = BadRecordLog()
    recs = read_messages_jsonl(path, bad_records=log)
    assert [r.index for r in recs] == [1, 9]
    r = recs[0]
    assert r.images() == [str(tmp_path / "img/a.png")]
    assert r.videos()[0]["video"] == [str(tmp_path / "img/a.png")] * 2
    assert r.messages[4] == {"role": "assistant", "content": "No."} and r.meta == {"answer": "A."}
    bad = {(b.index, b.category) for b in log.entries}
    assert bad == {(2, "malformed_json"), (4, "malformed_json"), (5, "invalid_record"), (6, "invalid_record"),
                   (7, "invalid_record"), (8, "invalid_record")}
    assert any("messages[0].role" in b.detail for b in log.entries if b.index == 7)
    # image_root overrides the JSONL's folder
    recs = read_messages_jsonl(path, image_root="/data/root")
    assert recs[0].images() == ["/data/root/img/a.png"]


def test_bad_record_summary_json_and_text(tmp_path):
    log = BadRecordLog()
    log.add("a.jsonl", 3, "missing_image", "file not found: x.png")
    log.add("a.jsonl", 3, "missing_image", "file not found: x.png")  # seen again next epoch
    log.add("b.parquet", 0, "too_long", "5000 tokens > 4096")
    d = json.loads(log.write_summary(tmp_path / "bad.json").read_text())
    assert d["num_bad_records"] == 2 and d["num_skips"] == 3
    assert d["by_category"] == {"missing_image": 1, "too_long": 1}
    assert {(r["source"], r["index"], r["skips"]) for r in d["records"]} == {("a.jsonl", 3, 2), ("b.parquet", 0, 1)}
    text = log.write_summary(tmp_path / "bad.txt").read_text()
    assert "a.jsonl:3: missing_image: file not found: x.png" in text


def _png_bytes(write_image, tmp_path, name, size):
    return write_image(tmp_path / name, size=size).read_bytes()


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "arrow"])
def test_hf_prompt_answer_columns(tmp_path, write_image, fmt):
    import datasets

    png = _png_bytes(write_image, tmp_path, "x.png", (56, 84))
    write_image(tmp_path / "rel.png")
    rows = {"problem": ["<image>Find x.", "What is 2+2?"], "solution": ["12", "4"],
            "picture": [[{"bytes": png, "path": None}], []], "level": [1, 2]}
    if fmt == "jsonl":  # json files hold paths, not bytes
        rows["picture"] = [["rel.png"], []]
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps({k: v[i] for k, v in rows.items()}) + "\n" for i in range(2)))
    else:
        ds = datasets.Dataset.from_dict(rows, features=datasets.Features({
            "problem": datasets.Value("string"), "solution": datasets.Value("string"),
            "picture": datasets.List(datasets.Image()), "level": datasets.Value("int64")}))
        if fmt == "parquet":
            path = tmp_path / "d.parquet"
            ds.to_parquet(str(path))
        else:
            ds.save_to_disk(str(tmp_path / "saved"))
            path = next((tmp_path / "saved").glob("*.arrow"))
    from megatron_vlm.data.hf_source import HFRecords

    src = HFRecords(path, {"prompt": "problem", "answer": "solution", "images": "picture"},
                    cache_dir=str(tmp_path / "cache"))
    assert len(src) == 2
    r0, r1 = src.get(0), src.get(1)
    user = r0.messages[0]["content"]
    assert [it["type"] for it in user] == ["image", "text"] and user[1]["text"] == "Find x."
    ref = user[0]["image"]
    if fmt == "jsonl":
        assert ref == str(tmp_path / "rel.png")
    else:
        assert ref["bytes"] == png  # not decoded
    assert r0.messages[1] == {"role": "assistant", "content": "12"}
    assert r0.meta == {"level": 1, "answer": "12"} and r0.source == str(path)
    assert (r0.index, r1.index) == ((1, 2) if fmt == "jsonl" else (0, 1))  # a JSONL row is named by its 1-based line
    assert [it["type"] for it in r1.messages[0]["content"]] == ["text"]


def test_hf_messages_column_fills_image_items_from_images_column(tmp_path, write_image):
    import datasets

    png = _png_bytes(write_image, tmp_path, "y.png", (56, 56))
    msgs = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    ds = datasets.Dataset.from_dict({"messages": [msgs, msgs], "images": [[png], []]},
                                    features=datasets.Features({
                                        "messages": [{"role": datasets.Value("string"), "content": [
                                            {"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
                                        "images": datasets.List(datasets.Image())}))
    ds.to_parquet(str(tmp_path / "m.parquet"))
    from megatron_vlm.data.bad_records import BadRecordError
    from megatron_vlm.data.hf_source import HFRecords

    src = HFRecords(tmp_path / "m.parquet", {"messages": "messages", "images": "images"},
                    cache_dir=str(tmp_path / "cache"))
    r = src.get(0)
    assert r.images()[0]["bytes"] == png and r.messages[1]["content"] == "red"
    with pytest.raises(BadRecordError) as e:  # row 1: one image item, no image
        src.get(1)
    assert e.value.category == "placeholder_mismatch"
    with pytest.raises(ValueError, match="columns \\['nope'\\] not in the dataset"):
        HFRecords(tmp_path / "m.parquet", {"messages": "nope"}, cache_dir=str(tmp_path / "cache"))


# (a missing train_path is a whole-config check: evaluation jobs have none; tests/unit/eval, tests/unit/training;
# so is an hf table without columns: GRPO detects the layout, every other mode refuses it,
# tests/unit/rl/test_framework_prompts.py)
@pytest.mark.parametrize("kwargs, field", [
    ({"type": "hf", "train_path": "x", "columns": {"prompt": "q"}}, "columns"),
    ({"type": "hf", "train_path": "x", "columns": {"messages": "m", "imagez": "i"}}, "columns"),
    ({"train_path": "x", "min_pixels": 0}, "min_pixels"),
    ({"train_path": "x", "min_pixels": 5000, "max_pixels": 4000}, "min_pixels"),
    ({"train_path": "x", "max_frames": 0}, "max_frames"),
    ({"train_path": "x", "max_tokens_per_pack": 8}, "max_tokens_per_pack"),
    ({"train_path": "x", "num_workers": -1}, "num_workers"),
    ({"type": "synthetic_vqa", "synthetic_image_size": 50}, "synthetic_image_size"),
])
def test_data_config_validate_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        DataConfig(**kwargs).validate()
    DataConfig(type="synthetic_vqa").validate()
    DataConfig(type="hf", train_path="x", columns={"prompt": "q", "answer": "a", "image": "img"}).validate()


def test_data_config_through_the_strict_toml_loader():
    from megatron_vlm.config import loader

    cfg = loader.from_dict(DataConfig, {"type": "hf", "train_path": "d.parquet", "columns": {"prompt": "q", "answer": "a"},
                                        "max_pixels": 50176, "num_workers": 0}, "data")
    assert cfg.columns == {"prompt": "q", "answer": "a"} and cfg.max_pixels == 50176 and cfg.min_pixels is None
    with pytest.raises(loader.ConfigError, match="data.max_frame"):
        loader.from_dict(DataConfig, {"max_frame": 3}, "data")


def test_hf_messages_column_refuses_images_no_item_takes(tmp_path, write_image):
    """An images column whose images no image item or "<image>" text marker of the messages takes is a
    placeholder mismatch, as transformers' processor says for the same text and images, not a sample trained
    without its image; text markers (ms-swift's layout) take the images at their places."""
    write_image(tmp_path / "a.png")
    rows = [{"messages": [{"role": "user", "content": "What colour?"}, {"role": "assistant", "content": "red"}],
             "images": ["a.png"]},
            {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                          {"role": "assistant", "content": "red"}], "images": ["a.png"]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "images": []}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from megatron_vlm.data.bad_records import BadRecordError
    from megatron_vlm.data.hf_source import HFRecords

    src = HFRecords(tmp_path / "m.jsonl", {"messages": "messages", "images": "images"})
    with pytest.raises(BadRecordError) as e:
        src.get(0)
    assert e.value.category == "placeholder_mismatch" and "0 image items" in e.value.detail
    assert src.get(1).images() == [str(tmp_path / "a.png")]
    assert src.get(2).images() == []
    marked = [{"role": "user", "content": "<image>\nWhat colour?"}, {"role": "assistant", "content": "red"}]
    (tmp_path / "k.jsonl").write_text(json.dumps({"messages": marked, "images": ["a.png"]}) + "\n")
    rec = HFRecords(tmp_path / "k.jsonl", {"messages": "messages", "images": "images"}).get(0)
    assert rec.images() == [str(tmp_path / "a.png")] and rec.messages[0]["content"][1]["text"] == "\nWhat colour?"


def test_image_as_base64_data_url_equals_the_image_file(tmp_path, write_image, proc):
    """OpenAI-style {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} (and a data URL as
    "image") is the embedded image, as transformers' load_image reads it, not a relative file name; a data URL
    that is not valid base64 is a counted bad record."""
    import base64

    from megatron_vlm.data.bad_records import BadRecordLog
    from megatron_vlm.data.messages import read_messages_jsonl
    from megatron_vlm.data.processing import process_record

    png = write_image(tmp_path / "img" / "a.png", size=(56, 84), seed=3)
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()

    def row(item):
        return json.dumps({"messages": [{"role": "user", "content": [item, {"type": "text", "text": "Colour?"}]},
                                        {"role": "assistant", "content": "red"}]}) + "\n"

    (tmp_path / "d.jsonl").write_text(row({"type": "image", "image": "img/a.png"})
                                      + row({"type": "image_url", "image_url": {"url": url}})
                                      + row({"type": "image", "image": url})
                                      + row({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}))
    log = BadRecordLog()
    recs = read_messages_jsonl(tmp_path / "d.jsonl", bad_records=log)
    assert [r.index for r in recs] == [1, 2, 3]
    assert [(b.index, b.category) for b in log.entries] == [(4, "corrupt_image")]
    ref = process_record(recs[0], proc, max_frames=4)
    for r in recs[1:]:
        out = process_record(r, proc, max_frames=4)
        assert torch.equal(out.input_ids, ref.input_ids) and torch.equal(out.pixel_values, ref.pixel_values)
