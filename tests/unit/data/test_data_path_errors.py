"""A data path that cannot be read as a whole is a config error naming the key (exit 2), not a traceback.

Not a bad record to skip and count: nothing of the split can be read. Found by running jobs on such
paths: a train_path with no file there, a .parquet file that is not a parquet table, and a table
without the mapped columns each ended the job with a traceback and exit 1 (FileNotFoundError,
pyarrow's ArrowInvalid, ValueError), in SFT and in GRPO alike.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_vlm.data.config import DataConfig
from megatron_vlm.data.sources import open_split
from megatron_vlm.errors import ConfigError
from megatron_vlm.rl.prompts.sets import load_prompt_sets

GOOD = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}


def _bad_paths(tmp_path) -> dict[str, tuple[str, dict, str]]:
    """name -> (path, hf columns or {} for messages JSONL, expected message after the key)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1" + b"\x00" * 64)
    pq.write_table(pa.table({"q": ["x"], "a": ["y"]}), tmp_path / "other_names.parquet")
    cols = {"prompt": "question", "answer": "answer"}
    return {
        "missing_jsonl": (str(tmp_path / "nope.jsonl"), {}, r"no \.jsonl / \.json data files at .*nope\.jsonl"),
        "missing_hf": (str(tmp_path / "nope_dir"), cols, r"no \.parquet / \.arrow / \.jsonl / \.json data files"),
        "corrupt_parquet": (str(tmp_path / "corrupt.parquet"), cols,
                            r".*corrupt\.parquet: cannot be read as a \.parquet table \(ArrowInvalid"),
        "missing_columns": (str(tmp_path / "other_names.parquet"), cols,
                            r".*other_names\.parquet: .*columns \['(answer|question)', '(answer|question)'\]"),
    }


CASES = ["missing_jsonl", "missing_hf", "corrupt_parquet", "missing_columns"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", ["train", "eval"])
def test_sft_split_that_cannot_be_read_names_its_key(tmp_path, case, split):
    path, cols, expect = _bad_paths(tmp_path)[case]
    (tmp_path / "good.jsonl").write_text(json.dumps(GOOD) + "\n")
    paths = {"train_path": str(tmp_path / "good.jsonl"), "eval_path": "", f"{split}_path": path}
    cfg = DataConfig(type="hf" if cols else "messages_jsonl", columns=cols, **paths)
    if cols and split == "eval":
        cfg.train_path = path  # the hf mapping applies to both splits; train is not opened here
    with pytest.raises(ConfigError, match=rf"^data\.{split}_path: {expect}"):
        open_split(cfg, split)


@pytest.mark.parametrize("case", CASES)
def test_grpo_prompt_set_that_cannot_be_read_names_its_key(tmp_path, case):
    path, cols, expect = _bad_paths(tmp_path)[case]
    data_cfg = SimpleNamespace(type="hf" if cols else "messages_jsonl", columns=cols, train_path=path, eval_path="",
                               image_root="")
    rl_cfg = SimpleNamespace(prompts=SimpleNamespace(template="{problem}", system_prompt=None))
    with pytest.raises(ConfigError, match=rf"^data\.train_path: {expect}"):
        load_prompt_sets(data_cfg, rl_cfg, run_dir=tmp_path)


def test_grpo_eval_set_with_no_usable_row_names_the_eval_key(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "eval.jsonl").write_text("not json\n")
    data_cfg = SimpleNamespace(type="messages_jsonl", columns={}, train_path=str(tmp_path / "train.jsonl"),
                               eval_path=str(tmp_path / "eval.jsonl"), image_root="")
    rl_cfg = SimpleNamespace(prompts=SimpleNamespace(template="{problem}", system_prompt=None))
    with pytest.raises(ConfigError, match=r"^data\.eval_path: prompt data .*eval\.jsonl: no usable rows"):
        load_prompt_sets(data_cfg, rl_cfg, run_dir=tmp_path)
