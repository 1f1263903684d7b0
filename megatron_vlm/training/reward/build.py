"""Reward-model set-up pieces used by `megatron_vlm.jobs.run_reward`: the `[reward]` section, the refusals of
what this mode does not run, and the model bundle with the scalar-head root.

What it does not run yet, refused with exit 2 naming the key: what `reward_refusal` (config.py) names, and a
`model.path` that is already a `...ForSequenceClassification` folder (training starts from a causal model's
backbone with a fresh head).
"""
from __future__ import annotations

from typing import Any, Optional

from megatron_vlm.checkpoint.hf import read_hf_config
from megatron_vlm.checkpoint.score_folder import model_folder_refusal
from megatron_vlm.errors import ConfigError
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle, build_model_bundle
from megatron_vlm.training.reward.config import RewardTrainConfig, reward_refusal
from megatron_vlm.training.reward.model import ScoreRoot, head_std

__all__ = ["reward_section", "reward_folder_refusal", "build_reward_bundle"]


def reward_section(cfg: Any) -> RewardTrainConfig:
    """The run's `[reward]` section (its defaults when the config has none)."""
    return cfg.reward if getattr(cfg, "reward", None) is not None else RewardTrainConfig()


def reward_folder_refusal(hf_config: dict, path: str) -> Optional[str]:
    """Why the model folder `path` (its config.json `hf_config`) cannot start a reward-model run."""
    return model_folder_refusal(hf_config, path, "reward")


def build_reward_bundle(ctx: RunContext, reward: RewardTrainConfig) -> ModelBundle:
    """The model bundle of `build_model_bundle` with a `ScoreRoot` (a fresh scalar head) as its FSDP root."""
    cfg = ctx.cfg
    refused = reward_refusal(cfg) or reward_folder_refusal(read_hf_config(cfg.model.path), cfg.model.path)
    if refused:
        raise ConfigError(refused)

    def root(model: Any) -> ScoreRoot:
        return ScoreRoot(model, std=head_std(model.hf_config, reward.head_init_std), seed=cfg.train.seed)

    return build_model_bundle(ctx, root=root)
