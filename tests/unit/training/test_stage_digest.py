"""A finished stage records a digest of its effective config beside its export; a rerun whose stage settings
changed since still skips the stage (its export exists, as documented) but says so in a warning naming the
stage. An unchanged rerun, and an export from before digests were recorded, skip silently. `run_sft` is
replaced by a stand-in that writes the export (the stage bookkeeping is under test, not training)."""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

import megatron_vlm.jobs as jobs
from megatron_vlm.config import load_config_dict
from megatron_vlm.parallel.dist import DistEnv
from megatron_vlm.training.context import RunContext


def _raw(out: Path) -> dict:
    return {"model": {"path": str(out / "m"), "synthesize": "tiny_internvl"}, "data": {"image_root": str(out)},
            "train": {"output_dir": str(out / "run"), "max_steps": 2}, "optimizer": {"lr": 4e-5},
            "stages": [{"name": "s1", "train_path": str(out / "1.jsonl")},
                       {"name": "s2", "train_path": str(out / "2.jsonl"), "lr": 2e-5}]}


def _run(raw: dict, monkeypatch, caplog) -> tuple[list[str], list[str]]:
    trained: list[str] = []

    def fake_sft(ctx, before_step=None):
        (ctx.run_dir / "hf").mkdir(parents=True, exist_ok=True)
        (ctx.run_dir / "hf" / "config.json").write_text("{}")
        trained.append(ctx.run_dir.name)
        return 0

    monkeypatch.setattr(jobs, "run_sft", fake_sft)
    cfg = load_config_dict(copy.deepcopy(raw))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_vlm"):
        assert jobs.run_stages(RunContext(cfg=cfg, env=env, run_dir=Path(cfg.train.output_dir))) == 0
    return trained, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_changed_stage_settings_warn_on_the_skip(tmp_path, monkeypatch, caplog):
    raw = _raw(tmp_path)
    assert _run(raw, monkeypatch, caplog) == (["s1", "s2"], [])
    assert _run(raw, monkeypatch, caplog) == ([], [])  # unchanged: skipped silently
    raw["stages"][1]["lr"] = 1e-5
    trained, warnings = _run(raw, monkeypatch, caplog)
    assert trained == [] and len(warnings) == 1, warnings
    assert "'s2'" in warnings[0] and "skipped" in warnings[0] and "export" in warnings[0], warnings[0]
    assert str(tmp_path / "run" / "s2") in warnings[0]  # how to train it again: remove its folder


def test_export_without_digest_skips_silently(tmp_path, monkeypatch, caplog):
    raw = _raw(tmp_path)
    for name in ("s1", "s2"):  # exports made before digests were recorded
        (tmp_path / "run" / name / "hf").mkdir(parents=True)
        (tmp_path / "run" / name / "hf" / "config.json").write_text("{}")
    raw["stages"][1]["lr"] = 1e-5
    assert _run(raw, monkeypatch, caplog) == ([], [])


def test_a_stop_signal_during_a_stage_s_final_export_stops_before_the_next_stage(tmp_path, monkeypatch):
    """A SIGTERM that comes after a stage's last step (its final evaluation or export) is not acted on by that stage
    (it finishes, 0); the next stage then started all the same, built its model and ran a step before the stop was
    read, spending the scheduler's grace time. Now the job stops between the stages with 143 (the finished stage's
    export kept: a rerun skips it)."""
    import signal

    from megatron_vlm.training.loop import EXIT_STOPPED

    trained: list[str] = []

    def fake_sft(ctx, before_step=None):
        (ctx.run_dir / "hf").mkdir(parents=True, exist_ok=True)
        (ctx.run_dir / "hf" / "config.json").write_text("{}")
        trained.append(ctx.run_dir.name)
        ctx.stop.signum = signal.SIGTERM  # arrived while the stage exported
        return 0

    monkeypatch.setattr(jobs, "run_sft", fake_sft)
    cfg = load_config_dict(_raw(tmp_path))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    assert jobs.run_stages(RunContext(cfg=cfg, env=env, run_dir=Path(cfg.train.output_dir))) == EXIT_STOPPED
    assert trained == ["s1"]
