"""The job kinds assembled from their parts and run by the one training loop:
`run_sft(ctx)`, `run_grpo(ctx)` and `run_dpo(ctx)` (training/dpo/) -> exit code (0 finished, 143 stopped by a signal); `run_stages`
chains SFT runs (`[[stages]]`, training/stages.py); `run_eval(ctx)` evaluates a model folder on
benchmark files without training (`[train] mode = "eval"`, eval/benchmark_eval.py).

This module sits above `training`, `rl` and `eval` (it imports all three; none of them imports it),
so each of those stays free of the others' set-up: the SFT step gets its evaluator and the GRPO step
its held-out evaluation from here. Set-up order, per kind (the same on every rank):

- SFT: data (synthetic set, bad-record log), model bundle, train loader -> run length
  (`train.max_steps`, or `train.epochs` x steps per epoch of the loader), optimizer + schedule,
  checkpointer + resume, metrics logger, evaluator, loop;
- GRPO: config checks, model bundle, prompt sets / engine / rewards / reference, run length
  (`train.max_steps`, or ceil(`train.epochs` x prompts / rl.batch.prompts_per_step)), optimizer + schedule,
  PPO's critic (`advantage = "gae"`: rl/critic/), checkpointer (with the critic's state) + resume, metrics logger, evaluator, loop; the reward workers are closed however the
  run ends.
- both: `[moe]` keys on a model without MoE layers are refused (config error, exit 2);
- DPO: data (synthetic set, bad-record log), model bundle, pair loaders, reference (before the resume: a
  precomputed reference is scored from the initial weights), run length, optimizer + schedule, checkpointer +
  resume, metrics logger, held-out preference evaluation (also at step 0 of a fresh run), loop;
- reward model (`train.mode = "reward"`, training/reward/): DPO's set-up with the scalar-head model bundle and
  no reference; the checkpointer's final export is the reward model folder;
- stages: for each stage its own config (`stage_overrides`) and run folder, run as an SFT job; a
  stage whose Hugging Face export is complete is skipped (the command can be run again after a stop;
  a warning when its settings changed since its recorded digest);
- eval: model bundle, the rollout engine of the answer accuracy, each benchmark in turn, the result
  files (eval/report.py) written by rank 0; the reward workers are closed however the run ends.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

from megatron_vlm.config import save_config
from megatron_vlm.config.loader import ConfigError, to_dict
from megatron_vlm.config.mode_keys import check_keys_for_mode, check_moe_section
from megatron_vlm.config.sections import LoRAConfig
from megatron_vlm.config.stage_configs import record_stage_digest, stage_changed, stage_configs
from megatron_vlm.eval.answer_accuracy import answer_engine
from megatron_vlm.eval.benchmark_eval import VerifierScorer, evaluate_benchmark
from megatron_vlm.eval.benchmarks import open_benchmark
from megatron_vlm.eval.grpo_accuracy import GRPOEvaluator
from megatron_vlm.eval.report import clear_eval_results, write_eval_results
from megatron_vlm.eval.resume import benchmark_fingerprint, evaluate_benchmarks_kept, media_signatures
from megatron_vlm.eval.settings import eval_settings
from megatron_vlm.eval.sft import SFTEvaluator
from megatron_vlm.parallel.collectives import barrier
from megatron_vlm.rl.asynchronous.bridge import current_role
from megatron_vlm.rl.asynchronous.rollout_rank import run_rollout_rank
from megatron_vlm.rl.asynchronous.trainer import AsyncGRPOLoopStep
from megatron_vlm.rl.critic.build import build_critic
from megatron_vlm.rl.grpo_step import GRPOStep
from megatron_vlm.rl.trainer import GRPOLoopStep, build_grpo_parts, check_grpo_config, grpo_total_steps
from megatron_vlm.training.checkpointing import Checkpointer, ResumePoint
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.dpo.build import build_pair_loaders, build_reference, dpo_section
from megatron_vlm.training.dpo.reference import ReferencePassStopped
from megatron_vlm.training.dpo.step import DPOEvaluator, DPOStep
from megatron_vlm.training.loggers import MetricsLogger, build_metrics_logger
from megatron_vlm.training.loop import EXIT_STOPPED, run_loop
from megatron_vlm.training.lora import LoRASetupError
from megatron_vlm.training.model_bundle import ModelBundle, build_model_bundle
from megatron_vlm.training.optim import OptimState, build_optim_state, total_steps
from megatron_vlm.training.reward.build import build_reward_bundle, reward_section
from megatron_vlm.training.reward.export import RewardCheckpointer
from megatron_vlm.training.reward.step import RewardEvaluator, RewardStep
from megatron_vlm.training.sft import SFTStep, build_train_loader, prepare_sft_data, steps_per_epoch
from megatron_vlm.training.stages import stage_error

__all__ = ["run_sft", "run_grpo", "run_dpo", "run_reward", "run_stages", "run_eval", "run_kind"]

log = logging.getLogger("megatron_vlm")


def _training_state(ctx: RunContext, bundle: ModelBundle, num_steps: int, *, modules: Optional[dict] = None,
                    ) -> tuple[OptimState, Checkpointer, Optional[ResumePoint], MetricsLogger]:
    """(optimizer state, checkpointer, resume point or None, metrics logger): the set-up every training kind
    does in this order once its run length is known (the resume restores the optimizer built just before).
    `modules`: further (module, optimizer) pairs saved in the same checkpoint by name (PPO's critic)."""
    optim = build_optim_state(bundle.wrapper, ctx.cfg, ctx.device.type, num_steps)
    checkpointer = Checkpointer(ctx, bundle.wrapper, optim, modules=modules)
    resume = checkpointer.resume()
    metrics = build_metrics_logger(ctx, num_steps, to_dict(ctx.cfg))
    return optim, checkpointer, resume, metrics


def run_sft(ctx: RunContext, *, before_step=None) -> int:
    cfg = ctx.cfg
    bad_records = prepare_sft_data(ctx)
    bundle = build_model_bundle(ctx)
    check_moe_section(cfg, bundle.model, bundle.layer_kinds)
    loader = build_train_loader(ctx, bundle, bad_records)
    evaluate = SFTEvaluator(ctx, bundle, bad_records)
    evaluate.prepare()  # an unusable eval split stops the job here, not at its first evaluation
    num_steps = total_steps(cfg.train, steps_per_epoch(loader, bundle.dims.dp_size, cfg.train.micro_batches_per_step))
    optim, checkpointer, resume, metrics = _training_state(ctx, bundle, num_steps)
    step = SFTStep(ctx, bundle, optim, metrics, loader, total_steps=num_steps, bad_records=bad_records,
                   evaluate=evaluate)
    code = run_loop(ctx, step, total_steps=num_steps, checkpointer=checkpointer, metrics=metrics,
                    log_every=cfg.train.log_every, eval_every=cfg.train.eval_every, resume=resume, before_step=before_step)
    metrics.close()
    return code


def run_dpo(ctx: RunContext, *, before_step=None) -> int:
    cfg = ctx.cfg
    dpo = dpo_section(cfg)
    bad_records = prepare_sft_data(ctx)
    bundle = build_model_bundle(ctx)
    check_moe_section(cfg, bundle.model, bundle.layer_kinds)
    loader, eval_loader = build_pair_loaders(ctx, bundle, bad_records)
    try:
        reference = build_reference(ctx, bundle, dpo, loader, eval_loader)  # before resume: the initial weights
    except ReferencePassStopped as e:  # SIGTERM / SIGUSR1 in the precomputed pass: what it scored is saved
        log.warning("%s; exiting %d", e, EXIT_STOPPED)
        return EXIT_STOPPED
    num_steps = total_steps(cfg.train, steps_per_epoch(loader, bundle.dims.dp_size, cfg.train.micro_batches_per_step))
    optim, checkpointer, resume, metrics = _training_state(ctx, bundle, num_steps)
    evaluate = DPOEvaluator(ctx, bundle, dpo, reference, eval_loader, max_batches=cfg.train.eval_max_batches)
    step = DPOStep(ctx, bundle, optim, metrics, loader, dpo=dpo, reference=reference, bad_records=bad_records,
                   evaluate=evaluate)
    code = run_loop(ctx, step, total_steps=num_steps, checkpointer=checkpointer, metrics=metrics,
                    log_every=cfg.train.log_every, eval_every=cfg.train.eval_every, eval_at_start=eval_loader is not None,
                    resume=resume, before_step=before_step)
    metrics.close()
    return code


def run_reward(ctx: RunContext, *, before_step=None) -> int:
    """Train a reward model on preference pairs (training/reward/); `<run>/hf` is the `type = "model"` folder."""
    cfg = ctx.cfg
    reward = reward_section(cfg)
    bad_records = prepare_sft_data(ctx)
    bundle = build_reward_bundle(ctx, reward)
    check_moe_section(cfg, bundle.model, bundle.layer_kinds)
    loader, eval_loader = build_pair_loaders(ctx, bundle, bad_records)
    num_steps = total_steps(cfg.train, steps_per_epoch(loader, bundle.dims.dp_size, cfg.train.micro_batches_per_step))
    optim = build_optim_state(bundle.wrapper, cfg, ctx.device.type, num_steps)
    checkpointer = RewardCheckpointer(ctx, bundle.wrapper, optim)
    resume = checkpointer.resume()
    metrics = build_metrics_logger(ctx, num_steps, to_dict(cfg))
    evaluate = RewardEvaluator(ctx, bundle, reward, eval_loader, max_batches=cfg.train.eval_max_batches)
    step = RewardStep(ctx, bundle, optim, metrics, loader, reward=reward, bad_records=bad_records, evaluate=evaluate)
    code = run_loop(ctx, step, total_steps=num_steps, checkpointer=checkpointer, metrics=metrics,
                    log_every=cfg.train.log_every, eval_every=cfg.train.eval_every, eval_at_start=eval_loader is not None,
                    resume=resume, before_step=before_step)
    metrics.close()
    return code


def run_grpo(ctx: RunContext, *, before_step=None) -> int:
    cfg = ctx.cfg
    check_grpo_config(cfg)
    role = current_role()  # asynchronous GRPO (rl.allocation): this process's role
    if role is not None and role.is_rollout:
        return run_rollout_rank(ctx, role)
    bundle = build_model_bundle(ctx)
    idle = cfg.rl.data_shards_refusal(bundle.dims.dp_size) if role is None else None  # the mesh's size, now known
    if idle:
        raise ConfigError(idle)
    check_moe_section(cfg, bundle.model, bundle.layer_kinds)
    parts = build_grpo_parts(ctx, bundle)
    rl = cfg.rl
    try:
        num_steps = grpo_total_steps(cfg.train, rl, len(parts.sets.train))
        critic = build_critic(ctx, bundle, rl, num_steps)  # advantage = "gae" (PPO): the value model and its optimizer, else None
        optim, checkpointer, resume, metrics = _training_state(
            ctx, bundle, num_steps, modules={"critic": (critic.model, critic.optimizer)} if critic is not None else None)
        grpo = GRPOStep(ctx, bundle, optim, rl, parts.engine, parts.encoder, parts.manager, parts.reference, metrics=metrics,
                        critic=critic, multiturn=parts.multiturn)
        evaluate = GRPOEvaluator(ctx, bundle.wrapper, rl, parts.engine, parts.encoder, parts.manager, parts.sets.eval,
                                 dims=bundle.dims, multiturn=parts.multiturn)
        if role is not None:
            step = AsyncGRPOLoopStep(ctx, parts.sets.train, grpo, role, model=bundle.model, encoder=parts.encoder,
                                     start_step=resume.step if resume is not None else 0, total_steps=num_steps,
                                     evaluate=evaluate, bad_records=parts.bad_records,
                                     resume_data=resume.data if resume is not None else None)
        else:
            step = GRPOLoopStep(ctx, parts.sets.train, grpo, evaluate, bad_records=parts.bad_records)
        code = run_loop(ctx, step, total_steps=num_steps, checkpointer=checkpointer, metrics=metrics,
                        log_every=cfg.train.log_every, eval_every=rl.eval.every_steps, eval_at_start=rl.eval.at_start,
                        resume=resume, before_step=before_step)
    finally:
        parts.manager.close()
        if parts.multiturn is not None:
            parts.multiturn.close()
        getattr(parts.engine, "close", lambda: None)()  # hook: the vLLM engine shuts down before the process group
    metrics.close()
    return code


def run_stages(ctx: RunContext, *, before_step=None) -> int:
    """Run the `[[stages]]` in order (training/stages.py); stops at the first stage that does not
    finish (its exit code)."""
    stages = ctx.cfg.stages
    configs = stage_configs(ctx.cfg, check=check_keys_for_mode)  # every stage checked before the first one trains
    for i, (stage, cfg) in enumerate(zip(stages, configs)):
        run_dir = Path(cfg.train.output_dir)
        if (run_dir / "hf" / "config.json").is_file():
            if stage_changed(run_dir, cfg):
                log.warning("stage %d/%d %r: its settings changed since its export %s was made, but the stage is "
                            "skipped because that export exists; to train it again with the new settings, remove %s "
                            "(and the folders of the stages after it, which start from its export)",
                            i + 1, len(stages), stage.name, run_dir / "hf", run_dir)
            else:
                log.info("stage %d/%d %r: finished earlier (%s), skipped", i + 1, len(stages), stage.name,
                         run_dir / "hf")
            continue
        log.info("stage %d/%d %r: model %s, data %s -> %s", i + 1, len(stages), stage.name, cfg.model.path,
                 cfg.data.train_path or cfg.data.type, run_dir)
        if ctx.env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.toml")
        barrier()
        try:  # an error found once the stage's model is built (train_layers patterns) names the stage key
            code = run_sft(RunContext(cfg=cfg, env=ctx.env, run_dir=run_dir, stop=ctx.stop), before_step=before_step)
        except ConfigError as e:
            raise ConfigError(stage_error(str(e), stage, i)) from None
        if code != 0:
            return code
        if ctx.env.is_main:
            record_stage_digest(run_dir, cfg)
        barrier()
        if i + 1 < len(stages) and ctx.stop.should_stop(ctx.env.device):
            # a stop signal after the stage's last step (its final evaluation or export) let the stage finish; the
            # next one would build its model and run a step before reading it. A rerun skips the finished stage.
            log.warning("stop signal received after stage %d/%d %r finished: not starting the next stage",
                        i + 1, len(stages), stage.name)
            return EXIT_STOPPED
    return 0


def _eval_adapter_lora(folder: str) -> LoRAConfig:
    """`eval.adapter` as a `[lora]` section that loads the PEFT adapter in `folder` onto the model's layers
    (its own r / alpha / rsLoRA / target_modules; no dropout): the forward is base + adapter, as `PeftModel` computes
    it. Factors for layers target_modules does not name, or target_modules naming layers without factors, are
    refused (exit 2) rather than evaluated differently from `PeftModel`."""
    path = Path(folder) / "adapter_config.json"
    try:
        meta = json.loads(path.read_text())
        targets = meta.get("target_modules") or []
        # PEFT adapts exactly the layers target_modules names (a str: one regex); "all-linear": the factors decide
        targets = [] if targets == "all-linear" else [targets] if isinstance(targets, str) else [str(t) for t in targets]
        return LoRAConfig(r=int(meta["r"]), alpha=float(meta["lora_alpha"]), dropout=0.0,
                          use_rslora=bool(meta.get("use_rslora", False)), init_from=folder, init_from_mode="continue",
                          target_modules=targets, include_vision=bool(targets))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"eval.adapter: {path} is not a readable PEFT LoRA adapter config ({e})") from None


def run_eval(ctx: RunContext) -> int:
    """Evaluate `model.path` on every `[[eval.benchmarks]]` table and write the results (eval/report.py).

    A stop signal (SIGTERM / SIGUSR1) before the results are written ends the job at once (`StopRequested`: exit
    143, no results): an evaluation has no step boundary to save at, and one that went on would be killed later."""
    with ctx.stop.interrupting():
        results = _evaluate_benchmarks(ctx)
    return _write_eval_results(ctx, results)


def _evaluate_benchmarks(ctx: RunContext) -> list[dict]:
    cfg = ctx.cfg
    if ctx.env.is_main:  # an earlier run's results must not pass for this one's (its eval_config.toml is new)
        clear_eval_results(ctx.run_dir)
    if cfg.eval.adapter:
        ctx = dataclasses.replace(ctx, cfg=dataclasses.replace(cfg, lora=_eval_adapter_lora(cfg.eval.adapter)))
    data_identities, media_files = [], []
    for i, bench in enumerate(cfg.eval.benchmarks):  # every benchmark's files readable before the first is scored
        opened = open_benchmark(bench, template=bench.prompt_template or cfg.eval.prompt_template,
                                system_prompt=cfg.eval.system_prompt, key=f"eval.benchmarks[{i}].path")
        data_identities.append(opened.source.identity())
        # the images its rows name by path: only rank 0 reads and writes kept results (eval/resume.py)
        media_files.append(media_signatures(opened.source) if ctx.env.is_main else [])
    try:
        bundle = build_model_bundle(ctx)
    except LoRASetupError as e:
        if not cfg.eval.adapter:
            raise
        raise ConfigError(f"eval.adapter: {cfg.eval.adapter}: {e}") from None
    check_moe_section(cfg, bundle.model, bundle.layer_kinds)  # [kernels] backends of ops the model lacks ([moe] is refused for eval)
    engine = answer_engine(ctx, bundle)
    scorer = VerifierScorer(cfg.eval)
    benches = cfg.eval.benchmarks
    # after the model build: a synthesized model folder exists now, as it will when the job runs again
    settings = eval_settings(cfg, ctx.env.world_size)
    fingerprints = [benchmark_fingerprint(settings, i, b.name, data_identities[i], cfg.model.path, cfg.eval.adapter,
                                          media_files[i]) for i, b in enumerate(benches)]

    def evaluate(i: int) -> dict:
        result = evaluate_benchmark(ctx, bundle, engine, benches[i], scorer, bench_index=i)
        log.info("eval %s: %s (%d rows, %d bad records, verifier failures %s)", benches[i].name,
                 {k: round(v, 4) for k, v in result["metrics"].items() if isinstance(v, float)},
                 result["num_rows"], result["bad_records"]["num_bad_records"], result["verifier_failures"])
        return result

    def kept(i: int, result: dict) -> None:
        log.info("eval %s: kept from the earlier job in %s that stopped before its results (same settings, model and "
                 "data files): %s", benches[i].name, ctx.run_dir,
                 {k: round(v, 4) for k, v in result["metrics"].items() if isinstance(v, float)})

    try:
        return evaluate_benchmarks_kept(ctx.run_dir, [b.name for b in benches], fingerprints, evaluate,
                                        is_main=ctx.env.is_main, on_kept=kept)
    finally:
        scorer.close()


def _write_eval_results(ctx: RunContext, results: list[dict]) -> int:
    cfg = ctx.cfg
    if ctx.env.is_main:
        assert cfg.eval is not None  # train.mode = "eval" requires [eval] (config checks)
        path = write_eval_results(ctx.run_dir, results, eval_settings(cfg, ctx.env.world_size))
        log.info("evaluation results: %s and %s", path, path.with_suffix(".md"))
    if results and not any(r["metrics"]["num_scored"] for r in results):
        # one unusable benchmark among others is reported and the job goes on; none scored at all is a data /
        # config mistake (the results files above name the bad records), exit 2 like an SFT split with nothing usable
        first = next((b for r in results for b in r["bad_records"]["records"]), None)
        raise ConfigError(f"eval.benchmarks: no row of any benchmark could be scored; first bad record: "
                          f"{first['source']}:{first['index']}: {first['category']}: {first['detail']}" if first else
                          "eval.benchmarks: no row of any benchmark could be scored (no rows)")
    return 0


def run_kind(ctx: RunContext, *, before_step=None) -> int:
    """Run the job kind `train.mode` names ("sft", "grpo", "dpo", "reward" or "eval"; SFT with `[[stages]]` chains
    them). `before_step(n)`: the loop's test hook (called before step n; None in production)."""
    mode = ctx.cfg.train.mode
    if mode == "eval":
        return run_eval(ctx)
    if mode == "sft" and ctx.cfg.stages:
        return run_stages(ctx, before_step=before_step)
    if mode == "dpo":
        return run_dpo(ctx, before_step=before_step)
    if mode == "reward":
        return run_reward(ctx, before_step=before_step)
    return (run_grpo if mode == "grpo" else run_sft)(ctx, before_step=before_step)
