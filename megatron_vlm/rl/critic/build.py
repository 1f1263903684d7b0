"""`build_critic(ctx, bundle, rl)`: PPO's critic for a run with a token advantage estimator (`advantage = "gae"`).

The backbone is read from `model.path` (`[rl.critic] model = "policy"`: a copy of the policy's starting
weights) or from another model folder, which must be of the policy's family and read the same prompts (the
same vocabulary, image / video token ids, vision patching and tiling: InternVL's `downsample_ratio` and tile
`image_size`, `llm_config` for OpenGVLab's layout), since the critic scores the policy's packed
token ids and images as they are. Trained layers follow `train.train_layers`; the lm_head is frozen (the
critic never reads it). An MoE backbone is balanced by the run's `[moe]` policy, as the policy is. Its optimizer is its own AdamW (`[rl.critic] lr`, constant; [optimizer]'s betas, eps
and weight decay), saved in the run's checkpoints beside the policy's (training/checkpointing.py).

What it does not run with yet, refused with exit 2 naming the key: tensor / context / pipeline / expert
parallelism and the megatron-core backend (the critic is a plain module replicated per data-parallel rank).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_vlm.checkpoint.hf import load_hf_model, read_hf_config
from megatron_vlm.errors import ConfigError
from megatron_vlm.models.common.moe import moe_layers
from megatron_vlm.parallel.apply import checkpoint_blocks
from megatron_vlm.parallel.collectives import all_reduce_
from megatron_vlm.rl.algorithms.advantage_estimators import needs_critic
from megatron_vlm.rl.critic.ppo_critic import Critic
from megatron_vlm.rl.critic.value_model import ValueModel
from megatron_vlm.rl.data_shards import DataShards
from megatron_vlm.training.freeze import apply_train_layers
from megatron_vlm.training.moe_balancing import MoELoadBalancer
from megatron_vlm.training.optim import build_optimizer

__all__ = ["build_critic", "critic_refusal", "critic_folder_refusal"]

log = logging.getLogger("megatron_vlm")

_SAME_KEYS = ("model_type", "vocab_size", "image_token_id", "video_token_id", "downsample_ratio")
_SAME_VISION_KEYS = ("patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels", "in_chans", "image_size")


def critic_refusal(cfg: Any) -> Optional[str]:
    """Why this run's parallel layout cannot hold the critic (the message names the key); None when it can. The
    config loader refuses these already (`RLConfig.critic_layout_refusal`); asked again for a config built in code."""
    return cfg.rl.critic_layout_refusal(cfg.parallel)


def _text(cfg: dict) -> dict:
    """The config with its language model's settings on top: `text_config`, or `llm_config` (OpenGVLab's
    `internvl_chat` layout), whose image token is `img_context_token_id` (the Qwen tokenizers' <IMG_CONTEXT> when
    absent, as the family reads it: models/internvl/args.py)."""
    out = dict(cfg)
    for key in ("text_config", "llm_config"):
        if isinstance(cfg.get(key), dict):
            out.update(cfg[key])
    if cfg.get("model_type") == "internvl_chat" and cfg.get("image_token_id") is None:
        from megatron_vlm.models.internvl.args import DEFAULT_IMAGE_TOKEN_ID

        out["image_token_id"] = int(cfg.get("img_context_token_id") or DEFAULT_IMAGE_TOKEN_ID)
    return out


def critic_folder_refusal(policy_cfg: dict, critic_cfg: dict, folder: str) -> Optional[str]:
    """Why the model folder `folder` (config.json `critic_cfg`) cannot be the critic of a policy with
    config.json `policy_cfg`: it must read the same token ids and images. None when it can."""
    archs = critic_cfg.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        return (f"rl.critic.model: {folder} is a sequence-classification folder ({archs[0]}, e.g. a reward model): the "
                "critic loads a causal model folder's backbone and adds its own value head; give the folder the reward "
                "model was trained from (or 'policy')")
    p, c = _text(policy_cfg), _text(critic_cfg)
    for key in _SAME_KEYS:
        # the top level's model_type / downsample_ratio (the family's), the language model's vocabulary and tokens
        a = policy_cfg.get(key) if key in ("model_type", "downsample_ratio") else p.get(key)
        b = critic_cfg.get(key) if key in ("model_type", "downsample_ratio") else c.get(key)
        if a != b:
            return (f"rl.critic.model: {folder} has {key} = {b!r}, the policy (model.path) {a!r}: the critic scores "
                    "the policy's token ids and images, so it must be of the same family with the same tokenizer "
                    "and image settings (or use model = 'policy')")
    pv, cv = policy_cfg.get("vision_config") or {}, critic_cfg.get("vision_config") or {}
    for key in _SAME_VISION_KEYS:
        if pv.get(key) != cv.get(key):
            return (f"rl.critic.model: {folder} has vision_config.{key} = {cv.get(key)!r}, the policy "
                    f"{pv.get(key)!r}: the critic must read the policy's image patches")
    return None


def build_critic(ctx: Any, bundle: Any, rl: Any, total_steps: Optional[int] = None) -> Optional[Critic]:
    """The run's critic (None when `advantage` needs none). ConfigError (exit 2) naming the key when the layout,
    the critic's model folder or its warm-up (longer than the run's `total_steps`) cannot serve."""
    if not needs_critic(rl.advantage):
        return None
    cfg, env = ctx.cfg, ctx.env
    refused = critic_refusal(cfg) or rl.critic_warmup_refusal(total_steps)
    if refused:
        raise ConfigError(refused)
    critic_cfg = rl.critic
    path = cfg.model.path if critic_cfg.model == "policy" else critic_cfg.model
    if critic_cfg.model != "policy":
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"rl.critic.model: {path} has no config.json (a model folder, or 'policy')")
        refused = critic_folder_refusal(read_hf_config(cfg.model.path), read_hf_config(path), path)
        if refused:
            raise ConfigError(refused)
    backbone: Any = load_hf_model(path, dtype=getattr(torch, cfg.model.dtype), device=env.device)
    apply_train_layers(backbone, cfg.train.train_layers)
    # the policy's checkpointing on the critic's blocks too (as large as the policy, it trains on the same packs)
    checkpoint_blocks(backbone.transformer_blocks(), cfg.train.activation_checkpointing)
    head = backbone.lm_head.weight
    if not any(head is p for n, p in backbone.named_parameters() if not n.startswith("lm_head.")):
        head.requires_grad_(False)  # not read by the critic (tied to the embeddings: left as train_layers says)
    model = ValueModel(backbone)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("critic (advantage = %r): %s, %.2fM trainable parameters, lr %g, value_clip %g, warmup_steps %d",
             rl.advantage, "a copy of the policy" if critic_cfg.model == "policy" else path, trainable / 1e6,
             critic_cfg.lr, critic_cfg.value_clip, critic_cfg.warmup_steps)
    optimizer = build_optimizer(model, dataclasses.replace(cfg.optimizer, lr=critic_cfg.lr), env.device.type)
    shards = DataShards.of(bundle.dims, env.rank, env.device)
    # an MoE backbone is balanced by the run's [moe] policy, like the policy (loads summed over the ranks: the
    # critic runs without tp, so each rank is one data shard)
    balancer = MoELoadBalancer(backbone, cfg.moe, all_reduce=all_reduce_) if moe_layers(backbone) else None
    return Critic(model, optimizer, rl, shards=shards, max_grad_norm=cfg.train.max_grad_norm, seed=cfg.train.seed,
                  balancer=balancer)
