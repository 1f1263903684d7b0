"""Answer comparison and the per-group tally of held-out answer accuracy (`eval.answers`), and the
engine prompts made from a left-padded generation batch (`eval.answer_accuracy.batch_prompts`)."""
from __future__ import annotations

import torch

from megatron_vlm.eval.answer_accuracy import batch_prompts
from megatron_vlm.eval.answers import AnswerTally, normalize_answer


def test_normalize_answer_takes_the_first_word():
    assert normalize_answer("  Red. circle") == "red"
    assert normalize_answer("3!") == "3"
    assert normalize_answer("") == ""


def test_tally_groups_by_the_metadata_field_in_first_record_order():
    t = AnswerTally()
    t.add("red", "Red", {"question_type": "colour"}, index=4)
    t.add("2", "3", {"question_type": "count"}, index=1)
    t.add("3", "3", {"question_type": "count"}, index=7)
    t.add("blue", "blue", {}, index=0)  # no group: counted in the total only
    m = t.merged().metrics()  # one process: the gathered tally is this rank's
    assert m == {"answer_accuracy": 3 / 4, "answer_n": 4, "answer_accuracy/count": 0.5, "answer_accuracy/colour": 1.0}
    assert list(m)[2:] == ["answer_accuracy/count", "answer_accuracy/colour"]


def test_tally_other_field_and_empty():
    t = AnswerTally("skill")
    assert t.metrics() is None
    t.add("a", "b", {"skill": "ocr"})
    assert t.metrics() == {"answer_accuracy": 0.0, "answer_n": 1, "answer_accuracy/ocr": 0.0}


def test_batch_prompts_strip_left_padding_and_keep_the_batch_vision_tensors():
    batch = {"input_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]]),
             "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
             "pixel_values": torch.arange(12.0).reshape(6, 2), "image_grid_thw": torch.tensor([[1, 2, 1], [1, 2, 2]])}
    p = batch_prompts(batch)
    assert [x.input_ids.tolist() for x in p] == [[5, 6], [7, 8, 9, 1]]
    assert torch.equal(p[0].pixel_values, batch["pixel_values"]) and p[1].pixel_values is None
    assert torch.equal(p[0].image_grid_thw, batch["image_grid_thw"]) and p[1].image_grid_thw is None


def test_normalize_answer_keeps_decimal_points_and_digit_groups():
    # the sentence punctuation goes, the punctuation inside a number stays: 3.5 and 3.7 are different answers
    assert normalize_answer("3.5") == "3.5"
    assert normalize_answer("3.5.") == "3.5"
    assert normalize_answer("0.25, I think") == "0.25"
    assert normalize_answer("1,000!") == "1,000"
    assert normalize_answer("3.5") != normalize_answer("3.7")
    assert normalize_answer("red,blue") == "red"
    t = AnswerTally()
    t.add("3.7", "3.5")
    t.add("12,500", "12,000")
    assert t.metrics()["answer_accuracy"] == 0.0
