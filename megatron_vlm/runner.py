"""Job runner behind launch/pretrain_vlm.py: process group, run folder, model folder, the job kind
(`megatron_vlm.jobs`), teardown — and the exit codes: 0 done; 1 stopped by too many non-finite steps
in a row, by `rl.reward_pool.max_failed_steps` steps without a usable reward (every verifier call or environment
episode failed), or by a failed
checkpoint save / HF export (the previous checkpoint intact); 2 a missing model folder, a
`train.output_dir` that another job holds, `logging.wandb = true` without the wandb package (training/run_lock.py), is a file or cannot be written, a
config error found once the model is built (including a `parallel.tp` the model's heads / MLP /
vocabulary do not divide) or a checkpoint that cannot be resumed (one line on stderr); 143 stopped by
SIGTERM / SIGUSR1 after a checkpoint (an evaluation job: at once, without results); 130 Ctrl-C.

A job that ends with 0 leaves `<run folder>/finished` (FINISHED_FILE), removed when a job starts in the folder:
a stop signal that comes after the last step (during the final evaluation or export) is not acted on, so the
job finishes, but torchrun, which was signalled too, exits 1 all the same. launch/slurm/train.sbatch reads the
file instead of the exit status, so that it does not requeue a finished run (the requeued job would resume at
the last step only to evaluate and export again)."""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from megatron_vlm.checkpoint.manager import gather_errors
from megatron_vlm.config import ConfigError, save_config
from megatron_vlm.jobs import run_kind
from megatron_vlm.parallel import destroy_distributed, init_distributed
from megatron_vlm.rl.asynchronous.bridge import setup_roles
from megatron_vlm.rl.rewards.failure_watch import RewardsAllFailedError
from megatron_vlm.rl.trainer import check_model_folder
from megatron_vlm.testing.synthesize import synthesize_model_folder, synthesized_mismatch
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.loop import EXIT_STOPPED
from megatron_vlm.training.run_lock import claim_run_dir
from megatron_vlm.training.signals import StopRequested
from megatron_vlm.training.step_guard import NonFiniteStepError

__all__ = ["FINISHED_FILE", "exit_process", "run_entry", "run_job"]

log = logging.getLogger("megatron_vlm")

FINISHED_FILE = "finished"
"""Written into the run folder by a job that ended with 0 (read by launch/slurm/train.sbatch)."""


def _prepare_model_folder(cfg, env) -> None:
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        mismatch = synthesized_mismatch(cfg.model.synthesize, path)
        if mismatch is not None:
            raise ConfigError(f"model.synthesize: {mismatch}")
        return
    if cfg.model.synthesize is None:
        raise FileNotFoundError(f"model.path: {path} has no config.json (set model.synthesize to create a tiny model)")
    if env.is_main:
        synthesize_model_folder(cfg.model.synthesize, path, seed=cfg.train.seed)
        log.info("created tiny model %s at %s", cfg.model.synthesize, path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _missing_package(cfg) -> str | None:
    """The config error of a run that asks for a package this environment lacks, found before anything starts.

    Why here: the metrics logger imports wandb on rank 0 alone, once the model and optimizer are built; there
    the error was a traceback on rank 0 while the other ranks waited in their first collective. Not in the
    config checks: `--check` plans a run, often on another machine than the one it runs on."""
    wandb = getattr(getattr(cfg, "logging", None), "wandb", False)  # a job config without [logging]: nothing asked
    if cfg.train.mode != "eval" and wandb and importlib.util.find_spec("wandb") is None:
        return ("logging.wandb: true but the wandb package is not installed (pip install 'megatron-vlm[wandb]'), "
                "or set logging.wandb = false")
    return None


def run_job(cfg, *, before_step=None) -> int:
    """Run the job `cfg` describes; `before_step(n)` is the training loop's test hook (None in production)."""
    missing = _missing_package(cfg)
    if missing is not None:  # every rank: the same environment
        print(f"config error: {missing}", file=sys.stderr)
        return 2
    try:
        role = setup_roles(cfg)  # asynchronous GRPO (rl.allocation): rollout / training ranks, each with its own group
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    env = init_distributed()
    lock = None
    try:
        run_dir = Path(cfg.train.output_dir)
        rollout_rank = role is not None and role.is_rollout  # waits for the trainer's set-up instead
        err = None
        if env.is_main and not rollout_rank:
            try:
                lock = claim_run_dir(run_dir)  # one writer per run folder (training/run_lock.py)
                (run_dir / FINISHED_FILE).unlink(missing_ok=True)  # an earlier job's: this one has not finished
                # an evaluation never overwrites the config.toml of a training run it is pointed at
                save_config(cfg, run_dir / ("eval_config.toml" if cfg.train.mode == "eval" else "config.toml"))
            except (ConfigError, OSError) as e:
                err = str(e) if isinstance(e, ConfigError) else f"train.output_dir: cannot write {run_dir} ({e})"
        failed = next((e for e in gather_errors(err) if e), None)  # every rank leaves together
        if failed is not None:
            print(f"config error: {failed}", file=sys.stderr)
            return 2
        try:
            if cfg.train.mode == "grpo":
                check_model_folder(cfg)  # names the SFT run that produces a missing start checkpoint
            if not rollout_rank:
                _prepare_model_folder(cfg, env)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        ctx = RunContext(cfg=cfg, env=env, run_dir=run_dir)
        ctx.stop.install()
        code = run_kind(ctx, before_step=before_step)
        # Leave together: a rank that tears down its process group and exits while rank 0 is still
        # writing the export has been seen to abort in gloo's teardown (SIGABRT, "terminate called
        # without an active exception"), failing a finished job. Only on this path, where every rank
        # got here: after an error a barrier could wait forever on a rank that died.
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        if code == 0 and lock is not None:
            _mark_finished(run_dir)
        return code
    except ConfigError as e:
        # found once the model is built or first runs ([moe] keys, [lora] (LoRASetupError), parallel sizes
        # (TPError, LayoutError), a forced [kernels] backend that cannot run here (BackendUnavailableError),
        # parallel.backend = "mcore" layers (McoreBackendError), CUDA graphs / paged KV cache of the rollout
        # engine (CudaGraphsConfigError, PagedKVConfigError): all ConfigError subclasses)
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteStepError, RewardsAllFailedError) as e:
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StopRequested as e:  # an evaluation job (jobs.run_eval); training runs stop at a step boundary instead
        print(f"stopped: {e.name} during the evaluation, before its results were written; none written (exit 143)",
              file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    finally:
        destroy_distributed()
        if lock is not None:
            lock.release()


def _mark_finished(run_dir: Path) -> None:
    """Leave FINISHED_FILE in the run folder; a failure only costs a wasted requeue, so it is logged, not raised."""
    try:
        (run_dir / FINISHED_FILE).write_text("the job finished (exit 0)\n")
    except OSError as e:
        log.warning("could not write %s (%s): a Slurm job stopped during its final evaluation or export is requeued",
                    run_dir / FINISHED_FILE, e.strerror or e)


def exit_process(code: int) -> NoReturn:
    """Leave the process with `code` once `run_job` has returned, without interpreter finalization.

    Why: by then every output is written and closed (checkpoints, metrics, the HF export, reward
    workers) and the process group is destroyed, but torch's native threads (gloo's work threads
    release the tensors of finished collectives) can still be about to take the GIL. A thread that
    takes it while the interpreter finalizes is ended by a forced unwind, which C++ turns into
    `std::terminate` ("terminate called without an active exception", SIGABRT): a finished 2-rank job
    exited -6 that way, now and then, after its last barrier. `os._exit` skips finalization; the logs
    and standard streams are flushed first. Only for the command-line entry points: a caller in the same
    process (tests) gets `run_job`'s code back instead."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(int(code))


def run_entry(main: Callable[[], int]) -> NoReturn:
    """Run an entry point's `main()` and leave the process with its code (`exit_process`); an unexpected
    exception is printed with its traceback and ends the process with 1.

    Why not let it propagate: the interpreter keeps an uncaught exception's traceback (and with it the training
    loop's frames: the data loader's iterator) to the end, where multiprocessing ends the loader's workers with
    SIGTERM, which they ignore (they leave stop signals to their rank: stop_signals.py), then joins them without a
    timeout. A crashed rank hung there forever, its SIGTERM only setting the stop flag, and under torchrun the
    others waited in their collectives. The rank's helpers end on their own once it is gone (the loader's workers
    watch their parent; reward and environment workers die with it)."""
    try:
        code = main()
    except SystemExit:
        raise  # a clean exit with its message (config errors, a failed save): the frames are released first
    except KeyboardInterrupt:  # Ctrl-C before the job started (run_job answers it with 130 once it runs)
        code = 130
    except BaseException:  # noqa: BLE001 - anything else is a crash: say it, then leave without finalization
        traceback.print_exc()
        code = 1
    exit_process(code)
