"""Run configuration: TOML -> nested dataclasses.

`load_config(path, overrides)` reads the TOML, applies `--set section.key=value` overrides,
and builds `Config` strictly (unknown keys, wrong types, missing or out-of-range values raise
`ConfigError` naming the dotted key). `save_config` writes the resolved config; loading that
file again reproduces the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import tomli_w
import tomllib

from megatron_vlm.config.eval_section import EvalConfig
from megatron_vlm.config.loader import ConfigError, apply_overrides, from_dict, to_dict
from megatron_vlm.config.sections import (
    CheckpointConfig,
    LoggingConfig,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
    TrainConfig,
)
from megatron_vlm.data.config import DataConfig
from megatron_vlm.kernels.config import KernelsConfig
from megatron_vlm.rl.config import RLConfig
from megatron_vlm.training.dpo.config import DPOConfig
from megatron_vlm.training.moe_balancing import MoEConfig
from megatron_vlm.training.reward.config import RewardTrainConfig
from megatron_vlm.training.stages import StageConfig

__all__ = ["Config", "ConfigError", "load_config", "load_config_dict", "save_config"]


@dataclass(kw_only=True)
class Config:
    model: ModelConfig
    """The model to train (a Hugging Face folder)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training / evaluation data (required by the training modes; an evaluation job reads [eval])."""
    train: TrainConfig
    """Loop settings."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Device mesh and parallelism."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing, resume and export."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Loggers."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Kernel backend per op ("auto", "torch", "triton", "npu", ...)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts load balancing and workload reports (models with MoE layers only)."""
    rl: Optional[RLConfig] = None
    """GRPO settings (required when train.mode = "grpo")."""
    dpo: Optional[DPOConfig] = None
    """Preference optimisation (read when train.mode = "dpo"; absent = its defaults)."""
    reward: Optional[RewardTrainConfig] = None
    """Reward-model training (read when train.mode = "reward"; absent = its defaults)."""
    lora: Optional[LoRAConfig] = None
    """LoRA adapters (present = only the adapters train; the base weights stay frozen)."""
    eval: Optional[EvalConfig] = None
    """Benchmark evaluation (required when train.mode = "eval"; launch/evaluate.py)."""
    stages: list[StageConfig] = field(default_factory=list)
    """Curriculum: SFT stages run one after the other, each from the previous stage's export
    (training/stages.py); empty = one run."""

    def validate(self) -> None:
        mode = self.train.mode
        if mode == "grpo" and self.rl is None:
            raise ValueError("rl: an [rl] section is required when train.mode = \"grpo\"")
        if self.lora is not None and self.train.train_layers:
            raise ValueError("train.train_layers: cannot be combined with [lora] (only the adapters train)")
        if mode == "eval" and self.eval is None:
            raise ValueError("eval: an [eval] section with [[eval.benchmarks]] is required when train.mode = \"eval\"")
        if mode == "eval" and self.eval is not None and not self.eval.benchmarks:  # here, not in [eval]'s own checks: in another mode the
            # section is refused as a whole (config/mode_keys.py), which is what a user who set one key there needs
            raise ValueError("eval.benchmarks: at least one [[eval.benchmarks]] table is required")
        if mode != "grpo" and self.data.type == "hf" and not self.data.columns:
            raise ValueError("data.columns: required when type = 'hf' (e.g. {messages = \"conversations\"}); only GRPO "
                             "detects a prompt table's layout without it")
        if mode != "eval" and self.data.type in ("messages_jsonl", "hf") and not self.data.train_path and not (
                self.stages and all(s.train_path for s in self.stages)):
            raise ValueError(f"data.train_path: required when type = {self.data.type!r}")
        if mode != "eval" and self.train.max_steps is None and self.train.epochs is None and not (
                self.stages and all(s.max_steps or s.epochs for s in self.stages)):
            raise ValueError("train.max_steps: set max_steps or epochs")
        if mode == "grpo" and self.rl is not None and self.rl.rollout.kv_cache_blocks:
            rl, tokens = self.rl, self.data.max_tokens_per_pack
            need = 1 + -(-tokens // rl.rollout.kv_block_size)  # the scratch row's block + one sample of a full pack
            if rl.rollout.kv_cache_blocks < need:
                raise ValueError(f"rl.rollout.kv_cache_blocks: {rl.rollout.kv_cache_blocks} blocks of {rl.rollout.kv_block_size} positions cannot "
                                 f"hold one sample of up to data.max_tokens_per_pack = {tokens} tokens (prompt + budget) "
                                 f"besides the engine's scratch block: needs >= {need}")
        if mode == "grpo" and self.rl is not None:  # PPO's critic: data-parallel ranks only (rl/critic/build.py)
            refused = self.rl.critic_layout_refusal(self.parallel)
            if refused:
                raise ValueError(refused)
        if mode == "grpo" and self.rl is not None and self.rl.rollout_backend == "vllm":
            self._validate_vllm_length()
        if mode == "grpo" and self.rl is not None and self.rl.routing_replay == "rollout":
            self._validate_routing_replay()
        if mode == "grpo" and self.rl is not None and self.rl.rollout.weights == "expert_parallel":
            self._validate_ep_rollout()
        if self.train.precision == "fp8":
            self._validate_fp8()
        if self.stages:
            self._validate_stages()

    def _validate_vllm_length(self) -> None:
        """`rl.vllm.max_model_len` below the pack: vLLM ends a sequence at its max_model_len with finish "length", so
        completions would be cut short of `rl.rollout.max_new_tokens` without a word (prompts are only kept when they
        fit the pack with the budget). Here, not in the engine, so `--check` and the asynchronous rollout ranks see it."""
        assert self.rl is not None
        v, pack = self.rl.vllm, self.data.max_tokens_per_pack
        if v.max_model_len is not None and v.max_model_len < pack:
            raise ValueError(f"rl.vllm.max_model_len: {v.max_model_len} is below data.max_tokens_per_pack = {pack}, which "
                             "prompts + completions may fill; raise it or leave it unset")

    def _validate_routing_replay(self) -> None:
        """Where the recorded routes cannot be laid over the training forward's tokens: pipeline parallelism (a stage
        runs a slice of the MoE layers). Context parallelism is fine (a context-parallel layer takes the rows of its
        rank's chunks) and so are megatron-core MoE layers (their router's top-k hook: models/mcore/moe_layer.py)."""
        p = self.parallel
        for key, bad, why in (("pp", p.pp > 1, "each stage runs a slice of the MoE layers"),):
            if bad:
                raise ValueError(f"rl.routing_replay: 'rollout' is not supported with parallel.{key} = "
                                 f"{getattr(p, key)!r} ({why}); use routing_replay = 'off'")

    def _validate_ep_rollout(self) -> None:
        """Where the expert-parallel rollout copy (inference/ep_rollout.py) cannot work: no expert sharding to
        mirror (parallel.ep = 1), megatron-core MoE layers (their own expert layout), tensor parallelism (not
        wired), LoRA adapters (not mirrored
        into the copy), the asynchronous loop (its rollout ranks are outside the ep groups) and vLLM."""
        p, rl = self.parallel, self.rl
        assert rl is not None
        for key, bad, why in (("parallel.ep", p.ep <= 1, "there are no sharded experts to mirror; use 'copy' or 'shared'"),
                              ("parallel.backend", p.backend == "mcore", "megatron-core MoE layers hold their own "
                                                                         "expert layout"),
                              ("parallel.tp", p.tp > 1, "not wired with tensor parallelism yet: the copy's dense "
                                                        "weights are whole and its ep groups per tp coordinate untested"),
                              ("lora", self.lora is not None, "the copy does not mirror LoRA adapters"),
                              ("rl.allocation", rl.allocation is not None, "the asynchronous rollout ranks are outside "
                                                                           "the ep groups"),
                              ("rl.rollout_backend", rl.rollout_backend != "builtin", "only the built-in engine "
                                                                                      "runs it")):
            if bad:
                raise ValueError(f"rl.rollout.weights: 'expert_parallel' cannot work with {key} = "
                                 f"{self._value_of(key)!r} ({why})")

    def _value_of(self, dotted: str):
        obj = self
        for part in dotted.split("."):
            obj = getattr(obj, part)
        return "a [lora] table" if dotted == "lora" and obj is not None else obj

    def _validate_fp8(self) -> None:
        """Where float8 linear layers cannot go: the GRPO / eval jobs (rollout and scoring forwards share the
        model; not validated in fp8), LoRA (adapters on frozen bases), megatron-core layers (not torch
        Linear modules) and tensor parallelism (DTensor-sharded linears need torchao's float8 TP plans)."""
        if self.train.mode != "sft":
            raise ValueError(f"train.precision: \"fp8\" is for SFT jobs, not train.mode = {self.train.mode!r}")
        if self.lora is not None:
            raise ValueError("train.precision: \"fp8\" cannot be combined with [lora]")
        if self.parallel.backend == "mcore":
            raise ValueError("train.precision: \"fp8\" needs parallel.backend = \"native\" (megatron-core layers "
                             "have no torch Linear modules to convert)")
        if self.parallel.tp > 1:
            raise ValueError(f"train.precision: \"fp8\" needs parallel.tp = 1 (got {self.parallel.tp})")

    def _validate_stages(self) -> None:
        if self.train.mode != "sft":
            raise ValueError(f"stages: only SFT runs chain stages, not train.mode = {self.train.mode!r}")
        names = [s.name for s in self.stages]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"stages: duplicate stage names {dup}")
        if not self.checkpoint.export_hf and len(self.stages) > 1:
            raise ValueError("checkpoint.export_hf: stages start from the previous stage's export; it must be true")
        if self.checkpoint.resume not in ("auto", "none"):
            raise ValueError("checkpoint.resume: with [[stages]] use \"auto\" or \"none\" (each stage has its own folder)")
        if self.data.type == "synthetic_vqa" and any(s.train_path or s.eval_path for s in self.stages):
            raise ValueError("stages: train_path / eval_path need data.type 'messages_jsonl' or 'hf'")


def load_config_dict(raw: dict, overrides: Optional[list[str]] = None) -> Config:
    raw = apply_overrides(raw, list(overrides or []), schema=Config)
    return from_dict(Config, raw)


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> Config:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, not a config file")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        # TOML is UTF-8, whatever the locale says; a byte order mark (Windows editors) is dropped, not an "invalid
        # statement at line 1, column 1"
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return load_config_dict(raw, overrides)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(tomli_w.dumps(to_dict(cfg)))
