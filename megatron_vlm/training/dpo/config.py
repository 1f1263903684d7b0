"""The `[dpo]` config section: preference optimisation (`[train] mode = "dpo"`).

Read only in that mode (another mode with a `[dpo]` section is a config error, exit 2); a DPO run
without the section uses these defaults. Keys that one loss variant would ignore are refused
when set (`check_dpo_keys`): `simpo_gamma` belongs to `loss_type = "simpo"`, and SimPO has no
reference model, so `reference` cannot be changed for it. The on-the-fly reference of a LoRA run is the policy
with its adapters off, which is not the initial model when `lora.init_from` continues an adapter: refused too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatron_vlm.errors import ConfigError

__all__ = ["DPOConfig", "check_dpo_keys"]


@dataclass(kw_only=True)
class DPOConfig:
    """[dpo]: preference optimisation on (prompt with images, chosen, rejected) pairs (docs/dpo.md)."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward: sigmoid = DPO's beta, ipo = the regularisation tau (target
    margin 1 / (2 beta)), simpo = SimPO's reward scale."""
    loss_type: str = "sigmoid"
    """sigmoid = DPO; ipo = IPO on per-token log-ratios; simpo = SimPO (reference-free, length-normalised,
    margin `simpo_gamma`). More register by name: megatron_vlm/training/dpo/loss_registry.py."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (loss_type = "simpo" only)."""
    reference: Literal["on_the_fly", "precomputed"] = "on_the_fly"
    """Reference log-probs from the frozen initial model: "on_the_fly" = a forward of the reference in every step
    (a frozen copy of model.path; with [lora] the policy with its adapters switched off); "precomputed" = one pass
    over the train and held-out pairs before the first step, kept in <output_dir>/dpo_reference_logps.pt (a resumed
    run reads it back; no reference model is held during training; a pair that pass could not score is left out
    and counted in bad_records.json). Not used by simpo."""
    prompt_sharing: Literal["auto", "off"] = "auto"
    """Each pair's prompt computed once per forward, the chosen and the rejected response continuing it
    (training/pair_prompts.py): the same log-probs and gradients up to float rounding, with fewer tokens forwarded.
    "auto": where the layout holds (not Mamba2 decoders, tensor / context / pipeline parallelism or
    moe.aux_loss_coef > 0; the startup log says which); "off": every pack as the loader builds it, each response
    with its own copy of the prompt (to compare with, or rule out, the shared layout)."""

    def validate(self) -> None:
        from megatron_vlm.training.dpo.loss_registry import PREFERENCE_LOSSES

        if self.loss_type not in PREFERENCE_LOSSES:
            raise ValueError(f"loss_type: must be one of {PREFERENCE_LOSSES.names()}, got {self.loss_type!r}")
        if self.beta <= 0:
            raise ValueError(f"beta: must be > 0, got {self.beta}")
        if self.simpo_gamma < 0:
            raise ValueError(f"simpo_gamma: must be >= 0, got {self.simpo_gamma}")
        if self.prompt_sharing not in ("auto", "off"):
            raise ValueError(f"prompt_sharing: must be 'auto' or 'off', got {self.prompt_sharing!r}")


def check_dpo_keys(dpo: DPOConfig, lora: Any = None) -> None:
    """ConfigError naming a `[dpo]` key that the chosen loss variant would ignore, or a reference this run cannot
    have (`lora`: the run's `[lora]` section or None)."""
    if dpo.loss_type != "simpo" and dpo.simpo_gamma != DPOConfig.simpo_gamma:
        raise ConfigError(f"dpo.simpo_gamma: only read with loss_type = \"simpo\" (loss_type is {dpo.loss_type!r}); "
                          "remove it")
    if dpo.loss_type == "simpo" and dpo.reference != DPOConfig.reference:
        raise ConfigError("dpo.reference: SimPO (loss_type = \"simpo\") is reference-free: no reference log-probs are "
                          "computed; remove it")
    from megatron_vlm.training.dpo.losses import REFERENCE_FREE

    if (dpo.loss_type not in REFERENCE_FREE and dpo.reference == "on_the_fly" and lora is not None and lora.init_from
            and lora.init_from_mode == "continue"):
        raise ConfigError("dpo.reference: with lora.init_from (init_from_mode = \"continue\") the initial model is the "
                          "base plus that adapter, not the policy with its adapters off; use reference = "
                          "\"precomputed\"")
