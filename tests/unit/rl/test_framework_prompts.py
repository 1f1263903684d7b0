"""GRPO prompt files in verl's and TRL's layouts, read as they are: verl's preprocessed parquet (written
here the way its geo3k / gsm8k scripts write it, through Hugging Face `datasets`, and through pyarrow with
the same nested struct columns) and TRL GRPOTrainer datasets (standard and conversational prompts,
`image` / `images`, JSONL and parquet); layout detection; bad rows skipped and counted; the [data]
section that reads them (type "hf" without columns, GRPO only)."""
from __future__ import annotations

import pyarrow as pa
import pytest
from PIL import Image

from megatron_vlm.data.data_files import DataFileError
from megatron_vlm.rl.prompts.dataset import detect_schema, load_prompt_dataset
from megatron_vlm.rl.prompts.sets import load_prompt_sets
from tests.fixtures.framework_prompt_tables import (
    VERL_INSTRUCTION,
    png,
    verl_table,
    write_trl_jsonl,
    write_trl_parquet,
    write_verl_geo3k,
)


def _items(msg):
    return [(it["type"], it["text"] if it["type"] == "text" else it["image"]) for it in msg["content"]]


def _verl_row(i, prompt, images=(), gt="4", **extra):
    return {"data_source": "openai/gsm8k", "prompt": prompt, "images": [{"bytes": b, "path": None} for b in images],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"split": "train", "index": i, "answer": gt, "question": "q"}, **extra}


def test_detection_goes_by_reward_model_then_prompt():
    verl = ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]
    assert detect_schema(verl) == "verl"
    assert detect_schema(["prompt", "solution", "image"]) == "trl"
    assert detect_schema(["prompt", "messages", "answer"]) == "trl"  # TRL reads `prompt` where both are kept
    assert detect_schema(["messages", "answer"]) == "messages"
    assert detect_schema(["images", "problem", "answer"]) == "geometry3k"
    with pytest.raises(DataFileError, match="verl"):
        detect_schema(["question", "reward_model"])


def test_verl_geo3k_parquet_as_its_preprocessing_writes_it(tmp_path):
    path = write_verl_geo3k(tmp_path, n=3, answers=["3\\sqrt{3}", "12", "67.5"])
    ds = load_prompt_dataset(path, prompt_template="{problem} Think first.", system_prompt="Be brief.")
    assert ds.schema == "verl" and len(ds) == 3 and ds.skipped == []
    s = ds[1]
    assert s.answer == "12" and s.problem == f"Find x in figure 1. {VERL_INSTRUCTION}"
    assert s.messages[0] == {"role": "system", "content": "Be brief."}
    (kind, image), (text_kind, text) = _items(s.messages[1])
    assert kind == "image" and isinstance(image, bytes) and Image.open(__import__("io").BytesIO(image)).size == (28, 28)
    assert (text_kind, text) == ("text", f"Find x in figure 1. {VERL_INSTRUCTION} Think first.")
    assert s.metadata["data_source"] == "hiyouga/geometry3k" and s.metadata["ability"] == "math"
    assert s.metadata["extra_info"] == {"split": "train", "index": 1, "answer": "12", "question": "<image>Find x in figure 1."}
    rec = s.to_record()
    assert rec.messages[-1] == {"role": "assistant", "content": "12"}


def test_verl_placeholders_place_images_across_turns_and_bad_rows_are_counted(tmp_path):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    (tmp_path / "pic.png").write_bytes(blue)
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    rows = [
        _verl_row(0, [{"role": "system", "content": "You are a tutor."},
                      {"role": "user", "content": "Compare <image> with <image>. Which is red?"}], [red, blue], gt="left"),
        _verl_row(1, user("How many sides?"), [red]),                       # images but no placeholder: verl asserts
        _verl_row(2, user("<image> and <image>?"), [red]),                  # 2 placeholders, 1 image
        _verl_row(3, user("What is 2 + 2?"), gt=None),                      # no ground truth
        _verl_row(4, user("What is 2 + 2?"), gt="  "),                      # empty ground truth
        _verl_row(5, [{"role": "system", "content": "Only a system turn."}]),
        _verl_row(6, user("What is 2 + 2?"), gt="4"),
        {**_verl_row(7, user("<image> Colour?")), "images": [{"bytes": None, "path": "pic.png"}]},  # a relative path
        {**_verl_row(8, user("<image> Colour?")), "images": [{"bytes": None, "path": "missing.png"}]},
        _verl_row(9, user(""), gt="4"),                                     # empty question
    ]
    ds = load_prompt_dataset(verl_table(rows, tmp_path / "train.parquet"), prompt_template="{problem}")
    assert ds.schema == "verl" and [s.index for s in ds] == [0, 6, 7]
    first = ds[0]
    assert first.messages[0] == {"role": "system", "content": "You are a tutor."}
    assert _items(first.messages[1]) == [("text", "Compare"), ("image", red), ("text", "with"), ("image", blue),
                                         ("text", ". Which is red?")]
    assert first.answer == "left" and first.problem == "Compare  with . Which is red?"
    assert _items(ds[2].messages[0]) == [("image", str(tmp_path / "pic.png")), ("text", "Colour?")]
    reasons = dict((rid.split(":")[1], why) for rid, why in ds.skipped)
    assert "0 <image> placeholders but 1 images" in reasons["1"] and "2 <image> placeholders but 1 images" in reasons["2"]
    assert "reward_model.ground_truth is empty" in reasons["3"] and "reward_model.ground_truth is empty" in reasons["4"]
    assert "no user turn" in reasons["5"] and "image file not found" in reasons["8"] and "empty question" in reasons["9"]
    assert ds.bad_records.to_dict()["by_category"] == {"placeholder_mismatch": 2, "invalid_record": 4, "missing_image": 1}


def test_verl_rows_outside_what_grpo_reads_are_skipped_with_the_reason(tmp_path):
    # columns other verl datasets use: videos, a non-string ground truth, image dicts of qwen-vl-utils
    (tmp_path / "a.png").write_bytes(png())
    rows = [
        {"prompt": [{"role": "user", "content": "<video> What happens?"}], "videos": [{"video": "v.mp4"}],
         "reward_model": {"style": "rule", "ground_truth": "x"}},
        {"prompt": [{"role": "user", "content": "Name it."}], "reward_model": {"style": "rule", "ground_truth": ["a", "b"]}},
        {"prompt": [{"role": "user", "content": "<image> Name it."}], "images": [{"image": "https://example.com/a.png"}],
         "reward_model": {"style": "rule", "ground_truth": "a"}},
        {"prompt": [{"role": "user", "content": "<image> Name it."}], "images": [{"image": f"file://{tmp_path / 'a.png'}"}],
         "reward_model": {"style": "rule", "ground_truth": "a"}},
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
         "reward_model": {"style": "rule", "ground_truth": "a"}},
        {"prompt": "not a list", "reward_model": {"style": "rule", "ground_truth": "a"}},
        {"prompt": [{"role": "user", "content": "Name it."}], "reward_model": None},
    ]
    ds = load_prompt_dataset(write_trl_jsonl(rows, tmp_path / "rows.jsonl"), schema="verl")
    assert [s.index for s in ds] == [4]
    assert _items(ds[0].messages[0])[0] == ("image", str(tmp_path / "a.png"))
    reasons = [why for _, why in ds.skipped]
    assert "videos are not read" in reasons[0] and "is a list" in reasons[1] and "image URL" in reasons[2]
    assert "ends with an assistant turn" in reasons[3] and "non-empty list of messages" in reasons[4]
    assert "reward_model: expected a struct" in reasons[5]


def test_trl_standard_and_conversational_prompts(tmp_path):
    standard = write_trl_jsonl([
        {"prompt": "What is 1 + 1?", "solution": "2", "task": "math"},
        {"prompt": "What is 2 + 2?", "solution": ""},                              # no reference
    ], tmp_path / "standard.jsonl")
    ds = load_prompt_dataset(standard, prompt_template="Q: {problem}")
    assert ds.schema == "trl" and len(ds) == 1
    assert ds[0].messages == [{"role": "user", "content": [{"type": "text", "text": "Q: What is 1 + 1?"}]}]
    assert (ds[0].answer, ds[0].problem, ds[0].metadata) == ("2", "What is 1 + 1?", {"solution": "2", "task": "math"})
    assert "column 'solution' is empty" in ds.skipped[0][1]

    (tmp_path / "cat.png").write_bytes(png((0, 255, 0)))
    conversational = write_trl_jsonl([
        # string content: the images go before the first user turn's text, as TRL's prepare_multimodal_messages
        {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What colour?"}],
         "image": "cat.png", "answer": "green"},
        # typed items: each {"type": "image"} takes the next image in order
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "Left:"}, {"type": "image"},
                                                  {"type": "text", "text": "Right:"}, {"type": "image"},
                                                  {"type": "text", "text": "Same colour?"}]}],
         "images": ["cat.png", "cat.png"], "answer": "yes"},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
         "images": ["cat.png", "cat.png"], "answer": "green"},                       # 1 placeholder, 2 images
        {"prompt": "What colour?", "image": "cat.png", "answer": "green"},           # TRL refuses this too
        {"prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
         "answer": "x"},
    ], tmp_path / "conv.jsonl")
    ds = load_prompt_dataset(conversational, prompt_template="{problem} Reply in one word.")
    assert ds.schema == "trl" and [s.index for s in ds] == [1, 2]
    cat = str(tmp_path / "cat.png")
    assert ds[0].messages[0] == {"role": "system", "content": "Answer briefly."}
    assert _items(ds[0].messages[1]) == [("image", cat), ("text", "What colour? Reply in one word.")]
    assert _items(ds[1].messages[0]) == [("text", "Left:"), ("image", cat), ("text", "Right:"), ("image", cat),
                                         ("text", "Same colour? Reply in one word.")]
    reasons = [why for _, why in ds.skipped]
    assert "1 image placeholders but 2 images" in reasons[0] and "conversational prompt" in reasons[1]
    assert "unsupported content item" in reasons[2]
    assert ds.bad_records.to_dict()["by_category"] == {"placeholder_mismatch": 1, "invalid_record": 2}


def test_trl_conversational_parquet_with_image_bytes_and_column_precedence(tmp_path):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    item = pa.struct([("type", pa.string()), ("text", pa.string())])
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(item))]))),
                        ("images", pa.list_(image)), ("image", image),
                        ("ground_truth", pa.string()), ("solution", pa.string()), ("answer", pa.string())])
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]}],
             "images": [{"bytes": red, "path": None}], "image": {"bytes": blue, "path": None},
             "ground_truth": "red", "solution": "The square is red, so \\boxed{red}.", "answer": "crimson"}]
    ds = load_prompt_dataset(write_trl_parquet(rows, tmp_path / "train.parquet", schema), prompt_template="{problem}")
    assert ds.schema == "trl" and ds.skipped == []
    assert _items(ds[0].messages[0]) == [("image", red), ("text", "Colour?")]   # `images` wins over `image`
    assert ds[0].answer == "red"                                                  # ground_truth > answer > solution
    assert ds[0].metadata["solution"].startswith("The square") and "images" not in ds[0].metadata

    del rows[0]["ground_truth"], rows[0]["images"]
    plain = pa.schema([f for f in schema if f.name not in ("ground_truth", "images")])
    ds = load_prompt_dataset(write_trl_parquet(rows, tmp_path / "b.parquet", plain), prompt_template="{problem}")
    assert ds[0].answer == "crimson" and _items(ds[0].messages[0])[0] == ("image", blue)

    none = write_trl_jsonl([{"prompt": "Hi", "label": "x"}], tmp_path / "c.jsonl")
    with pytest.raises(DataFileError, match=r"one of the columns \['ground_truth', 'answer', 'solution'\]"):
        load_prompt_dataset(none)


def test_grpo_data_section_reads_a_verl_parquet_without_columns(tmp_path):
    from megatron_vlm.config import ConfigError, load_config_dict

    train, test = write_verl_geo3k(tmp_path, n=3), write_verl_geo3k(tmp_path, n=2, split="test")
    base = {"model": {"path": str(tmp_path / "m")}, "train": {"mode": "grpo", "max_steps": 1},
            "data": {"type": "hf", "train_path": str(train), "eval_path": str(test)}, "rl": {}}
    cfg = load_config_dict(base)
    assert cfg.data.columns == {}
    sets = load_prompt_sets(cfg.data, cfg.rl, run_dir=tmp_path)
    assert (sets.train.schema, len(sets.train), len(sets.eval)) == ("verl", 3, 2)
    sft = {**base, "train": {"mode": "sft", "max_steps": 1}}
    del sft["rl"]
    with pytest.raises(ConfigError, match="data.columns: required when type = 'hf'"):
        load_config_dict(sft)



def test_grpo_refuses_columns_it_does_not_read(tmp_path):
    """GRPO's hf prompt tables read prompt / answer / image(s): a `system` or `video` column was dropped silently."""
    from megatron_vlm.config import ConfigError, load_config_dict

    train = write_verl_geo3k(tmp_path, n=3)
    for extra in ("system", "video"):
        cfg = load_config_dict({"model": {"path": str(tmp_path / "m")}, "train": {"mode": "grpo", "max_steps": 1},
                                "data": {"type": "hf", "train_path": str(train),
                                         "columns": {"prompt": "prompt", "answer": "answer", extra: "x"}}, "rl": {}})
        with pytest.raises(ConfigError, match=rf"data.columns: .*'{extra}' is not read"):
            load_prompt_sets(cfg.data, cfg.rl, run_dir=tmp_path)
