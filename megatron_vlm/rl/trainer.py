"""The synchronous GRPO loop behind `[train] mode = "grpo"`: `run_grpo(job) -> exit code`.

Set-up: the job (model sharded with FSDP2, optimizer, scheduler over `train.max_steps` GRPO steps,
checkpoint manager, loggers), the prompt sets from `[data]`, the built-in rollout engine on the
policy itself, the reward manager (worker processes with time limits), and — only when
`rl.kl_coef > 0` — the frozen reference policy. Then per step (rl/grpo_step.py): rollout, rewards,
advantages, log-probs, `ppo_epochs x mini_batches_per_step` optimizer updates, one scheduler step,
metrics. Held-out accuracy (Avg@k, rl/evaluation.py) runs before the first step, every
`rl.eval.every_steps` and at the end. Checkpoints hold the model, optimizer, scheduler and the
next step; the prompt order and all sampling are functions of (seed, step), so a resumed run
repeats the uninterrupted one. SIGTERM saves a checkpoint at the step boundary and exits 143; the
end of a run exports a Hugging Face folder (`output_dir/hf`).
"""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import torch

from megatron_vlm.parallel.collectives import any_rank
from megatron_vlm.parallel.precision import compute_dtype

__all__ = ["run_grpo", "check_model_folder"]

log = logging.getLogger("megatron_vlm")


def check_model_folder(cfg) -> None:
    """A GRPO run starts from an existing model folder; say how to make it when it is missing."""
    path = Path(cfg.model.path)
    if (path / "config.json").is_file() or cfg.model.synthesize is not None:
        return
    hint = cfg.rl.model_path_hint if cfg.rl is not None else None
    msg = f"model.path: {path} has no config.json"
    raise FileNotFoundError(f"{msg}; {hint}" if hint else f"{msg} (GRPO starts from a trained model folder)")


def _fault_injection(step: int) -> None:
    """Tests simulate a hard crash (kill -9) at a step, as the SFT loop does (same variable)."""
    kill_at = os.environ.get("MEGATRON_VLM_FAULT_KILL_AT_STEP")
    if kill_at and int(kill_at) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _data_state(step: int, seed: int, num_prompts: int) -> dict:
    return {"next_step": step, "seed": seed, "num_prompts": num_prompts}


def run_grpo(job) -> int:
    from megatron_vlm.rl.data import prompt_batches
    from megatron_vlm.rl.evaluation import evaluate_accuracy
    from megatron_vlm.rl.grpo_step import GRPOStep
    from megatron_vlm.rl.prompts import PromptEncoder, load_prompt_sets
    from megatron_vlm.rl.reference import ReferencePolicy
    from megatron_vlm.rl.rewards.manager import RewardManager
    from megatron_vlm.rl.rollout import PolicyRolloutEngine
    from megatron_vlm.parallel.collectives import barrier

    cfg, env = job.cfg, job.env
    rl = cfg.rl
    if rl is None:
        raise ValueError("rl: train.mode = 'grpo' needs an [rl] section")
    if cfg.train.max_steps is None:
        raise ValueError("train.max_steps: GRPO runs a fixed number of steps; set train.max_steps (train.epochs is not used)")
    check_model_folder(cfg)
    job.setup(steps_per_epoch_fn=None)
    sets = load_prompt_sets(cfg.data, rl, run_dir=job.run_dir, is_main=env.is_main, barrier=barrier)
    log.info("GRPO prompts: %d train, %s held-out", len(sets.train), len(sets.eval) if sets.eval else "no")
    dtype = compute_dtype(cfg.train.precision, getattr(torch, cfg.model.dtype), env.device)
    budget = max(rl.max_new_tokens, rl.eval.max_new_tokens or 0)
    encoder = PromptEncoder(job.processor, max_frames=cfg.data.max_frames, fps=cfg.data.fps, max_new_tokens=budget,
                            max_tokens=cfg.data.max_tokens_per_pack)
    engine = PolicyRolloutEngine(
        job.model, job.processor.tokenizer, forward=lambda **kw: job.wrapper(model_kwargs=kw), cache_dtype=dtype,
        device=env.device, max_prompts_per_batch=rl.rollout_batch_prompts,
        all_ranks_active=lambda active: any_rank(active, env.device),
    )
    reference = None
    if rl.kl_coef > 0:
        reference = ReferencePolicy.from_pretrained(cfg.model.path, dtype=dtype, device=env.device,
                                                    offload=rl.ref_offload, temperature=rl.temperature)
    manager = RewardManager(rl.rewards, timeout_s=rl.reward_timeout_s, num_workers=rl.reward_workers)
    try:
        return _loop(job, rl, sets, GRPOStep(job, rl, engine, encoder, manager, reference),
                     lambda step: evaluate_accuracy(job, rl, engine, encoder, manager, sets.eval, step), prompt_batches)
    finally:
        manager.close()


def _loop(job, rl, sets, grpo, evaluate, prompt_batches) -> int:
    cfg, env = job.cfg, job.env
    seed, total = cfg.train.seed, job.total_steps
    start_step = 0
    if job.resume_extra is not None:
        start_step = int(job.resume_extra["step"])
        data = job.resume_extra.get("data", {})
        if data.get("seed", seed) != seed or data.get("num_prompts", len(sets.train)) != len(sets.train):
            log.warning("resuming with a different seed or prompt set than the checkpoint's (%s): the prompt order differs", data)
    job.metrics.set_start(start_step)

    def run_eval(step: int) -> None:
        m = evaluate(step)
        if m is not None:
            job.metrics.log("eval", step, m)
            job.last_eval = m

    def save(step: int) -> None:
        job.save_checkpoint(step, {"data": _data_state(step, seed, len(sets.train))})

    if rl.eval.at_start and start_step == 0:
        run_eval(0)
    batches = prompt_batches(len(sets.train), rl.prompts_per_step, seed=seed, start_step=start_step)
    step, exit_code = start_step, 0
    while step < total:
        _fault_injection(step + 1)
        batch = [sets.train[i] for i in next(batches)]
        metrics = grpo.run(step, batch)
        step += 1
        metrics["epoch"] = step * rl.prompts_per_step / len(sets.train)
        if step % cfg.train.log_every == 0 or step == total:
            job.metrics.log("train", step, metrics)
        if job.ckpt_cfg.enable and job.ckpt_cfg.every_steps and step % job.ckpt_cfg.every_steps == 0 and step < total:
            save(step)
        if rl.eval.every_steps and step % rl.eval.every_steps == 0 and step < total:
            run_eval(step)
        if job.stop.should_stop(env.device):
            log.warning("stop signal received: saving a checkpoint at step %d and exiting", step)
            if job.ckpt_cfg.enable:
                save(step)
            exit_code = 143
            break
    if exit_code == 0:
        if job.ckpt_cfg.enable and step > start_step:
            save(step)
        run_eval(step)
        if job.ckpt_cfg.export_hf:
            job.export_hf(job.run_dir / "hf")
    return exit_code
