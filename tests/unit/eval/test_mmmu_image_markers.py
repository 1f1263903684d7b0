"""MMMU rows whose options or question text name images ("<image 2>"): each image goes where its marker is.

Before, the markers were removed from the question (and left as the literal text "<image 2>" in the options) and
every image put before the text, so the model could not tell which picture option A was, nor which one "in
<image 2>" meant. The rows here are written as the MMMU release stores them (options as the Python-literal string,
image_1 ... image_7 Image structs with bytes, null when unused); the expected layouts are written out by hand from
the rows, and the encoded prompts of every family are read back from their tokens (and, for Qwen2.5-VL, compared
with transformers' own processor)."""
from __future__ import annotations

import re

import pyarrow as pa
import pytest

from megatron_vlm.config.eval_section import BenchmarkConfig
from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.processing import estimate_length, process_record
from megatron_vlm.eval.benchmarks import open_benchmark
from tests.fixtures.benchmark_files import IMAGE_STRUCT, _write, png_bytes

COLOURS = {1: (200, 0, 0), 2: (0, 200, 0), 3: (0, 0, 200), 4: (200, 200, 0), 5: (0, 200, 200)}
SIZES = {1: (56, 56), 2: (84, 56), 3: (56, 84), 4: (112, 56), 5: (56, 112)}


def _img(k: int) -> dict:
    return {"bytes": png_bytes(COLOURS[k], SIZES[k]), "path": None}


def _row(i: int, question: str, options: str, images: set[int], answer: str = "A") -> dict:
    row = {"id": f"validation_Art_{i}", "question": question, "options": options, "explanation": "",
           "img_type": "['Diagrams']", "answer": answer, "topic_difficulty": "Easy",
           "question_type": "multiple-choice", "subfield": "Art"}
    row.update({f"image_{k}": _img(k) if k in images else None for k in range(1, 8)})
    return row


ROWS = [
    # options that are only images, the question's image at its start
    _row(0, "<image 1> Which shape has the same outline as the figure?",
         "['<image 2>', '<image 3>', '<image 4>']", {1, 2, 3, 4}, "B"),
    # markers in the middle of the text, one named twice, and an image no marker names (image_5)
    _row(1, "Compare <image 1> with <image 2>. In <image 2>, which layer is thicker?", "['top', 'bottom']",
         {1, 2, 5}),
    # a marker naming an image the row does not have
    _row(2, "What does <image 3> show?", "['a cat', 'a dog']", {1}),
]

# the user turn of each good row under the template "Q: {problem}", as (kind, text or image number)
EXPECTED = [
    [("text", "Q: "), ("image", 1), ("text", " Which shape has the same outline as the figure?\nA. "), ("image", 2),
     ("text", "\nB. "), ("image", 3), ("text", "\nC. "), ("image", 4)],
    [("image", 5), ("text", "Q: Compare "), ("image", 1), ("text", " with "), ("image", 2), ("text", ". In "),
     ("image", 2), ("text", ", which layer is thicker?\nA. top\nB. bottom")],
]


@pytest.fixture(scope="module")
def mmmu(tmp_path_factory):
    cols = {k: [r[k] for r in ROWS] for k in ROWS[0]}
    path = _write(tmp_path_factory.mktemp("mmmu") / "validation.parquet", cols,
                  {f"image_{k}": IMAGE_STRUCT for k in range(1, 8)} | {"options": pa.string()})
    return open_benchmark(BenchmarkConfig(name="mmmu", path=str(path), format="mmmu"), template="Q: {problem}").source


def _colour(ref) -> tuple:
    import io

    from PIL import Image
    return Image.open(io.BytesIO(ref["bytes"])).convert("RGB").getpixel((0, 0))


def _layout(record) -> list[tuple]:
    by_colour = {c: k for k, c in COLOURS.items()}
    return [("image", by_colour[_colour(it["image"])]) if it["type"] == "image" else ("text", it["text"])
            for it in record.messages[-2]["content"]]


@pytest.mark.parametrize("i", [0, 1])
def test_images_sit_at_their_markers(mmmu, i):
    rec = mmmu.get(i)
    assert _layout(rec) == EXPECTED[i]
    assert rec.messages[-1] == {"role": "assistant", "content": ROWS[i]["answer"]}
    assert rec.meta["verifier"] == "choice" and rec.meta["id"] == ROWS[i]["id"]
    assert rec.meta["choices"] == eval(ROWS[i]["options"])  # noqa: S307 (the test's own literal)


def test_a_marker_without_its_image_is_a_bad_record(mmmu):
    with pytest.raises(BadRecordError, match=r"<image 3>.*image_3"):
        mmmu.get(2)


def test_the_record_layout_is_in_the_identity(mmmu):
    """A length cache or a kept eval result made while every image went first must not be taken for these
    records: the layout is part of what they depend on."""
    assert mmmu.identity()["images_at_markers"] is True


# ---------------------------------------------------------------------------------------- encoded prompts

_COLLAPSE = {  # each image's expansion in the rendered prompt -> "[IMG]" (InternVL / Nemotron-VL: the
    # template writes a newline after the image)
    "qwen2_5_vl": r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>",
    "qwen3_vl": r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>",
    "internvl": r"<img>(?:<IMG_CONTEXT>)+</img>\n",
    "nemotron_vl": r"<img>(?:<image>)+</img>\n",
}


@pytest.fixture(scope="module")
def processors(tmp_path_factory, proc):
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_vl_folder
    from megatron_vlm.testing.tiny_processor_internvl import build_tiny_internvl_processor
    from megatron_vlm.testing.tiny_processor_qwen3_vl import build_tiny_qwen3_vl_processor

    d = tmp_path_factory.mktemp("families")
    return {"qwen2_5_vl": proc, "qwen3_vl": load_processor(build_tiny_qwen3_vl_processor(d / "q3")),
            "internvl": load_processor(build_tiny_internvl_processor(d / "iv")),
            "nemotron_vl": load_processor(build_tiny_nemotron_vl_folder(d / "nem"))}


@pytest.mark.parametrize("family", sorted(_COLLAPSE))
def test_every_family_encodes_the_images_in_place(mmmu, processors, family):
    p = processors[family]
    for i, expected in enumerate(EXPECTED):
        sample = process_record(mmmu.get(i), p, max_frames=4, for_generation=True)
        # the planner's length of the interleaved prompt is the encoded one
        assert estimate_length(mmmu.get(i), p, max_frames=4, for_generation=True) == sample.input_ids.numel()
        text = p.tokenizer.decode(sample.input_ids.tolist(), skip_special_tokens=False)
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        want = "".join("[IMG]" if kind == "image" else v for kind, v in expected)
        assert re.sub(_COLLAPSE[family], "[IMG]", user) == want
        by_colour = {c: k for k, c in COLOURS.items()}
        assert [by_colour[im.getpixel((0, 0))] for im in sample.images] == [v for kind, v in expected if kind == "image"]


def test_qwen2_5_vl_tokens_match_transformers(mmmu, proc, monkeypatch):
    """The interleaved prompt encodes as transformers' Qwen2_5_VLProcessor encodes the same turn (reference)."""
    import transformers.processing_utils as pu
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import VideoProcessorMixin

    folder = proc.name_or_path
    monkeypatch.setattr(pu.transformers_module, "VideoProcessorMixin", VideoProcessorMixin, raising=False)
    ref = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                              tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=VideoProcessorMixin(),
                              chat_template=proc.chat_template)
    for i in range(len(EXPECTED)):
        sample = process_record(mmmu.get(i), proc, max_frames=4, for_generation=True)
        turn = [{"type": "image"} if kind == "image" else {"type": "text", "text": v} for kind, v in EXPECTED[i]]
        prompt = ref.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True)
        images = [_png(k) for kind, k in EXPECTED[i] if kind == "image"]
        enc = ref(text=prompt, images=images, return_tensors="pt")
        assert sample.input_ids.tolist() == enc["input_ids"][0].tolist()
        assert sample.image_grid_thw.tolist() == enc["image_grid_thw"].tolist()


def _png(k: int):
    import io

    from PIL import Image
    return Image.open(io.BytesIO(png_bytes(COLOURS[k], SIZES[k]))).convert("RGB")


def test_a_single_images_column_is_numbered_by_its_entries(tmp_path):
    """With `columns.images` naming one list column, "<image k>" is its k-th entry; an unnumbered "<image>" is
    removed as in the other formats."""
    from megatron_vlm.eval.benchmarks import FORMATS, benchmark_record

    row = {"question": "<image> Which one matches <image 2>?", "options": "['<image 1>', 'neither']", "answer": "A",
           "pics": [_img(1), _img(2)]}
    columns = {**FORMATS["mmmu"].columns, "images": "pics"}
    rec = benchmark_record(row, FORMATS["mmmu"], columns, verifier="auto", template="{problem}", system_prompt=None,
                           root=tmp_path, source="s", index=0)
    assert _layout(rec) == [("text", "Which one matches "), ("image", 2), ("text", "?\nA. "), ("image", 1),
                            ("text", "\nB. neither")]
    assert rec.meta["problem"] == "Which one matches <image 2>?\nA. <image 1>\nB. neither"
    with pytest.raises(BadRecordError, match=r"<image 3>.*2 images"):
        benchmark_record({**row, "question": "And <image 3>?"}, FORMATS["mmmu"], columns, verifier="auto",
                         template="{problem}", system_prompt=None, root=tmp_path, source="s", index=0)
