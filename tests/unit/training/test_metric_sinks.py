"""The metric sinks of `MetricsLogger` (training/loggers.py) under failures a long run meets: a TensorBoard event
file on a disk that fills up, a W&B call that raises. Each is logged once and the run goes on (as for the CSV
files); W&B rows are written again once it works, TensorBoard stays off for the rest of the run."""
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


def test_a_full_disk_under_the_tensorboard_file_is_logged_once_and_tensorboard_stops(tmp_path, caplog, monkeypatch):
    """A write that fails with ENOSPC: one error naming the folder and the error, TensorBoard off for the rest of the
    run, the run and its CSV going on. Before: each later row opened a new writer (a new event file in the folder)
    whose background thread died on its first write with a traceback of its own, row after row."""
    import threading

    from tensorboard.compat.tensorflow_stub.io.gfile import LocalFileSystem

    thread_errors: list = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)  # what would be printed as a traceback
    cfg = NS(tensorboard=True, csv=True, wandb=False, console=False)
    logger = MetricsLogger(cfg, tmp_path, is_main=True, total_steps=8, run_name="r")
    logger.set_start(0)
    logger.log("train", 1, {"loss": 1.0, "note": "text is not a scalar", "bad": float("nan")})

    def full(self, filename, content, mode):  # as on a full disk: the file is made, its bytes do not fit
        with open(filename, mode):
            raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as disk:
        disk.setattr(LocalFileSystem, "_write", full)  # every event file, any opened after the failure too
        with caplog.at_level("ERROR", logger="megatron_vlm"):
            for step in range(2, 7):
                logger.log("train", step, {"loss": float(step)})
            logger.log_table("moe/layer_expert_table", 6, ["layer", "e0"], [[0, 1.0]])
    logger.log("train", 7, {"loss": 7.0})  # room again: TensorBoard stays off for this run
    logger.close()
    for t in threading.enumerate():  # a dying writer thread calls its excepthook after the writer saw the error
        if type(t).__module__.startswith("tensorboard."):
            t.join(timeout=10)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    folder = tmp_path / "tensorboard"
    assert len(errors) == 1 and str(folder) in errors[0] and "No space left on device" in errors[0] \
        and "step 2" in errors[0], errors
    assert len(list(folder.iterdir())) == 1, sorted(p.name for p in folder.iterdir())  # no event file per row
    assert thread_errors == [], [a.exc_value for a in thread_errors]
    assert _scalars(folder) == {1: 1.0}
    assert (tmp_path / "metrics_train.csv").read_text().count("\n") == 8  # header + every row: the run went on


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
