"""The `[reward]` config section: reward-model training (`[train] mode = "reward"`).

Read only in that mode (another mode with a `[reward]` section is a config error, exit 2); a reward run
without the section uses these defaults. The names follow TRL's `RewardTrainer` / `RewardConfig`.

What the mode does not run yet, refused with exit 2 naming the key (`reward_refusal`, from the mode-key checks,
so `--check` finds it too): tensor / context / pipeline / expert parallelism and the megatron-core backend (the
head reads the final hidden state of whole sequences on a data-parallel replica: not wired or tested beyond
FSDP), `[lora]` (the export would need the adapter merged and the head saved beside it), and fp8.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

__all__ = ["RewardTrainConfig", "reward_refusal"]


@dataclass(kw_only=True)
class RewardTrainConfig:
    """[reward]: a sequence-classification reward model trained on (prompt with images, chosen, rejected) pairs
    with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) (docs/reward_models.md)."""

    margin: float = 0.0
    """Required reward gap: the loss is -log sigmoid(r_chosen - r_rejected - margin) (TRL's per-pair `margin`
    column, here one value for every pair; 0 = the plain Bradley-Terry loss)."""
    center_rewards_coefficient: float = 0.0
    """Adds coefficient x mean((r_chosen + r_rejected)^2) to the loss, pulling the rewards towards mean 0
    (TRL's `center_rewards_coefficient`, Eisenstein et al. 2023; 0 = off)."""
    head_init_std: float = 0.0
    """Standard deviation of the fresh scalar head's normal initialisation; 0 = the model config's
    `initializer_range` (0.02 when it has none), as transformers initialises `score`."""
    prompt_sharing: Literal["auto", "off"] = "auto"
    """Each pair's prompt computed once per forward, the chosen and the rejected response continuing it
    (training/pair_prompts.py): the same rewards and gradients up to float rounding, with fewer tokens forwarded.
    "auto": where the layout holds (not Mamba2 decoders, tensor / context / pipeline parallelism or
    moe.aux_loss_coef > 0; the startup log says which); "off": every pack as the loader builds it, each response
    with its own copy of the prompt (to compare with, or rule out, the shared layout)."""

    def validate(self) -> None:
        if self.center_rewards_coefficient < 0:
            raise ValueError(f"center_rewards_coefficient: must be >= 0, got {self.center_rewards_coefficient}")
        if self.head_init_std < 0:
            raise ValueError(f"head_init_std: must be >= 0, got {self.head_init_std}")
        if self.prompt_sharing not in ("auto", "off"):
            raise ValueError(f"prompt_sharing: must be 'auto' or 'off', got {self.prompt_sharing!r}")


def reward_refusal(cfg: Any) -> Optional[str]:
    """Why this config cannot train a reward model (the message starts with the key); None when it can."""
    par = cfg.parallel
    for key in ("tp", "cp", "pp", "ep"):
        n = getattr(par, key, 1)
        if n > 1:
            return (f"parallel.{key}: {n} with train.mode = \"reward\": reward-model training runs on data-parallel "
                    f"(FSDP) ranks only so far; set parallel.{key} = 1")
    if par.backend == "mcore":
        return "parallel.backend: 'mcore' with train.mode = \"reward\": the native layers only so far; set backend = 'native'"
    if getattr(cfg, "lora", None) is not None:
        return "lora: train.mode = \"reward\" trains the backbone and the head in full; remove the [lora] section"
    if cfg.train.precision == "fp8":
        return "train.precision: 'fp8' is SFT only; use 'auto', 'bf16' or 'fp32' with train.mode = \"reward\""
    return None
