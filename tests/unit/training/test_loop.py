"""The one training loop (`training.loop.run_loop`) with a fake step object: step range from the
resume step, logging / checkpoint / evaluation cadences, the stop signal (save at the step boundary,
exit 143), no second save of the final step, the final evaluation and export, fault injection."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.errors import ConfigError
from megatron_vlm.training import loop as loop_mod
from megatron_vlm.training.checkpointing import ResumePoint
from megatron_vlm.training.loop import EXIT_STOPPED, run_loop
from megatron_vlm.training.signals import StopAgreed


class FakeSteps:
    def __init__(self, eval_metrics=True):
        self.calls = []
        self.ran = []
        self.eval_metrics = eval_metrics

    def load_data_state(self, state, step):
        self.calls.append(("load", state, step))

    def train_step(self, step, *, log):
        self.ran.append(step)
        return {"loss": float(step)} if log else {}

    def evaluate(self, step):
        self.calls.append(("eval", step))
        return {"acc": 1.0} if self.eval_metrics else None

    def data_state(self, step):
        return {"pos": step}

    def finish(self):
        self.calls.append(("finish",))


class FakeCheckpointer:
    def __init__(self, enabled=True, every=0, export=True):
        self.enabled, self.every, self.export_at_end = enabled, every, export
        self.saved, self.exported = [], []

    def periodic_due(self, step):
        return self.enabled and bool(self.every) and step % self.every == 0

    def save(self, step, data_state):
        self.saved.append((step, data_state))

    def export_hf(self, out_dir):
        self.exported.append(out_dir)


class Logger:
    def __init__(self):
        self.rows, self.start = [], None

    def set_start(self, step):
        self.start = step

    def log(self, split, step, metrics):
        self.rows.append((split, step))


class StopAt:
    """A stop flag that reads as raised once `steps.ran` has `n` entries."""

    def __init__(self, steps, n):
        self.steps, self.n = steps, n

    def should_stop(self, device):
        return len(self.steps.ran) >= self.n


def _ctx(tmp_path, stop):
    return NS(stop=stop, device=torch.device("cpu"), run_dir=tmp_path)


def _run(tmp_path, steps, ckpt, *, total, stop_after=None, **kw):
    logger = Logger()
    code = run_loop(_ctx(tmp_path, StopAt(steps, stop_after or 10**9)), steps, total_steps=total, checkpointer=ckpt,
                    metrics=logger, **kw)
    return code, logger


def test_cadences_final_save_eval_and_export(tmp_path):
    steps, ckpt = FakeSteps(), FakeCheckpointer(every=2)
    code, logger = _run(tmp_path, steps, ckpt, total=5, log_every=2, eval_every=2)
    assert code == 0
    assert steps.ran == [0, 1, 2, 3, 4]
    assert [s for split, s in logger.rows if split == "train"] == [2, 4, 5]  # cadence and the last step
    assert [s for s, _ in ckpt.saved] == [2, 4, 5]
    assert ckpt.saved[-1] == (5, {"pos": 5})
    assert [c for c in steps.calls if c[0] == "eval"] == [("eval", 2), ("eval", 4), ("eval", 5)]
    assert [s for split, s in logger.rows if split == "eval"] == [2, 4, 5]
    assert ckpt.exported == [tmp_path / "hf"] and steps.calls[-1] == ("finish",)


def test_last_step_on_the_cadence_is_saved_and_evaluated_once(tmp_path):
    steps, ckpt = FakeSteps(), FakeCheckpointer(every=2)
    _run(tmp_path, steps, ckpt, total=4, log_every=1, eval_every=2)
    assert [s for s, _ in ckpt.saved] == [2, 4]
    assert [c for c in steps.calls if c[0] == "eval"] == [("eval", 2), ("eval", 4)]


def test_stop_signal_saves_at_the_step_boundary_and_exits_143(tmp_path):
    steps, ckpt = FakeSteps(), FakeCheckpointer(every=0)
    code, logger = _run(tmp_path, steps, ckpt, total=10, stop_after=3, log_every=1, eval_every=0)
    assert code == EXIT_STOPPED == 143
    assert steps.ran == [0, 1, 2]
    assert ckpt.saved == [(3, {"pos": 3})]
    assert ckpt.exported == [] and not [c for c in steps.calls if c[0] == "eval"]  # no final eval / export
    assert steps.calls[-1] == ("finish",)


def test_a_stop_request_is_not_held_up_by_a_periodic_evaluation(tmp_path):
    """SLURM leaves the ranks `--signal=B:TERM@<s>` seconds (and torchrun its shutdown timeout) to save; a stop
    raised during an evaluation step ran that evaluation (a GRPO evaluation can take minutes) before saving, and a
    rank killed meanwhile lost every step since the last periodic checkpoint. A stop raised during the evaluation
    itself still stops at that step."""
    steps, ckpt = FakeSteps(), FakeCheckpointer(every=0)
    code, logger = _run(tmp_path, steps, ckpt, total=10, stop_after=4, log_every=1, eval_every=2)
    assert code == 143 and ckpt.saved == [(4, {"pos": 4})]
    assert [c for c in steps.calls if c[0] == "eval"] == [("eval", 2)]  # not the evaluation of step 4

    class StopDuringEval(FakeSteps):
        def evaluate(self, step):
            self.stop_now = True
            return super().evaluate(step)

    class Flag:
        def should_stop(self, device):
            return getattr(steps, "stop_now", False)

    steps, ckpt = StopDuringEval(), FakeCheckpointer(every=0)
    code = run_loop(_ctx(tmp_path, Flag()), steps, total_steps=10, checkpointer=ckpt, metrics=Logger(), log_every=1,
                    eval_every=3)
    assert code == 143 and steps.ran == [0, 1, 2] and ckpt.saved == [(3, {"pos": 3})]


def test_stop_without_checkpoints_still_exits_143(tmp_path):
    steps, ckpt = FakeSteps(), FakeCheckpointer(enabled=False)
    code, _ = _run(tmp_path, steps, ckpt, total=10, stop_after=1, log_every=1)
    assert code == 143 and ckpt.saved == []


def test_resume_starts_at_the_checkpoint_step(tmp_path):
    steps, ckpt = FakeSteps(), FakeCheckpointer(every=3)
    code, logger = _run(tmp_path, steps, ckpt, total=6, log_every=1, eval_at_start=True,
                        resume=ResumePoint(step=3, data={"pos": 3}))
    assert code == 0
    assert steps.calls[0] == ("load", {"pos": 3}, 3)
    assert steps.ran == [3, 4, 5] and logger.start == 3
    assert ("eval", 0) not in steps.calls  # the evaluation at start belongs to a fresh run only
    assert [s for s, _ in ckpt.saved] == [6]


def test_resumed_at_the_end_saves_nothing_but_evaluates(tmp_path):
    steps, ckpt = FakeSteps(), FakeCheckpointer(every=3)
    _run(tmp_path, steps, ckpt, total=6, log_every=1, resume=ResumePoint(step=6, data={}))
    assert steps.ran == [] and ckpt.saved == []
    assert ("eval", 6) in steps.calls


def test_a_checkpoint_past_the_runs_length_is_refused_not_exported(tmp_path):
    """train.max_steps lowered below a checkpoint's step: the run used to evaluate and export the later weights as
    its result; now exit 2 (ConfigError) naming the key and the ways forward, before any data, eval or export."""
    steps, ckpt = FakeSteps(), FakeCheckpointer(every=3)
    with pytest.raises(ConfigError) as e:
        _run(tmp_path, steps, ckpt, total=4, log_every=1, resume=ResumePoint(step=6, data={"pos": 6}))
    assert str(e.value).startswith("train.max_steps: the checkpoint resumed is at step 6, past this run's 4 steps")
    assert "train.max_steps >= 6" in str(e.value)
    assert steps.ran == [] and ckpt.saved == [] and ckpt.exported == [] and not [c for c in steps.calls if c[0] == "eval"]


class RandomSteps(FakeSteps):
    """Steps that draw from torch's global RNG (as LoRA / model dropout does); an evaluation that draws too (as an
    eval loader's iterator does when it is created)."""

    def __init__(self):
        super().__init__()
        self.draws = {}

    def train_step(self, step, *, log):
        self.draws[step] = torch.rand(1).item()
        return super().train_step(step, log=log)

    def evaluate(self, step):
        torch.rand(3)
        return super().evaluate(step)


class RngCheckpointer(FakeCheckpointer):
    """Records the RNG state a checkpoint would hold (CheckpointManager saves `rng_state()` with each)."""

    def __init__(self, every):
        super().__init__(every=every)
        self.rng = {}

    def save(self, step, data_state):
        from megatron_vlm.checkpoint.manager import rng_state

        self.rng[step] = rng_state()
        super().save(step, data_state)


def test_a_resume_after_a_periodic_evaluation_draws_what_the_uninterrupted_run_drew(tmp_path):
    """Killed after the step-2 checkpoint and evaluation: the resumed steps 3-4 draw the same random numbers as the
    uninterrupted run (the evaluation used to shift the RNG after the checkpoint had saved it)."""
    from megatron_vlm.checkpoint.manager import set_rng_state

    torch.manual_seed(0)
    straight, ckpt = RandomSteps(), RngCheckpointer(every=2)
    _run(tmp_path, straight, ckpt, total=4, log_every=1, eval_every=2)
    assert ("eval", 2) in straight.calls
    set_rng_state(ckpt.rng[2])  # what CheckpointManager.load restores
    resumed = RandomSteps()
    _run(tmp_path, resumed, RngCheckpointer(every=2), total=4, log_every=1, eval_every=2,
         resume=ResumePoint(step=2, data={}))
    assert resumed.draws == {k: straight.draws[k] for k in (2, 3)}


def test_eval_at_start_of_a_fresh_run_and_empty_eval_not_logged(tmp_path):
    steps, ckpt = FakeSteps(eval_metrics=False), FakeCheckpointer(enabled=False, export=False)
    _, logger = _run(tmp_path, steps, ckpt, total=2, log_every=1, eval_at_start=True)
    assert [c for c in steps.calls if c[0] == "eval"] == [("eval", 0), ("eval", 2)]
    assert not [r for r in logger.rows if r[0] == "eval"] and ckpt.exported == []


def test_before_step_hook_runs_before_each_step_and_production_reads_no_fault_variable(tmp_path, monkeypatch):
    """The kill-at-step fault injection is a test hook (tests/integration/fault_entry.py): the loop
    calls `before_step(n)` before step n and never reads MEGATRON_VLM_FAULT_KILL_AT_STEP itself."""
    monkeypatch.setenv("MEGATRON_VLM_FAULT_KILL_AT_STEP", "2")
    steps, seen = FakeSteps(), []
    _run(tmp_path, steps, FakeCheckpointer(enabled=False, export=False), total=3, log_every=1,
         before_step=lambda n: seen.append((n, list(steps.ran))))
    assert steps.ran == [0, 1, 2]  # the variable alone kills nothing
    assert seen == [(1, []), (2, [0]), (3, [0, 1])]
    import pathlib
    pkg = pathlib.Path(loop_mod.__file__).resolve().parents[1]
    assert not [p for p in pkg.rglob("*.py") if "FAULT_KILL" in p.read_text()]


def test_fault_entry_hook_kills_before_the_named_step(monkeypatch):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "integration" / "fault_entry.py"
    spec = importlib.util.spec_from_file_location("fault_entry", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    killed = []
    monkeypatch.setattr(mod.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    hook = mod.kill_before(3)
    hook(1), hook(2)
    assert killed == []
    hook(3)
    assert killed == [(os.getpid(), signal.SIGKILL)]


def test_stop_signal_on_a_periodic_save_step_saves_that_step_once(tmp_path):
    """SIGTERM arriving right after the periodic save of step 3: no second save of step 3 (a second
    save would replace the complete checkpoint just written, opening a window for losing it)."""
    steps, ckpt = FakeSteps(), FakeCheckpointer(every=3)
    code, _ = _run(tmp_path, steps, ckpt, total=10, stop_after=3, log_every=1)
    assert code == EXIT_STOPPED
    assert ckpt.saved == [(3, {"pos": 3})]


class RecordingLogger(Logger):
    """A metrics logger that says which eval rows it holds, as MetricsLogger's CSV does (`logged`)."""

    def logged(self, split, step):
        return (split, step) in self.rows


def test_an_evaluation_a_stop_skipped_runs_when_the_run_resumes(tmp_path):
    """A stop at a step whose periodic evaluation was due skips it so that the save comes first; the run resumed at
    that step evaluates it before its next step, so the evaluation curve has no hole at the step the job was
    stopped (it was never run anywhere before)."""
    steps, ckpt, logger = FakeSteps(), FakeCheckpointer(every=0), RecordingLogger()
    code = run_loop(_ctx(tmp_path, StopAt(steps, 4)), steps, total_steps=8, checkpointer=ckpt, metrics=logger,
                    log_every=1, eval_every=2)
    assert code == 143 and ckpt.saved == [(4, {"pos": 4})] and ("eval", 4) not in logger.rows
    resumed = FakeSteps()
    code = run_loop(_ctx(tmp_path, StopAt(resumed, 10**9)), resumed, total_steps=8, checkpointer=FakeCheckpointer(),
                    metrics=logger, log_every=1, eval_every=2, resume=ResumePoint(step=4, data={"pos": 4}))
    assert code == 0 and resumed.ran == [4, 5, 6, 7]
    assert [c for c in resumed.calls if c[0] == "eval"] == [("eval", 4), ("eval", 6), ("eval", 8)]
    assert [s for split, s in logger.rows if split == "eval"] == [2, 4, 6, 8]


def test_a_resume_does_not_evaluate_a_logged_step_again(tmp_path):
    """Resumed at a step whose evaluation is in the metrics already (a periodic save and evaluation, then a kill), or
    with a logger that cannot tell (no CSV): no second evaluation of that step."""
    for logger in (RecordingLogger(), Logger()):
        logger.rows.append(("eval", 2))
        steps = FakeSteps()
        run_loop(_ctx(tmp_path, StopAt(steps, 10**9)), steps, total_steps=4, checkpointer=FakeCheckpointer(),
                 metrics=logger, log_every=1, eval_every=2, resume=ResumePoint(step=2, data={}))
        assert [c for c in steps.calls if c[0] == "eval"] == [("eval", 4)]
    steps, logger = FakeSteps(), Logger()  # cannot tell: as before, nothing evaluated at the resume step
    run_loop(_ctx(tmp_path, StopAt(steps, 10**9)), steps, total_steps=4, checkpointer=FakeCheckpointer(),
             metrics=logger, log_every=1, eval_every=2, resume=ResumePoint(step=2, data={}))
    assert [c for c in steps.calls if c[0] == "eval"] == [("eval", 4)]


def test_metrics_logger_says_which_eval_steps_its_csv_holds(tmp_path):
    from megatron_vlm.training.loggers import MetricsLogger

    cfg = NS(tensorboard=False, csv=True, wandb=False, console=False)
    first = MetricsLogger(cfg, tmp_path, is_main=True, total_steps=8, run_name="r")
    first.set_start(0)
    for step in (2, 4, 6):
        first.log("eval", step, {"acc": 0.5})
    first.close()
    resumed = MetricsLogger(cfg, tmp_path, is_main=True, total_steps=8, run_name="r")
    resumed.set_start(4)  # the row of step 6 is dropped: run again
    assert [resumed.logged("eval", s) for s in (2, 4, 6)] == [True, True, False]
    assert resumed.logged("train", 2) is False  # no train rows written
    assert MetricsLogger(cfg, tmp_path, is_main=False, total_steps=8, run_name="r").logged("eval", 2) is None
    assert MetricsLogger(NS(tensorboard=False, csv=False, wandb=False, console=False),
                         tmp_path, is_main=True, total_steps=8, run_name="r").logged("eval", 2) is None


class AgreeingSteps(FakeSteps):
    """A step object that agrees the stop at its start (`stop_at_step_start`, as SFTStep's counts all-reduce does):
    with a stop pending it raises `StopAgreed` before running; `stop_during` asks for a stop during that step (1-based)."""

    stop_at_step_start = True

    def __init__(self, flag, stop_during=0):
        super().__init__()
        self.flag, self.stop_during = flag, stop_during

    def train_step(self, step, *, log):
        if self.flag.pending():
            raise StopAgreed("1 rank(s) asked to stop before the step began")
        if step + 1 == self.stop_during:
            self.flag.signum = 15
        return super().train_step(step, log=log)


class CountedFlag:
    """A stop flag that records after which step (the loop's `steps.ran`) the loop read it."""

    def __init__(self):
        self.signum, self.reads, self.steps = 0, [], None

    def pending(self):
        return bool(self.signum)

    def should_stop(self, device):
        self.reads.append(len(self.steps.ran))
        return bool(self.signum)


def _agreeing(tmp_path, stop_during, *, every=0, eval_every=3, total=6):
    flag = CountedFlag()
    steps, ckpt = AgreeingSteps(flag, stop_during), FakeCheckpointer(every=every)
    flag.steps = steps
    code = run_loop(_ctx(tmp_path, flag), steps, total_steps=total, checkpointer=ckpt, metrics=Logger(), log_every=1,
                    eval_every=eval_every)
    return code, steps, ckpt, flag


def test_a_step_that_agrees_the_stop_at_its_start_leaves_the_loop_no_read_between_steps(tmp_path):
    """The loop reads the flag only where it needs the answer before a next step would start: around an evaluation
    that is due, and after the last step; a stop asked during step N is agreed at step N + 1's start, and the loop
    saves step N and exits 143, as when it read the flag after step N."""
    code, steps, ckpt, flag = _agreeing(tmp_path, 0)
    assert code == 0 and flag.reads == [3, 3, 6] and ckpt.saved == [(6, {"pos": 6})]
    code, steps, ckpt, flag = _agreeing(tmp_path, 2)  # a middle step: step 3 agrees, runs nothing
    assert code == 143 and steps.ran == [0, 1] and ckpt.saved == [(2, {"pos": 2})] and flag.reads == []
    assert not [c for c in steps.calls if c[0] == "eval"] and ckpt.exported == [] and steps.calls[-1] == ("finish",)
    code, steps, ckpt, flag = _agreeing(tmp_path, 3)  # an evaluation is due: not run, the save comes first
    assert code == 143 and ckpt.saved == [(3, {"pos": 3})] and not [c for c in steps.calls if c[0] == "eval"]
    code, steps, ckpt, flag = _agreeing(tmp_path, 6)  # the last step: acted on, no final evaluation or export
    assert code == 143 and ckpt.saved == [(6, {"pos": 6})] and ckpt.exported == []
    assert [c for c in steps.calls if c[0] == "eval"] == [("eval", 3)]
    code, steps, ckpt, flag = _agreeing(tmp_path, 2, every=2)  # on a periodic save step: saved once
    assert code == 143 and ckpt.saved == [(2, {"pos": 2})]
    code, steps, ckpt, flag = _agreeing(tmp_path, 1, eval_every=0, total=1)  # a one-step run
    assert code == 143 and ckpt.saved == [(1, {"pos": 1})] and flag.reads == [1]


def test_a_run_resumed_at_its_last_step_does_not_log_the_final_evaluation_twice(tmp_path):
    """The final evaluation was logged, then the export failed (disk full: exit 1) or the job was killed while
    exporting; the run started again resumes at the last step, runs no step and exports. It evaluated that step a
    second time and appended a second row of it to metrics_eval.csv (one row per step is promised: the rows after
    the resume step are dropped, the resume step's own is kept). A logger that cannot tell still evaluates."""

    class FailingExport(FakeCheckpointer):
        def export_hf(self, out_dir):
            raise SystemExit(1)

    steps, logger = FakeSteps(), RecordingLogger()
    with pytest.raises(SystemExit):
        run_loop(_ctx(tmp_path, StopAt(steps, 10**9)), steps, total_steps=4, checkpointer=FailingExport(),
                 metrics=logger, log_every=1, eval_every=2)
    assert [s for split, s in logger.rows if split == "eval"] == [2, 4]
    resumed, ckpt = FakeSteps(), FakeCheckpointer()
    code = run_loop(_ctx(tmp_path, StopAt(resumed, 10**9)), resumed, total_steps=4, checkpointer=ckpt,
                    metrics=logger, log_every=1, eval_every=2, resume=ResumePoint(step=4, data={"pos": 4}))
    assert code == 0 and resumed.ran == [] and ckpt.exported == [tmp_path / "hf"]
    assert [c for c in resumed.calls if c[0] == "eval"] == []
    assert [s for split, s in logger.rows if split == "eval"] == [2, 4]
    unknowing = FakeSteps()  # no CSV to ask: evaluated, as before
    run_loop(_ctx(tmp_path, StopAt(unknowing, 10**9)), unknowing, total_steps=4, checkpointer=FakeCheckpointer(),
             metrics=Logger(), log_every=1, eval_every=2, resume=ResumePoint(step=4, data={}))
    assert ("eval", 4) in unknowing.calls
