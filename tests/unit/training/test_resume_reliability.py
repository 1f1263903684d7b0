"""Resume edge cases in one process:

- a checkpoint written by fewer processes loads on a rank that has no `extra_rank<R>.pt` of its own (rank 0's
  global scheduler / step / data position), instead of every checkpoint counting as corrupt;
- a data position the run's loader cannot continue (another `data.max_tokens_per_pack`, `data.train_path`,
  `train.seed`, `data.shuffle`, or a data-parallel split that does not divide it) is one line naming the key and the ways
  forward (ConfigError: exit 2), not a traceback, for SFT and for the pair trainers (DPO, reward model);
- `metrics_train.csv` / `metrics_eval.csv` keep one row per step when steps are run again after a resume.
"""
from __future__ import annotations

import csv
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from megatron_vlm.checkpoint.manager import CheckpointManager
from megatron_vlm.errors import ConfigError
from megatron_vlm.training.loggers import MetricsLogger
from megatron_vlm.training.pair_step import PairStep
from megatron_vlm.training.sft import SFTStep, data_state_refusal


def test_a_rank_without_its_own_extra_file_resumes_from_rank_0s(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    CheckpointManager(tmp_path, keep_last=0, rank=0).save(2, model, opt, {"data": {"global_packs_consumed": 2}})
    path = tmp_path / "checkpoints" / "step_2"
    assert sorted(p.name for p in path.glob("extra_rank*.pt")) == ["extra_rank0.pt"]
    fresh = torch.nn.Linear(4, 3)
    extra = CheckpointManager(tmp_path, keep_last=0, rank=1).load(path, fresh, torch.optim.AdamW(fresh.parameters()))
    assert extra["step"] == 2 and extra["data"] == {"global_packs_consumed": 2}
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize("rank, expect", [(0, "extra_rank0.pt missing"), (1, "extra_rank1.pt and extra_rank0.pt missing")])
def test_a_missing_extra_file_is_named_once(tmp_path, rank, expect):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    CheckpointManager(tmp_path, keep_last=0, rank=0).save(2, model, opt, {})
    path = tmp_path / "checkpoints" / "step_2"
    (path / "extra_rank0.pt").unlink()
    with pytest.raises(FileNotFoundError) as e:
        CheckpointManager(tmp_path, keep_last=0, rank=rank).load(path, model, opt)
    assert str(e.value).endswith(expect) and str(e.value).count("extra_rank0.pt") == 1


class _Loader:
    """The data-state part of the SFT loader (data/loader.py), with the same refusal."""

    def __init__(self, capacity=512, records=10, seed=0, dp=1, shuffle=True):
        self.planner = NS(capacity=capacity, lengths=np.zeros(records), seed=seed, shuffle=shuffle)
        self.dp = self.dp_size = dp

    def load_state_dict(self, state):
        from megatron_vlm.data.loader import SFTDataLoader

        SFTDataLoader.load_state_dict(NS(planner=self.planner, dp_size=self.dp, _consumed=0, _epoch=None, data_files=None,
                                         _pack_classes_digest=lambda: None), state)


def _state(capacity=512, records=10, seed=0, g=4, shuffle=True):
    return {"global_packs_consumed": g, "capacity": capacity, "num_records": records, "seed": seed, "shuffle": shuffle}


@pytest.mark.parametrize("state, loader, expect", [
    (_state(capacity=256), _Loader(), "data.max_tokens_per_pack: the checkpoint was written with data.max_tokens_per_pack "
                                      "= 256, this run has data.max_tokens_per_pack = 512"),
    (_state(records=12), _Loader(), "data.train_path: the checkpoint was written reading 12 train records, this run reads 10"),
    (_state(seed=3), _Loader(), "train.seed: the checkpoint was written with train.seed = 3"),
    (_state(shuffle=False), _Loader(), "data.shuffle: the checkpoint was written with data.shuffle = false, this run has "
                                       "data.shuffle = true"),
    (_state(g=3), _Loader(dp=2), "checkpoint.resume: the checkpoint's data position cannot be continued"),
    # a GRPO run's data state (a checkpoint whose layout record predates train.mode): a KeyError traceback before
    ({"next_step": 4, "seed": 0, "num_prompts": 10, "prompts_per_step": 2}, _Loader(),
     "train.mode: the checkpoint's data state holds no packed-data position"),
])
@pytest.mark.parametrize("kind", [SFTStep, PairStep])
def test_a_data_position_that_cannot_continue_is_one_line_naming_the_key(state, loader, expect, kind):
    step = kind.__new__(kind)
    step.loader = loader
    with pytest.raises(ConfigError) as e:
        step.load_data_state(state, 4)
    msg = str(e.value)
    assert msg.startswith(expect) and "\n" not in msg
    assert 'checkpoint.resume = "none"' in msg
    assert data_state_refusal(state, loader, ValueError("x")).split(" (")[0] == msg.split(" (")[0]


@pytest.mark.parametrize("kind", [SFTStep, PairStep])
def test_a_refusal_of_other_pack_classes_does_not_send_the_user_to_the_data_parallel_size(kind):
    """The video pack classes differ (another length cache version or tile setting): the data-parallel size is not
    the way out, as the refusal used to say of every position it had no key for."""
    step = kind.__new__(kind)
    step.loader = _Loader()
    with pytest.raises(ConfigError) as e:
        step.load_data_state({**_state(), "pack_classes": "0123456789abcdef"}, 4)
    msg = str(e.value)
    assert msg.startswith("checkpoint.resume: the checkpoint's data position cannot be continued here (data state: the "
                          "records' video pack classes differ") and "\n" not in msg, msg
    assert "data-parallel size" not in msg and 'checkpoint.resume = "none"' in msg


def _rows(path):
    with path.open() as f:
        return [r["step"] for r in csv.DictReader(f)]


def test_rows_of_steps_run_again_after_a_resume_are_not_duplicated(tmp_path):
    cfg = NS(tensorboard=False, csv=True, wandb=False, console=False)
    first = MetricsLogger(cfg, tmp_path, is_main=True, total_steps=6, run_name="r")
    first.set_start(0)
    for s in range(1, 6):  # checkpoint at 2; steps 3-5 lost (kill -9, or a fallback past a corrupt step_4)
        first.log("train", s, {"loss": float(s)})
    first.log("eval", 4, {"loss": 0.5})
    first.close()
    again = MetricsLogger(cfg, tmp_path, is_main=True, total_steps=6, run_name="r")
    again.set_start(2)
    for s in range(3, 7):
        again.log("train", s, {"loss": 10.0 + s})
    again.close()
    assert _rows(tmp_path / "metrics_train.csv") == ["1", "2", "3", "4", "5", "6"]
    assert _rows(tmp_path / "metrics_eval.csv") == []
    with (tmp_path / "metrics_train.csv").open() as f:
        assert [float(r["loss"]) for r in csv.DictReader(f)] == [1, 2, 13, 14, 15, 16]


def _csv_logger(tmp_path):
    """A CSV-only metrics logger with one train row written: (logger, its train sink, the sink's real file)."""
    cfg = NS(tensorboard=False, csv=True, wandb=False, console=False)
    logger = MetricsLogger(cfg, tmp_path, is_main=True, total_steps=6, run_name="r")
    logger.set_start(0)
    logger.log("train", 1, {"loss": 1.0})
    sink = logger._csv["train"]
    return logger, sink, sink._fh


def test_a_metrics_row_that_cannot_be_written_is_logged_and_left_out(tmp_path, caplog):
    """A full disk at a metrics write raised OSError out of the training loop (the work since the last checkpoint
    lost, a traceback instead of the save's "disk full" message). Now: one error line, the row left out, the file
    cut back to its last whole row, and rows written again once the disk has room."""
    import errno

    logger, sink, real = _csv_logger(tmp_path)

    class Full:  # half of each write lands, then ENOSPC (what a filling disk does)
        def __getattr__(self, name):
            return getattr(real, name)

        def write(self, data):
            real.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    sink._fh = Full()
    with caplog.at_level("ERROR", logger="megatron_vlm"):
        logger.log("train", 2, {"loss": 2.0})
        logger.log("train", 3, {"loss": 3.0})
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "metrics_train.csv" in errors[0].getMessage() and "step 2" in errors[0].getMessage()
    sink._fh = real  # room again
    logger.log("train", 4, {"loss": 4.0})
    logger.close()
    assert _rows(tmp_path / "metrics_train.csv") == ["1", "4"]
    assert (tmp_path / "metrics_train.csv").read_text().count("\n") == 3  # header + two whole rows


def test_a_short_write_on_a_filling_disk_leaves_no_half_row(tmp_path, caplog):
    """A write to a nearly full disk lands the bytes that fit and returns their count without raising (write(2)
    raises ENOSPC only when nothing fits). The unbuffered CSV file took that short count as success: the file was
    left ending in half a row, which the next row, once the disk had room again, continued on the same line.
    Now the rest is written or the row is cut back and logged as not written."""
    import errno

    logger, sink, real = _csv_logger(tmp_path)
    room = [3]  # bytes left on the disk: less than the row

    class Filling:
        def __getattr__(self, name):
            return getattr(real, name)

        def write(self, data):
            if room[0] == 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = real.write(bytes(data[: room[0]]))
            room[0] -= n
            return n

    sink._fh = Filling()
    with caplog.at_level("ERROR", logger="megatron_vlm"):
        logger.log("train", 2, {"loss": 2.0})
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "step 2" in errors[0].getMessage()
    sink._fh = real  # room again
    logger.log("train", 3, {"loss": 3.0})
    logger.close()
    assert _rows(tmp_path / "metrics_train.csv") == ["1", "3"]
    with (tmp_path / "metrics_train.csv").open() as f:
        assert [float(r["loss"]) for r in csv.DictReader(f)] == [1.0, 3.0]
