"""A training job's assembled state: config, process group, model (wrapped and sharded), optimizer,
scheduler, checkpoint manager, loggers — shared by the SFT and GRPO loops so that neither repeats
the set-up, resume or export code.
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from megatron_vlm.checkpoint.manager import CheckpointManager, full_model_state_dict
from megatron_vlm.parallel import DistEnv, ParallelDims, build_mesh
from megatron_vlm.parallel.collectives import all_gather_objects, all_reduce_, barrier
from megatron_vlm.parallel.precision import resolve_precision
from megatron_vlm.training.freeze import apply_train_layers
from megatron_vlm.training.lm_loss import TokenLogprobModel
from megatron_vlm.training.loggers import MetricsLogger
from megatron_vlm.training.optim import build_optimizer, build_scheduler, load_scheduler_state
from megatron_vlm.training.signals import StopFlag

log = logging.getLogger("megatron_vlm")

_PEAK_BF16_TFLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@dataclass
class Job:
    cfg: Any
    env: DistEnv
    run_dir: Path
    stop: StopFlag = field(default_factory=StopFlag)
    model: Any = None
    wrapper: Any = None
    processor: Any = None
    dims: Optional[ParallelDims] = None
    mesh: Any = None
    optimizer: Any = None
    scheduler: Any = None
    ckpt: Optional[CheckpointManager] = None
    metrics: Optional[MetricsLogger] = None
    resume_extra: Optional[dict] = None
    total_steps: int = 0
    trainable_params: list = field(default_factory=list)
    bad_records: Any = None
    eval_jsonl: Optional[Path] = None
    train_loader: Any = None
    moe_balancer: Any = None
    last_eval: dict = field(default_factory=dict)

    @property
    def ckpt_cfg(self):
        return self.cfg.checkpoint

    # ---------------------------------------------------------------- set-up
    def setup(self, *, steps_per_epoch_fn=None) -> None:
        from megatron_vlm.models import load_hf_model
        from megatron_vlm import kernels

        cfg, env = self.cfg, self.env
        kernels.configure(cfg.kernels)
        seed_everything(cfg.train.seed)
        self.dims, self.mesh = build_mesh(cfg.parallel, env.world_size, env.device.type)
        from megatron_vlm.data.processor import load_processor

        self.processor = load_processor(cfg.model.path, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
        master_dtype = getattr(torch, cfg.model.dtype)
        model = load_hf_model(cfg.model.path, dtype=master_dtype, device="cpu")
        trainable, total = apply_train_layers(model, cfg.train.train_layers)
        log.info("model %s: %.2fM parameters, %.2fM trainable", type(model).__name__, total / 1e6, trainable / 1e6)
        self.model = model
        self.wrapper = TokenLogprobModel(model)
        precision = resolve_precision(cfg.train.precision, env.device)
        from megatron_vlm.models import get_family

        family = get_family(model.hf_config.get("model_type"))
        family.parallelize(model, self.dims, cfg.parallel, mesh=self.mesh,
                           activation_checkpointing=cfg.train.activation_checkpointing,
                           param_dtype=torch.bfloat16 if precision == "bf16" else None, root=self.wrapper)
        self.trainable_params = [p for p in self.wrapper.parameters() if p.requires_grad]
        from megatron_vlm.models.common.moe import MoELoadBalancer, moe_layers

        if moe_layers(model):
            self.moe_balancer = MoELoadBalancer(model, cfg.moe, all_reduce=all_reduce_)
        self.optimizer = build_optimizer(self.wrapper, cfg.optimizer, env.device.type)
        self.total_steps = self._total_steps(steps_per_epoch_fn)
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler, self.total_steps)
        self.ckpt = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last, env.rank)
        resume_path = self.ckpt.resolve_resume(cfg.checkpoint.resume) if cfg.checkpoint.enable else None
        if resume_path is not None:
            extra = self.ckpt.load(resume_path, self.wrapper, self.optimizer)
            load_scheduler_state(self.scheduler, extra["scheduler"])
            self.resume_extra = extra
            log.info("Resumed from checkpoint: step=%d (%s)", extra["step"], resume_path)
        from megatron_vlm.config import save_config
        from megatron_vlm.config.loader import to_dict

        self.metrics = MetricsLogger(cfg.logging, self.run_dir, is_main=env.is_main, total_steps=self.total_steps,
                                     run_name=self.run_dir.name, config_dict=to_dict(cfg))

    def _total_steps(self, steps_per_epoch_fn) -> int:
        t = self.cfg.train
        if t.max_steps is not None:
            return t.max_steps
        if steps_per_epoch_fn is None:
            raise ValueError("train.epochs: this job kind needs train.max_steps")
        return max(1, int(math.ceil(t.epochs * steps_per_epoch_fn())))

    def build_train_loader(self):
        from megatron_vlm.data.loader import build_sft_dataloader

        return build_sft_dataloader(self.cfg.data, self.processor, seed=self.cfg.train.seed,
                                    dp_rank=self.env.rank, dp_size=self.dims.dp_size, split="train",
                                    bad_records=self.bad_records)

    # ---------------------------------------------------------------- helpers
    def to_device(self, batch: dict) -> dict:
        dev = self.env.device
        return {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def peak_flops(self) -> Optional[float]:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
        for key, val in _PEAK_BF16_TFLOPS.items():
            if key in name:
                return val
        return None

    def save_checkpoint(self, step: int, extra: dict) -> None:
        extra = {**extra, "scheduler": self.scheduler.state_dict()}
        self.ckpt.save(step, self.wrapper, self.optimizer, extra)

    def export_hf(self, out_dir: Path) -> None:
        """Gather the full weights and write a Hugging Face folder (rank 0)."""
        from megatron_vlm.checkpoint.export import export_hf_from_state_dict

        sd = full_model_state_dict(self.wrapper)
        if self.env.is_main:
            sd = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
            export_hf_from_state_dict(sd, self.cfg.model.path, out_dir)
            log.info("exported Hugging Face model to %s", out_dir)
        barrier()

    def log_moe_table(self, step: int, table: list) -> None:
        """The per-layer expert-load table of a MoE workload report (rows = layers, one column per expert)."""
        if table:
            header = ["layer"] + [f"e{i}" for i in range(len(table[0]))]
            self.metrics.log_table("moe/layer_expert_table", step, header, [[i, *row] for i, row in enumerate(table)])

    def finish_data(self, loader) -> None:
        """Gather every rank's skipped records and write one summary (rank 0)."""
        if self.bad_records is None:
            return
        entries = self.bad_records.to_dict()["records"]  # with their skip counts
        gathered = all_gather_objects(entries)
        if self.env.is_main:
            from megatron_vlm.data.bad_records import BadRecordLog

            merged = BadRecordLog()
            for part in gathered:
                merged.extend(part)
            merged.write_summary(self.run_dir / "bad_records.json")
            if len(merged):
                log.warning("skipped %d bad records %s; see %s", len(merged), merged.counts_by_category(),
                            self.run_dir / "bad_records.json")
