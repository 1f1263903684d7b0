"""A `format = "messages"` benchmark applies its prompt template once to the last user turn, also when that turn
holds several text items around its images ("Look at", image, "How many?"): the template's text before {problem}
goes before the first item, the text after it after the last, as `template.format(problem=...)` of the turn's
whole text would place them, not once per item."""
from __future__ import annotations

import json

import pytest

from megatron_vlm.config.eval_section import BenchmarkConfig
from megatron_vlm.eval.benchmarks import open_benchmark


def _bench(tmp_path, content) -> dict:
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": content},
                                             {"role": "assistant", "content": "three"}]}) + "\n")
    src = open_benchmark(BenchmarkConfig(name="b", path=str(path), format="messages"),
                         template="Q: {problem} Answer in one word.").source
    return src.get(0).messages[-2]


@pytest.mark.parametrize("items", [["Look at", "How many?"], ["Look at", "this", "How many?"]])
def test_template_wraps_the_turn_once(tmp_path, items):
    (tmp_path / "a.png").write_bytes(b"")  # resolved, never opened here
    content = [{"type": "text", "text": items[0]}, {"type": "image", "image": "a.png"},
               *({"type": "text", "text": t} for t in items[1:])]
    turn = _bench(tmp_path, content)
    texts = [it["text"] for it in turn["content"] if it["type"] == "text"]
    assert "".join(texts) == "Q: " + "".join(items) + " Answer in one word."
    assert texts[0] == "Q: " + items[0] and texts[-1] == items[-1] + " Answer in one word."
    assert [it["type"] for it in turn["content"]] == [it["type"] for it in content]


def test_one_text_item_and_a_string_turn(tmp_path):
    assert _bench(tmp_path, "How many?")["content"] == "Q: How many? Answer in one word."
    turn = _bench(tmp_path, [{"type": "text", "text": "How many?"}])
    assert turn["content"] == [{"type": "text", "text": "Q: How many? Answer in one word."}]


def test_a_messages_benchmark_gives_the_verifiers_its_question(tmp_path):
    """The choice verifier reads the options from the question when the row has no `choices` (as in training, where
    a messages prompt's question text is the verifiers' prompt): a messages benchmark scored with verifier = "choice"
    passed it no question, so an answer given as the option's text ("blue" for "B. blue") scored 0."""
    from megatron_vlm.testing.tiny_processor import build_tiny_qwen2_5_vl_processor
    from tests.unit.eval.bench_harness import AnswerEngine, evaluate, write_messages

    path = write_messages(tmp_path / "c.jsonl", [(None, "Which colour is the sky?\nA. red\nB. blue", "B"),
                                                 (None, "Which colour is grass?\nA. green\nB. blue", "A")])
    proc = build_tiny_qwen2_5_vl_processor(tmp_path / "proc")
    bench = BenchmarkConfig(name="c", path=str(path), format="messages", verifier="choice")
    result = evaluate(proc, bench, engine=AnswerEngine("blue"))
    assert [r["greedy_score"] for r in result["rows"]] == [1.0, 0.0]
    src = open_benchmark(bench, template="Q: {problem}").source
    assert src.get(0).meta["problem"] == "Which colour is the sky?\nA. red\nB. blue"
