"""The one training loop of every job kind: `run_loop(ctx, steps, ...) -> exit code`.

The loop owns everything around a step; the job kind (SFT, GRPO) owns the step itself through a
small object (`StepRunner`). From the resume step to `total_steps`, per step:

1. the optional `before_step(n)` hook (None in production; the tests' entry script installs one that
   SIGKILLs the process before step n, to prove that resuming never needs a clean exit);
2. `steps.train_step(step, log=...)` runs the step; `log` is True on the logging cadence
   (`train.log_every` and the last step) and the returned metrics are logged as "train" when not empty, with
   `peak_memory_gib`: this rank's memory peak since the previous train row (training/peak_memory.py; the steps of
   the interval and any checkpoint or evaluation between), then the peak is reset;
3. a periodic checkpoint (`checkpoint.every_steps`, not at the last step: that one is saved once, at the end);
4. a periodic evaluation (`eval_every`, not at the last step: the final evaluation follows); it leaves the RNG
   states as it found them, so the steps after it draw what a run resumed from step 3's checkpoint draws (LoRA /
   model dropout): a resume after a kill is exact whatever the evaluation cadence. Skipped when a stop was
   requested by then: the time a scheduler leaves before it kills (SLURM's `--signal` lead) is the checkpoint's.
   The run resumed at that step evaluates it before its first step, when the eval CSV has no row of that step
   (skipped, given up for a stop, or killed while it ran; `_not_evaluated`);
5. the stop flag (SIGTERM / SIGUSR1, agreed by all ranks; read before the evaluation and again after it): save a
   checkpoint at this step boundary (unless step 3 just saved this very step: a step is never saved twice) and
   return 143 on every rank. A stop requested after the last step (during the final evaluation or export) is not
   acted on: the run finishes and returns 0 (launch/slurm/train.sbatch then does not requeue it: runner.py).
   A step object with `stop_at_step_start` (SFT, DPO, reward model) agrees the stop in the all-reduce its next step
   makes before its forward anyway (one read of the device fewer per step; on CUDA each is a stream sync): that
   step puts back the packs it fetched and raises `StopAgreed` before any of it runs, and the loop saves this
   boundary and returns 143 all the same. The loop still reads the flag itself where it needs the answer before a
   next step: when an evaluation is due, and after the last step.

A step may also end early with `StepAbandoned` (training/signals.py: a stop signal arrived while a wait of the step
hung, and every rank gave the step up together, before any of it was applied): the RNG states are put back as they
were before the step, the checkpoint of the step boundary before it is saved (the data state of that step, so a
resumed run draws and redoes the abandoned step's prompts) and the loop returns 143, as for a stop at a boundary.

An evaluation given up for a stop (`EvaluationAbandoned`: a stop signal arrived while its verifiers or environments
hung, and every rank gave it up together) logs nothing of it (part of the held-out set would pass for the whole) and
ends the run as a stop does, exit 143: after a step, the checkpoint of that step is saved; before the first step of a
fresh run, nothing is; after the last step (the final checkpoint already saved), the export is skipped, so that a
requeued run, resumed at the last step, evaluates and exports.

A step that ran but must end the run (`StopAfterStep`: GRPO steps without a usable reward for
`rl.reward_pool.max_failed_steps` steps in a row) has its row logged; its checkpoint is saved when steps worth keeping
would otherwise be lost (the newest checkpoint is older than the steps that were wasted), `steps.finish()` runs, then
its error is raised (exit 1 through the runner). Otherwise the newest checkpoint stays the resume point.

A checkpoint of a later step than `total_steps` (train.max_steps lowered since) is refused (ConfigError: exit 2)
rather than evaluated and exported as this run's result. A run that reaches `total_steps` saves the final
checkpoint (only when it ran a step), evaluates (not again when it resumed at that step and the metrics hold its
evaluation: the export had failed or was killed) and exports a Hugging Face folder (`checkpoint.export_hf`).
`steps.finish()` runs in both cases.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional, Protocol

from megatron_vlm.checkpoint.manager import rng_state, set_rng_state
from megatron_vlm.errors import ConfigError
from megatron_vlm.parallel.collectives import any_rank
from megatron_vlm.training.checkpointing import Checkpointer, ResumePoint
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.peak_memory import PeakMemory
from megatron_vlm.training.signals import EvaluationAbandoned, StepAbandoned, StopAgreed

__all__ = ["StepRunner", "StopAfterStep", "run_loop", "EXIT_STOPPED"]

log = logging.getLogger("megatron_vlm")

EXIT_STOPPED = 143
"""Exit code of a run stopped by SIGTERM / SIGUSR1 after its checkpoint (128 + SIGTERM)."""


class StopAfterStep(Exception):
    """Raised by `train_step` when its step ran (the update applied) but the run must end with `error`: `metrics`, the
    step's row (empty: none); `wasted`, the steps in a row, this one included, whose work is worth nothing (a
    checkpoint of the step is saved only when steps before them would otherwise be lost)."""

    def __init__(self, error: BaseException, metrics: dict[str, float], *, wasted: int):
        super().__init__(str(error))
        self.error, self.metrics, self.wasted = error, metrics, int(wasted)


class StepRunner(Protocol):
    """What a job kind gives the loop. Steps are 0-based when run (`train_step(s)` turns policy /
    model version s into s + 1); every other method gets the number of steps done. Optional attribute
    `stop_at_step_start` (absent: False): `train_step` agrees the stop at its start, before any of it runs, and
    raises `StopAgreed` (the packed-data steps: training/sft.py `agree_counts`)."""

    def load_data_state(self, state: dict, step: int) -> None:
        """Resume the data position from a checkpoint's data state (`step` steps were done)."""

    def train_step(self, step: int, *, log: bool) -> dict[str, float]:
        """Run step `step`; return the metrics to log as "train" (empty: nothing to log)."""

    def evaluate(self, step: int) -> Optional[dict[str, float]]:
        """Held-out metrics after `step` steps (None: nothing to evaluate)."""

    def data_state(self, step: int) -> dict:
        """The data state to save with a checkpoint after `step` steps."""

    def finish(self) -> None:
        """End of the run (finished or stopped): summaries, releasing workers."""


def past_the_end(step: int, total_steps: int) -> str:
    """The exit-2 line for a checkpoint of a later step than the run's length: finishing there would evaluate and
    export the step-`step` weights as the result of a `total_steps`-step run."""
    return (f"train.max_steps: the checkpoint resumed is at step {step}, past this run's {total_steps} steps "
            f"(train.max_steps, or train.epochs); set train.max_steps >= {step} to go on from it, name an earlier "
            f"checkpoint in checkpoint.resume, or convert this one (launch/convert_checkpoint.py)")


def _not_evaluated(ctx: RunContext, metrics, step: int) -> bool:
    """Whether the periodic evaluation due at `step`, the resume step, is missing from the metrics (every rank alike:
    rank 0 reads its eval CSV, one small all-reduce). Why: a stop at that step skips its evaluation so that the
    checkpoint is saved first, and a kill during it loses it; the resumed run starts after that step and never
    evaluated it, which left a hole in the evaluation curve. A logger that cannot tell (no CSV) says no."""
    logged = getattr(metrics, "logged", None)
    return any_rank(logged is not None and logged("eval", step) is False, ctx.device)


def _evaluated(ctx: RunContext, metrics, step: int) -> bool:
    """Whether the metrics hold an evaluation row of `step` (every rank alike, as `_not_evaluated`). Why: a run
    resumed at its last step (its export failed, or it was killed while exporting, after the final evaluation was
    logged) evaluated that step again and logged a second row of it. A logger that cannot tell says no."""
    logged = getattr(metrics, "logged", None)
    return any_rank(logged is not None and logged("eval", step) is True, ctx.device)


def _finish_before_error(steps: StepRunner) -> None:
    """`steps.finish()` for a run that ends with an error every rank raised together (`StopAfterStep`): the run's
    bad-record summary is written and an asynchronous trainer's rollout ranks are told to stop, as at any other end.
    A failure here is logged, not raised: the error the run stops for is the one to report."""
    try:
        steps.finish()
    except Exception as e:  # noqa: BLE001 - the run's own error follows
        log.error("finishing the run before it stops failed: %s: %s", type(e).__name__, e)


def run_loop(ctx: RunContext, steps: StepRunner, *, total_steps: int, checkpointer: Checkpointer, metrics,
             log_every: int, eval_every: int = 0, eval_at_start: bool = False,
             resume: Optional[ResumePoint] = None, before_step: Optional[Callable[[int], None]] = None) -> int:
    """Run steps until `total_steps` or a stop signal; 0 when finished, 143 when stopped.

    `metrics`: the `MetricsLogger` (`set_start`, `log`); `eval_every` 0 = only at the end;
    `eval_at_start`: evaluate before the first step of a fresh run (not after a resume);
    `before_step(n)`: called before step n (1-based) runs (a test hook; None in production)."""
    start = 0
    if resume is not None:
        if resume.step > total_steps:
            raise ConfigError(past_the_end(resume.step, total_steps))
        start = resume.step
        steps.load_data_state(resume.data, start)
    metrics.set_start(start)

    def evaluate(step: int) -> bool:
        """Evaluate and log; False when every rank gave the evaluation up for a stop (`EvaluationAbandoned`): then
        nothing of it is logged, and the caller stops."""
        # RNG-neutral: the checkpoint of this step holds the RNG state before the evaluation, so the next step must
        # draw from that state in the uninterrupted run too (an eval loader's iterator alone draws a seed from torch's)
        before = rng_state()
        try:
            m = steps.evaluate(step)
        except EvaluationAbandoned as e:
            log.warning("stop signal received during the evaluation at step %d, which was abandoned (%s): its metrics "
                        "are not logged", step, e)
            return False
        finally:
            set_rng_state(before)
        if m:
            metrics.log("eval", step, m)
        return True

    saved_at = start  # the step the newest checkpoint holds (the resume point counts)

    def save(step: int) -> None:
        nonlocal saved_at
        if step == saved_at:
            return  # already saved (a stop signal on a periodic-save step): never write the same step twice
        checkpointer.save(step, steps.data_state(step))
        saved_at = step

    stop_at_step_start = bool(getattr(steps, "stop_at_step_start", False))
    step, code = start, 0
    if eval_at_start and start == 0 and not evaluate(0):
        log.warning("stopping before the first step (no checkpoint to save)")
        code = EXIT_STOPPED
    elif start and eval_every and start % eval_every == 0 and start < total_steps and _not_evaluated(ctx, metrics, start):
        log.info("evaluating step %d, the resume step, whose periodic evaluation the earlier run did not log", start)
        if not evaluate(start):
            log.warning("stopping before the first step of the resumed run (its checkpoint is the resume point)")
            code = EXIT_STOPPED
    peak = PeakMemory(ctx.device)
    peak.reset()  # the first row's interval starts at its first step (not at the model build)
    while step < total_steps and code == 0:
        if before_step is not None:
            before_step(step + 1)
        done = step + 1
        before = rng_state()  # put back when the step is abandoned: the checkpoint of its start draws as it would
        try:
            m = steps.train_step(step, log=(done % log_every == 0 or done == total_steps))
        except StopAfterStep as e:
            if e.metrics:
                metrics.log("train", done, e.metrics)
            if checkpointer.enabled and saved_at < done - e.wasted:
                log.warning("saving a checkpoint at step %d before the run stops: steps %d-%d, after the newest "
                            "checkpoint (step %d), would otherwise be lost", done, saved_at + 1, done - e.wasted, saved_at)
                save(done)
            elif checkpointer.enabled:
                log.warning("not saving step %d: the newest checkpoint (step %d) holds every step worth keeping; "
                            "resume from it", done, saved_at)
            _finish_before_error(steps)
            raise e.error from None
        except StopAgreed as e:  # agreed at the step's start, nothing of it ran: a stop at the boundary before it
            set_rng_state(before)
            log.warning("stop signal received: saving a checkpoint at step %d and exiting (agreed at step %d's start, "
                        "before any of it ran: %s)", step, done, e)
            if checkpointer.enabled:
                save(step)  # a no-op when it holds the newest checkpoint (the resume point or a periodic save)
            code = EXIT_STOPPED
            break
        except StepAbandoned as e:
            set_rng_state(before)
            log.warning("stop signal received during step %d, which was abandoned (%s): saving a checkpoint at step %d "
                        "(a resumed run redoes step %d's prompts) and exiting", done, e, step, done)
            if checkpointer.enabled:
                save(step)  # a no-op when it holds the newest checkpoint (the resume point or a periodic save)
            code = EXIT_STOPPED
            break
        step = done
        if m:
            m["peak_memory_gib"] = peak.read_gib()
            peak.reset()
            metrics.log("train", step, m)
        if checkpointer.periodic_due(step) and step < total_steps:
            save(step)
        eval_due = bool(eval_every) and step % eval_every == 0 and step < total_steps
        # a step that agrees the stop at its start (`stop_at_step_start`) leaves the read to the next step, unless
        # the answer is needed before one: an evaluation is due, or no step follows
        boundary = not stop_at_step_start or eval_due or step == total_steps
        stopping = boundary and ctx.stop.should_stop(ctx.device)
        if eval_due and not stopping:
            # abandoned (on every rank alike): stopping; else a stop raised while it evaluated
            stopping = not evaluate(step) or ctx.stop.should_stop(ctx.device)
        if stopping:
            log.warning("stop signal received: saving a checkpoint at step %d and exiting", step)
            if checkpointer.enabled:
                save(step)  # a no-op when the periodic save above just wrote this step
            code = EXIT_STOPPED
            break
    if code == 0:
        if checkpointer.enabled:
            save(step)  # nothing when no step ran since the resume point
        logged_before = resume is not None and step == start and _evaluated(ctx, metrics, step)
        if logged_before:
            log.info("step %d, the resume step and the last, was evaluated by the earlier run (its row is in the "
                     "metrics): not evaluating it again", step)
        if not logged_before and not evaluate(step):  # given up for a stop: the requeued run (resumed at this step) evaluates and exports
            log.warning("the final evaluation was abandoned: not exporting; a run resumed from step %d evaluates and "
                        "exports", step)
            code = EXIT_STOPPED
        elif checkpointer.export_at_end:
            checkpointer.export_hf(ctx.run_dir / "hf")
    steps.finish()
    return code
