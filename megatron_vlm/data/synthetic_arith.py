"""A synthetic arithmetic task for the text-only demos: "What is a + b?" -> "a+b", as GSM8K-style tables.

Why: the math GRPO recipe (Qwen2.5-Math on GSM8K / MATH parquet, `math` reward) needs a task a tiny
random model can learn on a CPU in minutes, read through the same path as the real data (`[data]
type = "hf"` with `columns = {prompt = "question", answer = "answer"}`), with a held-out split that
measures generalisation rather than memorisation.

The set is every pair (a, b) with 0 <= a, b <= `max_operand`, shuffled by `seed`; the first
`eval_size` pairs are the held-out split, the rest the training split, so no held-out question is
ever trained on (a + b and b + a are different questions; both may occur, in either split). Files:
`train.parquet` / `eval.parquet` with columns `question` and `answer` (the sum as a decimal string);
written atomically and only when missing or different, so ranks and reruns can all call it.

    python -m megatron_vlm.data.synthetic_arith runs/demo_assets/synthetic_arith --max-operand 39 --eval-size 400
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

__all__ = ["arith_rows", "write_parquet_rows", "write_synthetic_arith"]


def arith_rows(max_operand: int, eval_size: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows), each {"question", "answer"}; a pure function of the arguments."""
    if max_operand < 1:
        raise ValueError(f"max_operand: must be >= 1, got {max_operand}")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 <= eval_size < len(pairs):
        raise ValueError(f"eval_size: must be in [0, {len(pairs)}) for max_operand {max_operand}, got {eval_size}")
    random.Random(seed).shuffle(pairs)
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    return rows[eval_size:], rows[:eval_size]


def write_parquet_rows(path: Path, rows: list[dict]) -> None:
    """`rows`' "question" and "answer" as a parquet table at `path` (atomic; skipped when already equal)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]})
    if path.is_file() and pq.read_table(path).equals(table):
        return
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def write_synthetic_arith(folder: str | Path, *, max_operand: int = 39, eval_size: int = 400, seed: int = 0) -> dict[str, Path]:
    """Write train.parquet / eval.parquet into `folder`; returns {"train": path, "eval": path}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, evals = arith_rows(max_operand, eval_size, seed)
    paths = {"train": folder / "train.parquet", "eval": folder / "eval.parquet"}
    write_parquet_rows(paths["train"], train)
    write_parquet_rows(paths["eval"], evals)
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--max-operand", type=int, default=39)
    p.add_argument("--eval-size", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for split, path in write_synthetic_arith(a.folder, max_operand=a.max_operand, eval_size=a.eval_size,
                                             seed=a.seed).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
