"""The calculator demo's data: held-out questions never in the SFT traces, answers that are the products, and tool
traces in the form the `calculator` environment holds (the rollout's system turn, a parseable call, its reply)."""
from __future__ import annotations

import json

import pytest

from megatron_vlm.data.messages import normalize_messages
from megatron_vlm.rl.env.builtin import CalculatorEnv
from megatron_vlm.rl.env.calculator_data import calculator_rows, write_synthetic_calculator
from megatron_vlm.rl.env.tool_calls import ToolCall, parse_tool_calls
from megatron_vlm.rl.env.turns import tools_system_text


def test_rows_split_and_answers():
    rows = calculator_rows(10, 19, eval_size=20, seed=3, test_size=15)
    train, evals, test = rows["train"], rows["eval"], rows["test"]
    assert (len(train), len(evals), len(test)) == (65, 20, 15)
    qs = [{r["question"] for r in split} for split in (train, evals, test)]
    assert len(qs[0] | qs[1] | qs[2]) == 100  # disjoint, every pair once
    for r in train + evals + test:
        a, b = (int(x) for x in r["question"].removesuffix(" = ?").split(" * "))
        assert r["answer"] == str(a * b) and 10 <= a <= 19 and 10 <= b <= 19


def test_files_and_traces(tmp_path):
    paths = write_synthetic_calculator(tmp_path, low=10, high=12, eval_size=2, test_size=0, spec_every=3)
    tool = [json.loads(line) for line in paths["sft_tool"].read_text().splitlines()]
    direct = [json.loads(line) for line in paths["sft_direct"].read_text().splitlines()]
    assert len(tool) == len(direct) == 7
    for i, (t, d) in enumerate(zip(tool, direct)):
        msgs = normalize_messages(t["messages"])
        if i % 3 == 0:  # every third trace carries the specs the rollout writes, the others no system turn
            assert msgs[0]["role"] == "system" and msgs[0]["content"] == tools_system_text(CalculatorEnv().tools())
            msgs = msgs[1:]
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
        (call,) = parse_tool_calls(msgs[1]["content"])
        assert isinstance(call, ToolCall) and call.name == "calculate"
        a, b = call.arguments["expression"].split(" * ")
        assert msgs[0]["content"] == f"{a} * {b} = ?" == d["messages"][0]["content"]
        assert msgs[2]["content"] == msgs[3]["content"] == t["answer"] == str(int(a) * int(b)) == d["answer"]
        assert [m["role"] for m in normalize_messages(d["messages"])] == ["user", "assistant"]
    before = paths["sft_tool"].stat().st_mtime_ns
    write_synthetic_calculator(tmp_path, low=10, high=12, eval_size=2, test_size=0, spec_every=3)  # unchanged
    assert paths["sft_tool"].stat().st_mtime_ns == before
    for every, with_specs in ((1, [True] * 7), (0, [False] * 7)):
        paths = write_synthetic_calculator(tmp_path / str(every), low=10, high=12, eval_size=2, test_size=0,
                                           spec_every=every)
        lines = paths["sft_tool"].read_text().splitlines()
        assert [json.loads(x)["messages"][0]["role"] == "system" for x in lines] == with_specs
    with pytest.raises(ValueError, match="spec_every"):
        write_synthetic_calculator(tmp_path / "bad", spec_every=-1)


def test_question_tokens_are_the_calls_tokens():
    """The operands in the question are the same tokens as in the tool call's JSON string (a copy, not a rewrite)."""
    from megatron_vlm.testing.tiny_processor import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    row = calculator_rows(10, 99, eval_size=1, seed=0)["eval"][0]
    q = tok(row["question"])["input_ids"]
    call = tok(json.dumps({"expression": row["expression"]}))["input_ids"]
    expr = tok(row["expression"])["input_ids"]
    assert q[: len(expr)] == expr and any(call[i:i + len(expr)] == expr for i in range(len(call)))
