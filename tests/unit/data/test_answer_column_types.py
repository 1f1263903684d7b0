"""`[data] columns = {prompt, answer}`: an answer cell that is not one text (a list of reference answers, a struct,
a NaN that pandas writes for a missing number) is a bad record, not trained as its Python repr.

It used to be `str(answer)`: a VQAv2-style `answers` list trained the model to reply "['red', 'crimson']", and a
missing float answer trained "nan", with no record counted. A number or a bool is a legitimate answer (a choice
index) and is trained as its text, as before."""
from __future__ import annotations

import math

import pytest

from megatron_vlm.data.bad_records import BadRecordError
from megatron_vlm.data.hf_source import record_from_columns

COLUMNS = {"prompt": "q", "answer": "a"}


def _record(answer, tmp_path):
    return record_from_columns({"q": "What colour?", "a": answer}, COLUMNS, root=tmp_path, source="d.parquet", index=0)


@pytest.mark.parametrize("answer", [["red", "crimson"], ("red",), {"text": "red"}, math.nan, math.inf])
def test_an_answer_that_is_not_one_text_is_a_bad_record(answer, tmp_path):
    with pytest.raises(BadRecordError) as e:
        _record(answer, tmp_path)
    assert e.value.category == "invalid_record" and "'a'" in str(e.value)


@pytest.mark.parametrize("answer,text", [("red", "red"), (3, "3"), (2.5, "2.5"), (True, "True")])
def test_text_and_number_answers_are_trained_as_text(answer, text, tmp_path):
    rec = _record(answer, tmp_path)
    assert rec.messages[-1] == {"role": "assistant", "content": text}
    assert rec.meta["answer"] == text
