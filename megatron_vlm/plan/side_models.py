"""Memory per rank of the models a GRPO / PPO run holds beside the policy: PPO's critic and the reward models.

Why: `--check` answers "will it fit"; a critic is a second trained model and a reward model or judge a third
copy on every rank, each of which can be as large as the policy. Counted from the config and the model
folders' config.json on the meta device (no weights), as the policy is (plan/memory.py); bytes per rank:

- critic (`[rl] advantage = "gae"`, rl/critic/build.py): a plain module replicated on every rank (no FSDP), in
  `model.dtype` (m bytes): its backbone (`[rl.critic] model`: a copy of model.path, or another folder) with the
  lm_head kept but frozen, and a scalar value head. P_c parameters, T_c trainable (`train.train_layers`, the
  head, not the lm_head unless tied to the embedding): weights P_c x m + gradients T_c x m + AdamW T_c x 2 x o
  (o = 4 bytes, 2 with `optimizer.moments_dtype = "bf16"`), held through the run; its activations while it trains
  (in m bytes, checkpointed as `train.activation_checkpointing` says for the policy's: rl/critic/build.py) come
  after the policy's update, so they count against the policy's activations (the larger of the two), not on top;
- reward models (`[[rl.rewards]] type = "model"`, rl/rewards/model_reward.py): one full copy per rank in the
  compute dtype (c bytes), without the lm_head (a scalar head instead): P_r x c; a judge (`type = "judge"`,
  rl/rewards/judge.py) is a whole VLM, P_j x c, plus the KV cache of its decoding slots (`batch_size` x
  `max_tokens` positions). Held through the run, or with `offload = true` on the device
  only while scoring, after the rollout's KV cache is freed and before the update: then the largest of them
  counts against the activations / KV cache instead. A folder without config.json is not counted (the run
  refuses it at start, naming `rl.rewards[i].path`); their forward activations (no gradients, one layer at a
  time) are not counted. A reward model whose `max_tokens` is below `data.max_tokens_per_pack` (the bound on
  the policy's prompt + completion) gets a line saying that longer inputs are scored truncated; one (or a judge's)
  above the folder's `max_position_embeddings` is refused, as the run refuses it at start, and so is a judge
  `template` whose own text holds a placeholder or a turn / end token of the judge (its processor built from its
  files, no weights).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_vlm.plan.memory import estimate_memory, gib, model_shape, moment_bytes

__all__ = ["SideModels", "SideModelRefused", "side_models_plan"]


class SideModelRefused(Exception):
    """What the job refuses about the critic or a reward model folder at start: `key` (dotted) and why."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key}: {why}")
        self.key, self.why = key, why


@dataclass
class SideModels:
    lines: list[str] = field(default_factory=list)
    resident: float = 0.0
    """Bytes held on every rank through the run (added to the static part of the peak)."""
    transient: float = 0.0
    """Bytes on the device only while the policy's activations and KV cache are not (critic training, an
    offloaded reward model scoring): the peak takes the larger of these and the policy's."""


def _lm_head_params(model: Any) -> tuple[int, bool]:
    """(parameters of the lm_head, whether it is tied to the input embedding)."""
    head = model.lm_head.weight
    tied = any(head is p for n, p in model.named_parameters() if not n.startswith("lm_head."))
    return head.numel(), tied


def _critic(cfg: Any, hf: dict, build: Callable[[dict], Any], read: Callable[[str], dict], tokens: int,
            master: int) -> SideModels:
    from megatron_vlm.rl.critic.build import critic_folder_refusal, critic_refusal
    from megatron_vlm.training.freeze import apply_train_layers

    critic = cfg.rl.critic
    path = cfg.model.path if critic.model == "policy" else critic.model
    refused = critic_refusal(cfg)  # the job's own refusals (rl/critic/build.py), found here too
    critic_hf = hf if critic.model == "policy" else read(critic.model)
    refused = refused or (critic_folder_refusal(hf, critic_hf, path) if critic.model != "policy" else None)
    if refused:
        key, _, why = refused.partition(": ")
        raise SideModelRefused(key, why)
    model = build(critic_hf)
    apply_train_layers(model, cfg.train.train_layers)
    shape = model_shape(model)
    head, tied = _lm_head_params(model)
    hidden = shape.hidden
    trainable = shape.trainable - (head if not tied and model.lm_head.weight.requires_grad else 0) + hidden + 1
    params = shape.params + hidden + 1
    adam = trainable * 2 * moment_bytes(cfg)
    static = (params + trainable) * master + adam
    act = estimate_memory(shape, fsdp=1, master_bytes=master, compute_bytes=master, tokens=tokens,
                          activation_checkpointing=cfg.train.activation_checkpointing).activations
    what = "a copy of the policy" if critic.model == "policy" else path
    return SideModels(lines=[
        f"critic     {what}: {params / 1e9:.3f} B parameters ({trainable / 1e9:.3f} B trainable), unsharded on every "
        f"rank: weights {gib(params * master)} + gradients {gib(trainable * master)} + AdamW {gib(adam)}; "
        f"activations {gib(act)} while it trains (after the policy's update)"], resident=static, transient=act)


def _reward_models(cfg: Any, build: Callable[[dict], Any], compute: int) -> SideModels:
    from megatron_vlm.inference.kv_budget import kv_elements_per_slot

    out = SideModels()
    for i, r in enumerate(cfg.rl.rewards):
        kind = getattr(r, "type", "")
        if kind not in ("model", "judge"):
            continue
        pack = getattr(getattr(cfg, "data", None), "max_tokens_per_pack", None)
        if kind == "model" and pack is not None and r.max_tokens < pack:
            out.lines.append(f"reward     rl.rewards[{i}].max_tokens = {r.max_tokens} < data.max_tokens_per_pack = {pack}: a "
                             f"prompt + completion over {r.max_tokens} of the reward model's tokens is scored "
                             "truncated (counted in reward/truncated)")
        if kind == "judge":  # the run's refusal at start (rl/rewards/judge.py), with the judge's processor built
            refused = _judge_template_refusal(r)
            if refused:
                raise SideModelRefused(f"rl.rewards[{i}].template", refused)
        config = Path(r.path) / "config.json"
        if not config.is_file():
            out.lines.append(f"reward     rl.rewards[{i}] ({kind}) {r.path}: no config.json yet, not counted (the run "
                             "refuses a folder it cannot load at start)")
            continue
        hf = json.loads(config.read_text())
        from megatron_vlm.rl.rewards.model_reward import position_limit_refusal

        too_long = position_limit_refusal(hf, r.max_tokens, r.path)  # the run's refusal at start, found here too
        if too_long:
            raise SideModelRefused(f"rl.rewards[{i}].max_tokens", too_long)
        if kind == "model":  # the run's own refusal of a folder without a scalar head, found here too
            from megatron_vlm.rl.rewards.score_model import score_architecture_refusal

            refused = score_architecture_refusal(hf, r.path)
            if refused:
                raise SideModelRefused(f"rl.rewards[{i}].path", refused)
        model = build(hf)
        params = sum(p.numel() for p in model.parameters())
        kv = 0.0
        if kind == "model":  # the lm_head is not loaded: the scalar (or n-class) head instead
            from megatron_vlm.rl.rewards.score_model import score_num_labels

            head, tied = _lm_head_params(model)
            params += -(0 if tied else head) + score_num_labels(hf) * model.lm_head.weight.shape[1]
        else:
            kv = kv_elements_per_slot(model) * compute * r.batch_size * r.max_tokens
        size = params * compute + kv
        offload = bool(r.offload)
        if offload:
            out.transient = max(out.transient, size)
        else:
            out.resident += size
        what = f"{gib(params * compute)} weights" + (f" + {gib(kv)} KV cache ({r.batch_size} x {r.max_tokens} positions)"
                                                     if kv else "")
        out.lines.append(f"reward     rl.rewards[{i}] ({kind}) {r.path}: {params / 1e9:.3f} B parameters, a full copy per "
                         f"rank: {what}, " + ("on the device while scoring (offload)" if offload else "held through the run"))
    return out


def side_models_plan(cfg: Any, hf: dict, *, build: Callable[[dict], Any], read: Callable[[str], dict], tokens: int,
                     master_bytes: int, compute_bytes: int) -> SideModels:
    """The critic's and the reward models' lines and bytes per rank (module docstring); empty outside GRPO.
    `build(hf_config)`: a meta-device model; `read(folder)`: its config.json (raises the check's failure)."""
    if cfg.train.mode != "grpo" or cfg.rl is None:
        return SideModels()
    from megatron_vlm.rl.algorithms.advantage_estimators import needs_critic

    parts = []
    if needs_critic(cfg.rl.advantage):
        parts.append(_critic(cfg, hf, build, read, tokens, master_bytes))
    parts.append(_reward_models(cfg, build, compute_bytes))
    return SideModels(lines=[x for p in parts for x in p.lines], resident=sum(p.resident for p in parts),
                      transient=max((p.transient for p in parts), default=0.0))


def _judge_template_refusal(r: Any) -> Optional[str]:
    """The run's refusal of the judge's `template` (`judge.template_special_refusal`), from the judge's processor: its
    tokenizer and processor files only (no weights; a second or two for a real tokenizer). A folder it cannot load is
    left to the run, which names it at start."""
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.rl.rewards.judge import refused_strings, template_special_refusal

    try:
        proc = load_processor(r.path)
    except Exception:  # noqa: BLE001 - the run's own load says what is wrong with the folder
        return None
    return template_special_refusal(r.template, refused_strings(proc), r.path)
