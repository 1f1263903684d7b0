"""The job kinds assembled from their parts and run by the one training loop:
`run_sft(ctx)` and `run_grpo(ctx)` -> exit code (0 finished, 143 stopped by a signal).

This module sits above `training`, `rl` and `eval` (it imports all three; none of them imports it),
so each of those stays free of the others' set-up: the SFT step gets its evaluator and the GRPO step
its held-out evaluation from here. Set-up order, per kind (the same on every rank):

- SFT: data (synthetic set, bad-record log), model bundle, train loader -> run length
  (`train.max_steps`, or `train.epochs` x steps per epoch of the loader), optimizer + schedule,
  checkpointer + resume, metrics logger, evaluator, loop;
- GRPO: config checks, model bundle, prompt sets / engine / rewards / reference, run length
  (`train.max_steps`, or `train.epochs` x ceil(prompts / rl.prompts_per_step)), optimizer + schedule,
  checkpointer + resume, metrics logger, evaluator, loop; the reward workers are closed however the
  run ends.
- both: `[moe]` keys on a model without MoE layers are refused (config error, exit 2).
"""
from __future__ import annotations

from megatron_vlm.config.loader import ConfigError, to_dict
from megatron_vlm.config.mode_keys import check_moe_section
from megatron_vlm.eval.grpo_accuracy import GRPOEvaluator
from megatron_vlm.eval.sft import SFTEvaluator
from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.rl.trainer import GRPOLoopStep, build_grpo_parts, check_grpo_config, grpo_total_steps
from megatron_vlm.training.checkpointing import Checkpointer
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.loggers import build_metrics_logger
from megatron_vlm.training.loop import run_loop
from megatron_vlm.training.model_bundle import build_model_bundle
from megatron_vlm.training.optim import build_optim_state, total_steps
from megatron_vlm.training.sft import SFTStep, build_train_loader, prepare_sft_data, steps_per_epoch

__all__ = ["run_sft", "run_grpo", "run_kind"]


def run_sft(ctx: RunContext, *, before_step=None) -> int:
    cfg = ctx.cfg
    bad_records = prepare_sft_data(ctx)
    bundle = build_model_bundle(ctx)
    check_moe_section(cfg, bundle.model)
    loader = build_train_loader(ctx, bundle, bad_records)
    per_epoch = steps_per_epoch(loader, bundle.dims.dp_size, cfg.train.micro_batches_per_step)
    num_steps = total_steps(cfg.train, per_epoch)
    optim = build_optim_state(bundle.wrapper, cfg, ctx.device.type, num_steps)
    checkpointer = Checkpointer(ctx, bundle.wrapper, optim)
    resume = checkpointer.resume()
    metrics = build_metrics_logger(ctx, num_steps, to_dict(ctx.cfg))
    step = SFTStep(ctx, bundle, optim, metrics, loader, total_steps=num_steps, bad_records=bad_records,
                   evaluate=SFTEvaluator(ctx, bundle, bad_records))
    code = run_loop(ctx, step, total_steps=num_steps, checkpointer=checkpointer, metrics=metrics,
                    log_every=cfg.train.log_every, eval_every=cfg.train.eval_every, resume=resume, before_step=before_step)
    metrics.close()
    return code


def run_grpo(ctx: RunContext, *, before_step=None) -> int:
    cfg = ctx.cfg
    check_grpo_config(cfg)
    bundle = build_model_bundle(ctx)
    check_moe_section(cfg, bundle.model)
    parts = build_grpo_parts(ctx, bundle)
    rl = cfg.rl
    try:
        num_steps = grpo_total_steps(cfg.train, rl, len(parts.sets.train))
        optim = build_optim_state(bundle.wrapper, cfg, ctx.device.type, num_steps)
        checkpointer = Checkpointer(ctx, bundle.wrapper, optim)
        resume = checkpointer.resume()
        metrics = build_metrics_logger(ctx, num_steps, to_dict(ctx.cfg))
        grpo = GRPOStep(ctx, bundle, optim, rl, parts.engine, parts.encoder, parts.manager, parts.reference, metrics=metrics)
        evaluate = GRPOEvaluator(ctx, bundle.wrapper, rl, parts.engine, parts.encoder, parts.manager, parts.sets.eval)
        step = GRPOLoopStep(ctx, parts.sets.train, grpo, evaluate, bad_records=parts.bad_records)
        code = run_loop(ctx, step, total_steps=num_steps, checkpointer=checkpointer, metrics=metrics,
                        log_every=cfg.train.log_every, eval_every=rl.eval.every_steps, eval_at_start=rl.eval.at_start,
                        resume=resume, before_step=before_step)
    finally:
        parts.manager.close()
    metrics.close()
    return code


def run_kind(ctx: RunContext, *, before_step=None) -> int:
    """Run the job kind `train.mode` names ("sft" or "grpo"). `before_step(n)`: the loop's test hook
    (called before step n; None in production)."""
    p, world = ctx.cfg.parallel, ctx.env.world_size
    if world % p.cp or (p.dp_shard != -1 and p.dp_replicate * p.dp_shard * p.cp != world):
        raise ConfigError(f"parallel.cp: dp_replicate ({p.dp_replicate}) x dp_shard ({p.dp_shard}) x cp ({p.cp}) "
                          f"does not fit the {world} processes (cp must divide them)")
    return (run_grpo if ctx.cfg.train.mode == "grpo" else run_sft)(ctx, before_step=before_step)
