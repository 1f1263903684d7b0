"""The SFT loop.

Per optimizer step each data-parallel rank takes `micro_batches_per_step` packed micro-batches.
The loss is normalised by the global number of trained (label) tokens of the step, summed over
all ranks and micro-batches — not a mean of per-micro-batch means — so the gradient equals the
one-process, whole-batch gradient whatever the world size. FSDP averages gradients over the dp
ranks, hence the `* dp_size` on each micro-batch loss.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path

import torch

from megatron_vlm.checkpoint.manager import CheckpointManager
from megatron_vlm.training.job import Job
from megatron_vlm.training.evaluate import evaluate
from megatron_vlm.parallel import clip_grad_norm_
from megatron_vlm.parallel.collectives import all_reduce_sum

log = logging.getLogger("megatron_vlm")


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device) / 2**30  # type: ignore[attr-defined]
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (peak RSS)


def _fault_injection(step: int) -> None:
    """Tests simulate a hard crash (kill -9) at a given step to prove resume never needs a clean exit."""
    kill_at = os.environ.get("MEGATRON_VLM_FAULT_KILL_AT_STEP")
    if kill_at and int(kill_at) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def prepare_data(job: Job) -> None:
    """Bad-record log, the synthetic set written once (rank 0), and the eval JSONL for answer accuracy."""
    from megatron_vlm.data.bad_records import BadRecordLog
    from megatron_vlm.parallel.collectives import barrier

    d = job.cfg.data
    job.bad_records = BadRecordLog()
    if d.type == "synthetic_vqa":
        from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa

        if not d.synthetic_dir:
            d.synthetic_dir = str(job.run_dir / "data")
        if job.env.is_main:
            write_synthetic_vqa(d.synthetic_dir, d.synthetic_train_size, d.synthetic_eval_size,
                                seed=d.synthetic_seed, image_size=d.synthetic_image_size)
        barrier()
        job.eval_jsonl = Path(d.synthetic_dir) / "eval.jsonl" if d.synthetic_eval_size else None
    elif d.type == "messages_jsonl" and d.eval_path.endswith(".jsonl"):
        job.eval_jsonl = Path(d.eval_path)


def sft_setup(job: Job) -> None:
    prepare_data(job)
    tcfg = job.cfg.train

    def steps_per_epoch() -> float:
        job.train_loader = job.build_train_loader()
        return job.train_loader.packs_per_epoch / (job.dims.dp_size * tcfg.micro_batches_per_step)

    job.setup(steps_per_epoch_fn=steps_per_epoch)


def run_sft(job: Job) -> int:
    cfg, env = job.cfg, job.env
    tcfg = cfg.train
    loader = job.train_loader if job.train_loader is not None else job.build_train_loader()
    start_step = 0
    if job.resume_extra is not None:
        loader.load_state_dict(job.resume_extra["data"])
        start_step = job.resume_extra["step"]
    total = job.total_steps
    job.metrics.set_start(start_step)
    it = iter(loader)
    n_params = sum(p.numel() for p in job.model.parameters())
    dp = job.dims.dp_size
    step = start_step
    exit_code = 0
    t_last = time.time()
    while step < total:
        _fault_injection(step + 1)
        t0 = time.time()
        micro = [next(it) for _ in range(tcfg.micro_batches_per_step)]
        local_tokens = sum(int(b["num_label_tokens"]) for b in micro)
        local_samples = sum(int(b["num_samples"]) for b in micro)
        local_seq_tokens = sum(int(b["input_ids"].numel()) for b in micro)
        g_tokens, g_samples, g_seq = all_reduce_sum([local_tokens, local_samples, local_seq_tokens], env.device)
        denom = max(g_tokens, 1.0)
        loss_sum = 0.0
        job.wrapper.train()
        for b in micro:
            b = job.to_device(b)
            logp = job.wrapper(b)
            loss = -logp.sum(dtype=torch.float32) / denom * dp
            if job.moe_balancer is not None:
                aux = job.moe_balancer.aux_loss()
                if aux is not None:
                    loss = loss + aux / len(micro)
            loss.backward()
            loss_sum += float(-logp.detach().sum(dtype=torch.float64))
        grad_norm = clip_grad_norm_(job.trainable_params, tcfg.max_grad_norm)
        lr = job.scheduler.get_last_lr()[0]  # the lr of this step's update (step() moves to the next)
        job.optimizer.step()
        job.scheduler.step()
        job.optimizer.zero_grad(set_to_none=True)
        step += 1
        moe_report = job.moe_balancer.after_step(step) if job.moe_balancer is not None else None
        (g_loss_sum,) = all_reduce_sum([loss_sum], env.device)
        dt = time.time() - t0
        if step % tcfg.log_every == 0 or step == total:
            metrics = {
                "loss": g_loss_sum / denom,
                "grad_norm": float(grad_norm),
                "lr": lr,
                "tokens_per_s": g_seq / dt,
                "trained_tokens": g_tokens,
                "samples_per_s": g_samples / dt,
                "peak_memory_gib": _peak_memory_gib(env.device),
                "epoch": getattr(loader, "epoch", 0),
                "step_time_s": dt,
            }
            stats = loader.stats() if hasattr(loader, "stats") else {}
            for k, v in stats.items():
                if isinstance(v, (int, float)):
                    metrics[f"data/{k}"] = v
            if env.device.type == "cuda":
                peak = job.peak_flops()
                if peak:
                    metrics["mfu"] = 6.0 * n_params * (g_seq / dt) / (peak * env.world_size)
            if moe_report is not None:
                metrics.update(moe_report[0])
            job.metrics.log("train", step, metrics)
        if moe_report is not None:
            if not (step % tcfg.log_every == 0 or step == total):
                job.metrics.log("train", step, moe_report[0])
            job.log_moe_table(step, moe_report[1])
        t_last = time.time()
        if job.ckpt_cfg.enable and job.ckpt_cfg.every_steps and step % job.ckpt_cfg.every_steps == 0 and step < total:
            job.save_checkpoint(step, {"data": loader.state_dict()})
        if tcfg.eval_every and step % tcfg.eval_every == 0 and step < total:
            evaluate(job, step)
        if job.stop.should_stop(env.device):
            log.warning("stop signal received: saving a checkpoint at step %d and exiting", step)
            if job.ckpt_cfg.enable:
                job.save_checkpoint(step, {"data": loader.state_dict()})
            exit_code = 143
            break
    del t_last
    if exit_code == 0:
        if job.ckpt_cfg.enable and step > start_step:
            job.save_checkpoint(step, {"data": loader.state_dict()})
        evaluate(job, step)
        if job.ckpt_cfg.export_hf:
            job.export_hf(job.run_dir / "hf")
    job.finish_data(loader)
    return exit_code
