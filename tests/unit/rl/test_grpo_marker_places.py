"""GRPO messages rows with "<image>" markers inside the question: each image stays where its marker is (as SFT
trains the same record and as verl's rows place their placeholders), and an image in the system turn is refused
as verl's rows refuse it. The question's images were all moved in front of the templated text ("Compare   and  ."
with the images first), and a system turn's image was kept with its path unresolved."""
import json

from PIL import Image

from megatron_vlm.rl.prompts.dataset import load_prompt_dataset


def test_marker_images_stay_in_place_like_verl_rows(tmp_path):
    Image.new("RGB", (28, 28), "red").save(tmp_path / "a.png")
    Image.new("RGB", (28, 28), "blue").save(tmp_path / "b.png")
    question = "Compare <image> and <image>."
    swift = {"messages": [{"role": "user", "content": question}], "images": ["a.png", "b.png"], "answer": "red"}
    items = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
             "images": ["a.png"], "answer": "red"}
    system = {"messages": [{"role": "system", "content": "<image> Look."}, {"role": "user", "content": "What?"}],
              "images": ["a.png"], "answer": "red"}
    verl = {"prompt": [{"role": "user", "content": question}], "images": [{"image": "a.png"}, {"image": "b.png"}],
            "reward_model": {"style": "rule", "ground_truth": "red"}, "data_source": "x"}
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (swift, items, system)))
    (tmp_path / "v.jsonl").write_text(json.dumps(verl) + "\n")
    got = load_prompt_dataset(tmp_path / "m.jsonl", prompt_template="Q: {problem} A:")
    want = load_prompt_dataset(tmp_path / "v.jsonl", prompt_template="Q: {problem} A:")
    assert len(want.samples) == 1 and len(got.samples) == 2
    mine, verls = got.samples[0].messages[-1]["content"], want.samples[0].messages[-1]["content"]
    assert [it.get("image") for it in mine] == [it.get("image") for it in verls]  # same images at the same places
    assert [it.get("text", "").strip() for it in mine] == [it.get("text", "").strip() for it in verls]
    assert [it.get("text") for it in mine] == ["Q: Compare ", None, " and ", None, ". A:"]  # SFT's text around them
    assert got.samples[0].problem == want.samples[0].problem == "Compare  and ."
    lead = got.samples[1].messages[-1]["content"]  # images before the question's text stay in front of the template
    assert [it["type"] for it in lead] == ["image", "text"] and lead[1]["text"] == "Q: What colour? A:"
    assert [(b.index, b.category) for b in got.bad_records.entries] == [(3, "invalid_record")]
    assert "system turn" in got.bad_records.entries[0].detail
