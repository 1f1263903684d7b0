"""GRPO prompt datasets: Geometry3K rows stored the way Hugging Face `datasets` stores them (Image
feature -> {bytes, path} structs), ViRL39K rows with the release's columns and relative image paths,
messages-format JSONL (the synthetic VQA layout); placeholder handling, skipped rows with reasons,
the prompt template, and the deterministic per-step prompt order."""
import io
import json

import pytest
from PIL import Image

from megatron_vlm.rl.prompts.dataset import detect_schema, load_prompt_dataset, prompt_batches
from megatron_vlm.rl.rewards.verifiers import choice_reward, math_reward
from tests.fixtures.rl_prompt_tables import GEOMETRY3K_ANSWERS, write_geometry3k_fixture, write_virl39k_fixture


def _png(color):
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), color).save(buf, format="PNG")
    return buf.getvalue()


def test_geometry3k_as_written_by_hf_datasets(tmp_path):
    import datasets  # Hugging Face's own encoding of the Image feature is the format reference

    feats = datasets.Features({
        "images": datasets.Sequence(datasets.Image()),
        "problem": datasets.Value("string"),
        "answer": datasets.Value("string"),
    })
    imgs = [Image.new("RGB", (28, 28), c) for c in ("red", "blue")]
    ds = datasets.Dataset.from_dict(
        {"images": [[imgs[0]], [imgs[1]]], "problem": ["<image>Find x.", "<image>Find y."], "answer": ["3\\sqrt{3}", "12"]},
        features=feats,
    )
    ds.to_parquet(str(tmp_path / "test-00000-of-00001.parquet"))
    out = load_prompt_dataset(tmp_path, prompt_template="{problem} Answer in \\boxed{{}}.", system_prompt="Be brief.")
    assert out.schema == "geometry3k" and len(out) == 2 and out.skipped == []
    s = out[1]
    assert s.messages[0] == {"role": "system", "content": "Be brief."}
    user = s.messages[1]
    assert user["role"] == "user" and [it["type"] for it in user["content"]] == ["image", "text"]
    assert user["content"][1]["text"] == "Find y. Answer in \\boxed{}."
    assert s.problem == "Find y." and s.answer == "12"
    assert Image.open(io.BytesIO(s.images()[0])).convert("RGB").getpixel((3, 3)) == (0, 0, 255)
    assert not any(m["role"] == "assistant" for m in s.messages)


def test_geometry3k_fixture_roundtrip_and_rewards(tmp_path):
    path = write_geometry3k_fixture(tmp_path, n=10, seed=3)
    out = load_prompt_dataset(path)
    assert len(out) == 10 and detect_schema(["images", "problem", "answer"]) == "geometry3k"
    assert [s.answer for s in out.samples] == [GEOMETRY3K_ANSWERS[i % len(GEOMETRY3K_ANSWERS)] for i in range(10)]
    assert out[0].prompt_id == "train.parquet:0"
    # the reference answers are verifiable by the math verifier (in equivalent forms)
    assert math_reward("\\boxed{\\sqrt{27}}", out[0].answer) == 1.0
    assert math_reward("\\boxed{13.33}", out[1].answer) == 1.0
    assert load_prompt_dataset(path, max_samples=3).samples[2].prompt_id == "train.parquet:2"


def _virl_row(qid, question, answer, image):
    return {"question": question, "answer": answer, "PassRate_32BTrained": 0.5, "PassRate_7BBase": 0.25,
            "category": "Spatial Reasoning", "source": "unit", "qid": qid, "image": image}


def test_virl39k_rows_relative_paths_and_skips(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(_png("red"))
    (tmp_path / "images" / "b.png").write_bytes(_png("green"))
    rows = [
        _virl_row("q1", "<image>Which is larger?\nChoices:\n(A) 3\n(B) 5", "\\boxed{B}", ["images/a.png"]),
        _virl_row("q2", "Compare <image> with <image>. How many?", "\\boxed{2}", ["images/a.png", "images/b.png"]),
        _virl_row("q3", "No placeholder here.", "\\boxed{\\frac{1}{2}}", ["images/b.png"]),
        _virl_row("q4", "<image>Missing file", "\\boxed{1}", ["images/missing.png"]),
        _virl_row("q5", "<image><image>One image only", "\\boxed{1}", ["images/a.png"]),
        _virl_row("q6", "<image>No answer", "", ["images/a.png"]),
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "39Krelease.parquet")
    out = load_prompt_dataset(tmp_path / "39Krelease.parquet", prompt_template="{problem}")
    assert out.schema == "virl39k"
    assert [s.prompt_id for s in out.samples] == ["q1", "q2", "q3"]
    reasons = dict(out.skipped)
    assert "image file not found" in reasons["39Krelease.parquet:3"] and "missing.png" in reasons["39Krelease.parquet:3"]
    assert reasons["39Krelease.parquet:4"] == "2 <image> placeholders but 1 images"
    assert reasons["39Krelease.parquet:5"] == "empty answer"
    q2 = out[1].messages[0]["content"]
    assert [it["type"] for it in q2] == ["text", "image", "text", "image", "text"]
    assert q2[1]["image"] == str(tmp_path / "images" / "a.png") and q2[3]["image"] == str(tmp_path / "images" / "b.png")
    assert [it["type"] for it in out[2].messages[0]["content"]] == ["image", "text"]  # images first
    assert out[0].metadata == {"category": "Spatial Reasoning", "source": "unit", "PassRate_32BTrained": 0.5, "PassRate_7BBase": 0.25}
    # multiple choice: options read from the question, answer stored boxed
    assert choice_reward("The answer is (B).", out[0].answer, prompt=out[0].problem) == 1.0
    assert choice_reward("\\boxed{5}", out[0].answer, prompt=out[0].problem) == 1.0
    assert math_reward("\\boxed{0.5}", out[2].answer) == 1.0


def test_virl39k_fixture_and_image_root(tmp_path):
    path = write_virl39k_fixture(tmp_path / "release", n=6, seed=1)
    moved = tmp_path / "elsewhere.parquet"
    moved.write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match="no usable rows"):
        load_prompt_dataset(moved)  # images are relative to the release folder
    out = load_prompt_dataset(moved, image_root=tmp_path / "release")
    assert len(out) == 6 and out.skipped == []
    assert sum(len(s.images()) for s in out.samples) == 7  # one row has two images


def test_messages_jsonl(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "x.png").write_bytes(_png("blue"))
    recs = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/x.png"}, {"type": "text", "text": "What colour is the square?"}]},
                      {"role": "assistant", "content": "blue"}], "question_type": "colour_of_shape", "answer": "blue"},
        {"messages": [{"role": "user", "content": "Say red."}, {"role": "assistant", "content": "red"}]},
        {"messages": [{"role": "assistant", "content": "orphan"}]},
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + "{not json\n")
    out = load_prompt_dataset(tmp_path / "eval.jsonl", prompt_template="{problem} Answer with one word.")
    assert out.schema == "messages" and len(out) == 2
    s = out[0]
    assert s.messages == [{"role": "user", "content": [
        {"type": "image", "image": str(tmp_path / "images" / "x.png")},
        {"type": "text", "text": "What colour is the square? Answer with one word."}]}]
    assert s.answer == "blue" and s.problem == "What colour is the square?" and s.metadata == {"question_type": "colour_of_shape"}
    assert out[1].answer == "red"  # from the assistant turn
    assert [r for _, r in out.skipped] == ["no user turn", "line 4: malformed JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"]


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .parquet"):
        load_prompt_dataset(tmp_path / "nothing")
    (tmp_path / "x.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="match no schema"):
        load_prompt_dataset(tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match=r"needs columns \['problem', 'answer', 'images'\]"):
        load_prompt_dataset(tmp_path / "x.jsonl", schema="geometry3k")
    with pytest.raises(ValueError, match="prompt_template"):
        load_prompt_dataset(tmp_path / "x.jsonl", prompt_template="no placeholder")


def test_prompt_batches_are_deterministic_epochs_and_resumable():
    gen = prompt_batches(10, 4, seed=7)
    batches = [next(gen) for _ in range(5)]  # 20 prompts = two epochs
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    resumed = prompt_batches(10, 4, seed=7, start_step=3)
    assert next(resumed) == batches[3] and next(resumed) == batches[4]
    assert next(prompt_batches(10, 4, seed=8)) != batches[0]
    with pytest.raises(ValueError):
        next(prompt_batches(0, 4, seed=0))


def test_explicit_column_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p.png").write_bytes(_png("red"))
    rows = [{"query": "<image>How many?", "solution": "3", "pics": ["p.png"], "difficulty": 2}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    out = load_prompt_dataset(tmp_path / "t.parquet", columns={"prompt": "query", "answer": "solution", "images": "pics"})
    assert out.schema == "columns" and out[0].answer == "3" and out[0].metadata == {"difficulty": 2}
    assert out[0].images() == [str(tmp_path / "p.png")]
    write_virl39k_fixture(tmp_path / "v", n=2)
    same = load_prompt_dataset(tmp_path / "v", columns={"prompt": "question", "answer": "answer", "image": "image"})
    assert same.schema == "virl39k" and same[0].prompt_id == "fixture-0-0"
    with pytest.raises(ValueError, match="columns: expected keys"):
        load_prompt_dataset(tmp_path / "t.parquet", columns={"question": "query"})


def test_synthetic_vqa_prompts_through_the_data_pipeline(tmp_path):
    """The synthetic VQA eval set (messages JSONL written by megatron_vlm.data.synthetic_vqa) becomes
    GRPO prompts that the data pipeline turns into generation inputs, and its one-word answers are
    scored by the exact-match verifier."""
    from megatron_vlm.data.processing import process_record
    from megatron_vlm.data.synthetic_vqa import VOCABULARY_WORDS, write_synthetic_vqa
    from megatron_vlm.rl.rewards.verifiers import exact_match_reward
    from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor

    paths = write_synthetic_vqa(tmp_path / "vqa", n_train=2, n_eval=4, seed=0)
    out = load_prompt_dataset(paths["eval"], prompt_template="{problem}")
    assert out.schema == "messages" and len(out) == 4 and out.skipped == []
    raw = [json.loads(line) for line in paths["eval"].read_text().splitlines()]
    assert [s.answer for s in out.samples] == [r["answer"] for r in raw]
    assert [s.metadata["question_type"] for s in out.samples] == [r["question_type"] for r in raw]
    for s in out.samples:
        assert exact_match_reward(s.answer.capitalize() + ".", s.answer) == 1.0
    proc = build_tiny_qwen2_5_vl_processor(tmp_path / "proc", extra_words=VOCABULARY_WORDS)
    ps = process_record(out[0].to_record(), proc, max_frames=4, for_generation=True)
    assert ps.answer == out[0].answer and not ps.label_mask.any()
    assert int((ps.input_ids == proc.image_token_id).sum()) == proc.num_tokens(ps.image_grid_thw[0])
    assert proc.tokenizer.decode(ps.input_ids).rstrip().endswith("assistant")  # generation prompt


def test_rows_with_their_own_system_turn_keep_it_and_are_counted(tmp_path, caplog):
    """rl.prompts.system_prompt is not added where a chat-messages row brings a system turn (the row's wins, as
    verl and TRL keep it): said at start-up with how many rows, not silently."""
    import json
    import logging

    rows = [{"messages": [{"role": "system", "content": "Own rules."}, {"role": "user", "content": "1+1?"}], "answer": "2"},
            {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING):
        out = load_prompt_dataset(path, system_prompt="Be brief.")
    assert out[0].messages[0] == {"role": "system", "content": "Own rules."}
    assert out[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert "1 of 2 rows keep their own system turn" in caplog.text


def test_messages_rows_take_their_top_level_images(tmp_path):
    """GRPO prompt rows in the messages layout with top-level "images": at "<image>" text markers (ms-swift's
    layout) or into {"type": "image"} items without a path (TRL's), as SFT reads them. The marker form trained on
    the literal "<image>" text without the image, and the item form was skipped."""
    import json

    from PIL import Image

    Image.new("RGB", (28, 28), "red").save(tmp_path / "a.png")
    rows = [{"messages": [{"role": "user", "content": "<image>What colour?"}], "images": ["a.png"], "answer": "red"},
            {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
             "images": ["a.png"], "answer": "red"},
            {"messages": [{"role": "user", "content": "What colour?"}], "images": ["a.png"], "answer": "red"},
            {"messages": [{"role": "user", "content": "<image><image>What colour?"}], "images": ["a.png"], "answer": "r"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = load_prompt_dataset(path, prompt_template="{problem}")
    assert len(out) == 2 and [b.category for b in out.bad_records.entries] == ["placeholder_mismatch"] * 2
    for s in out.samples:
        user = s.messages[-1]
        assert [it["type"] for it in user["content"]] == ["image", "text"]
        assert user["content"][1]["text"] == "What colour?" and len(s.images()) == 1
