"""The metric sinks of `MetricsLogger` (training/loggers.py) under failures a long run meets: a TensorBoard event
file on a disk that fills up, a W&B call that raises. Each is logged once and the run goes on (as for the CSV
files), and rows are written again once the sink works."""
from __future__ import annotations

import errno
from types import SimpleNamespace as NS

import pytest

from megatron_vlm.training.loggers import MetricsLogger

pytest.importorskip("tensorboard")


def _scalars(folder) -> dict[int, float]:
    """step -> value of every "train/loss" scalar in the event files of `folder` (tensorboard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for f in sorted(folder.iterdir()):
        acc = EventAccumulator(str(f))
        acc.Reload()
        if "train/loss" in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars("train/loss")})
    return out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the event writer's thread
def test_a_full_disk_under_the_tensorboard_file_is_logged_and_the_run_goes_on(tmp_path, caplog, monkeypatch):
    """Before: the event writer's background thread died on ENOSPC and every later `log` raised its OSError out of
    the training loop (a traceback, the work since the last checkpoint lost)."""
    cfg = NS(tensorboard=True, csv=False, wandb=False, console=False)
    logger = MetricsLogger(cfg, tmp_path, is_main=True, total_steps=6, run_name="r")
    logger.set_start(0)
    logger.log("train", 1, {"loss": 1.0, "note": "text is not a scalar", "bad": float("nan")})
    from tensorboard.summary.writer.record_writer import RecordWriter

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RecordWriter, "write", full)  # every event file, the ones opened after the failure too
    with caplog.at_level("ERROR", logger="megatron_vlm"):
        logger.log("train", 2, {"loss": 2.0})
        logger.log("train", 3, {"loss": 3.0})
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "tensorboard" in errors[0] and "step 2" in errors[0], errors
    monkeypatch.undo()  # room again: the next row opens a new event file
    logger.log("train", 4, {"loss": 4.0})
    logger.close()
    assert _scalars(tmp_path / "tensorboard") == {1: 1.0, 4: 4.0}


def test_a_wandb_error_is_logged_once_and_the_run_goes_on(tmp_path, caplog):
    """A W&B call that raises (its service gone, a full disk under its offline folder) ended the run."""
    cfg = NS(tensorboard=False, csv=True, wandb=False, console=False)
    logger = MetricsLogger(cfg, tmp_path, is_main=True, total_steps=6, run_name="r")
    logged = []

    class FlakyRun:
        broken = True

        def log(self, data, step):
            if self.broken:
                raise RuntimeError("wandb service is gone")
            logged.append(step)

        def finish(self):
            raise RuntimeError("wandb service is gone")

    run = logger._wandb = FlakyRun()
    logger.set_start(0)
    with caplog.at_level("ERROR", logger="megatron_vlm"):
        logger.log("train", 1, {"loss": 1.0})
        logger.log("train", 2, {"loss": 2.0})
        run.broken = False
        logger.log("train", 3, {"loss": 3.0})
        logger.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and "step 1" in errors[0] and "finish" in errors[1], errors
    assert logged == [3]
    assert (tmp_path / "metrics_train.csv").read_text().count("\n") == 4  # the CSV got every row


def _ctx(tmp_path, *, is_main=True, **sinks):
    cfg = NS(logging=NS(**{"tensorboard": False, "csv": False, "wandb": False, "console": False, **sinks}))
    return NS(cfg=cfg, run_dir=tmp_path, env=NS(is_main=is_main))


@pytest.mark.parametrize("sink, blocker", [("tensorboard", "tensorboard"), ("csv", "metrics_train.csv")])
def test_a_sink_that_cannot_be_opened_is_a_config_error_before_the_first_step(tmp_path, sink, blocker):
    """Before: a `tensorboard` path that is a file raised FileExistsError on rank 0 alone (a traceback once the model
    was built and resumed; the other ranks waited in their next collective), and a metrics CSV path that is a folder
    was found only at the first row, then every row was left out: a run that trained and recorded nothing."""
    from megatron_vlm.errors import ConfigError
    from megatron_vlm.training.loggers import build_metrics_logger

    if sink == "tensorboard":
        (tmp_path / blocker).write_text("not a folder")
    else:
        (tmp_path / blocker).mkdir()
    with pytest.raises(ConfigError, match=rf"^logging\.{sink}: cannot write .*{blocker}"):
        build_metrics_logger(_ctx(tmp_path, **{sink: True}), 4, {})


def test_every_rank_stops_when_rank_0_cannot_open_a_sink(tmp_path, monkeypatch):
    """The other ranks get rank 0's error through the all-gather, so the job ends with exit 2 on every rank."""
    from megatron_vlm.errors import ConfigError
    from megatron_vlm.training import loggers

    monkeypatch.setattr(loggers, "gather_errors", lambda err: ["logging.csv: cannot write x (not a regular file)", err])
    with pytest.raises(ConfigError, match=r"^logging\.csv: cannot write x"):
        loggers.build_metrics_logger(_ctx(tmp_path, is_main=False, csv=True), 4, {})


def test_a_wandb_init_failure_is_a_config_error_on_every_rank(tmp_path, monkeypatch):
    """Before: wandb.init's own exception (an offline folder it cannot write, no network in "online" mode) was a
    traceback on rank 0 after the model was built while the other ranks waited in their next collective; now a
    ConfigError naming logging.wandb, shared with every rank (exit 2). wandb itself is not installed here: a stand-in
    module whose init raises as wandb's does."""
    import sys
    import types

    from megatron_vlm.errors import ConfigError
    from megatron_vlm.training.loggers import build_metrics_logger

    fake = types.ModuleType("wandb")

    def init(**kwargs):  # noqa: ARG001
        raise PermissionError("[Errno 13] Permission denied: 'wandb'")

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    ctx = _ctx(tmp_path, csv=True, wandb=True)
    ctx.cfg.logging.wandb_project, ctx.cfg.logging.experiment_name, ctx.cfg.logging.wandb_mode = "p", None, "offline"
    with pytest.raises(ConfigError, match=r"^logging\.wandb: wandb\.init failed \(PermissionError"):
        build_metrics_logger(ctx, 4, {})
