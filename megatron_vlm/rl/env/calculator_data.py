"""The calculator demo's data: two-digit products "a * b = ?", as prompts and as SFT traces with and without the tool.

Why products: a tiny random model learns the answer format and the copying of digits in a few hundred steps, but
not multiplication, so the question of the demo (does the `calculate` tool of `[rl.env] name = "calculator"`
raise reward over the same recipe without it?) has room for an answer either way. Why SFT traces: a random model
never writes `<tool_call>` by chance; a short SFT on synthetic tool-use conversations teaches the format (the
tool arm) and the same SFT on the same questions answered directly is the no-tool arm's warm start.

Files in the folder (written atomically and only when missing or different, so ranks and reruns can all call it):
- `train.parquet` / `eval.parquet` / `test.parquet`: columns `question`, `answer` (`[data] type = "hf"`). The
  set is every pair (a, b) with `low <= a, b <= high`, shuffled by `seed`; the first `eval_size` are the GRPO
  prompts, the next `test_size` the held-out test (`rl/env/demo_eval.py`), the rest the SFT's questions.
- `sft_tool.jsonl`: per training question, the conversation the `calculator` environment holds with a model
  that uses the tool: the system turn with the tool specs (`rl/env/turns.tools_system_text`, the text the rollout
  writes), the question, a `<tool_call>` turn, the tool's reply (role "tool") and the bare answer. Only every
  `spec_every`-th trace carries the system turn; the others are the same turns without it. Why: the specs are
  ~470 of a trace's ~550 tokens and the same in every trace, while what the model must learn (copy the
  operands into the call, the tool's reply into the answer) is ~10 tokens at the end; a trace without them is
  ~75 tokens, so a step of the same token budget holds ~24 traces instead of ~7, and the copy, learned at the
  same distance from the question, holds behind the specs too (the held-out evaluation runs with them).
- `sft_direct.jsonl`: the same questions answered directly (no system turn, as the no-tool GRPO prompts).

    python -m megatron_vlm.rl.env.calculator_data runs/demo_assets/synthetic_calculator
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from megatron_vlm.data.synthetic_arith import write_parquet_rows

__all__ = ["calculator_rows", "tool_trace", "direct_trace", "write_synthetic_calculator"]


def calculator_rows(low: int = 10, high: int = 99, eval_size: int = 200, seed: int = 0,
                    test_size: int = 0) -> dict[str, list[dict]]:
    """{"train", "eval", "test"} rows, each {"question", "answer", "expression"}; a pure function of the arguments.

    The question "47 * 83 = ?" writes the operands as the tool call's JSON string writes them ("47 * 83": the
    same tokens, where "What is 47 ..." would start the first operand with a space-prefixed token), so the call
    is a copy of the question's tokens."""
    if not 0 <= low <= high:
        raise ValueError(f"low, high: need 0 <= low <= high, got {low}, {high}")
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    if eval_size < 0 or test_size < 0 or eval_size + test_size >= len(pairs):
        raise ValueError(f"eval_size + test_size: must be in [0, {len(pairs)}) for operands {low}..{high}, got "
                         f"{eval_size} + {test_size}")
    random.Random(seed).shuffle(pairs)
    rows = [{"question": f"{a} * {b} = ?", "answer": str(a * b), "expression": f"{a} * {b}"} for a, b in pairs]
    return {"eval": rows[:eval_size], "test": rows[eval_size:eval_size + test_size],
            "train": rows[eval_size + test_size:]}


def tool_trace(row: dict, with_specs: bool = True) -> list[dict]:
    """The messages of one tool-using conversation of the `calculator` environment for `row`; without
    `with_specs`, the same turns without the system turn that carries the tool specs (module docstring: why)."""
    from megatron_vlm.rl.env.builtin import CalculatorEnv, calculate
    from megatron_vlm.rl.env.turns import with_tools

    call = json.dumps({"name": "calculate", "arguments": {"expression": row["expression"]}})
    turns = [{"role": "user", "content": row["question"]},
             {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
             {"role": "tool", "content": calculate(row["expression"])},
             {"role": "assistant", "content": row["answer"]}]
    return with_tools(turns, CalculatorEnv().tools()) if with_specs else turns


def direct_trace(row: dict) -> list[dict]:
    """The messages of `row` answered without a tool."""
    return [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]


def _write_text(path: Path, text: str) -> None:
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_synthetic_calculator(folder: str | Path, *, low: int = 10, high: int = 99, eval_size: int = 200,
                               test_size: int = 200, seed: int = 0, spec_every: int = 8) -> dict[str, Path]:
    """Write the files (module docstring) into `folder`; returns {"train", "eval", "test", "sft_tool", "sft_direct"}."""
    if spec_every < 0:
        raise ValueError(f"spec_every: must be >= 0 (0: no trace carries the tool specs), got {spec_every}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = calculator_rows(low, high, eval_size, seed, test_size=test_size)
    train = rows["train"]
    paths = {"train": folder / "train.parquet", "eval": folder / "eval.parquet", "test": folder / "test.parquet",
             "sft_tool": folder / "sft_tool.jsonl", "sft_direct": folder / "sft_direct.jsonl"}
    for split in ("train", "eval", "test"):
        write_parquet_rows(paths[split], rows[split])
    def line(messages: list[dict], row: dict) -> str:
        return json.dumps({"messages": messages, "answer": row["answer"]}) + "\n"

    _write_text(paths["sft_tool"], "".join(line(tool_trace(r, with_specs=spec_every > 0 and i % spec_every == 0), r)
                                           for i, r in enumerate(train)))
    _write_text(paths["sft_direct"], "".join(line(direct_trace(r), r) for r in train))
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--low", type=int, default=10)
    p.add_argument("--high", type=int, default=99)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--test-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec-every", type=int, default=8, help="every k-th tool trace carries the tool specs (0: none)")
    a = p.parse_args(argv)
    for name, path in write_synthetic_calculator(a.folder, low=a.low, high=a.high, eval_size=a.eval_size,
                                                 test_size=a.test_size, seed=a.seed,
                                                 spec_every=a.spec_every).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
