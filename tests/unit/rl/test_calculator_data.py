"""The calculator demo's data: held-out questions never in the SFT traces, answers that are the products, and tool
traces in the form the `calculator` environment holds (the rollout's system turn, a parseable call, its reply)."""
from __future__ import annotations

import json

from megatron_vlm.data.messages import normalize_messages
from megatron_vlm.rl.env.builtin import CalculatorEnv
from megatron_vlm.rl.env.calculator_data import calculator_rows, write_synthetic_calculator
from megatron_vlm.rl.env.tool_calls import ToolCall, parse_tool_calls
from megatron_vlm.rl.env.turns import tools_system_text


def test_rows_split_and_answers():
    train, evals = calculator_rows(10, 19, eval_size=20, seed=3)
    assert len(train) + len(evals) == 100
    assert not {r["question"] for r in train} & {r["question"] for r in evals}
    for r in train + evals:
        a, b = (int(x) for x in r["question"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert r["answer"] == str(a * b) and 10 <= a <= 19 and 10 <= b <= 19


def test_files_and_traces(tmp_path):
    paths = write_synthetic_calculator(tmp_path, low=10, high=12, eval_size=2)
    tool = [json.loads(line) for line in paths["sft_tool"].read_text().splitlines()]
    direct = [json.loads(line) for line in paths["sft_direct"].read_text().splitlines()]
    assert len(tool) == len(direct) == 7
    for t, d in zip(tool, direct):
        msgs = normalize_messages(t["messages"])
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
        assert msgs[0]["content"] == tools_system_text(CalculatorEnv().tools())
        (call,) = parse_tool_calls(msgs[2]["content"])
        assert isinstance(call, ToolCall) and call.name == "calculate"
        a, b = call.arguments["expression"].split(" * ")
        assert msgs[1]["content"] == f"What is {a} * {b}?" == d["messages"][0]["content"]
        assert msgs[3]["content"] == msgs[4]["content"] == t["answer"] == str(int(a) * int(b)) == d["answer"]
        assert [m["role"] for m in normalize_messages(d["messages"])] == ["user", "assistant"]
    before = paths["sft_tool"].stat().st_mtime_ns
    write_synthetic_calculator(tmp_path, low=10, high=12, eval_size=2)  # unchanged: not rewritten
    assert paths["sft_tool"].stat().st_mtime_ns == before
