"""`[lora]` in a training run: which layers get adapters, starting from an earlier adapter, and the
adapter / merged outputs.

Target selection works on transformers' module names (what PEFT users write and what the adapter
file holds), computed per layer by `checkpoint.peft_format.PeftNames`: a plain entry of
`lora.target_modules` ("q_proj", or dotted: "self_attn.q_proj") matches the name or its last parts, as
PEFT matches a list entry; "all-linear" (PEFT's shorthand) matches every candidate; any other entry is a regex
matched against the whole name. Candidates are the model's `nn.Linear` layers that have a PEFT name, under
`language_model.` (plus the vision tower and projector with `lora.include_vision`), never the LM head
(the fused log-prob path reads its weight directly). Routed MoE experts are grouped 3-D weights, not
linear layers: with expert parallelism they stay frozen and EP-sharded as before, and the adapters
(attention, dense and shared-expert MLPs) are FSDP-sharded with the rest of each block.

Everything here works on the unsharded model (before TP / FSDP); with `parallel.tp > 1` the tp plan then
splits each adapter like its base layer (parallel/lora_tp.py), and the files are written from gathered
(full) factors.

With `parallel.backend = "mcore"` this runs on the native model before its decoder layers are swapped for
megatron-core ones, which take the adapters over under the same names (models/mcore/layer.py).

Every entry the config names must match at least one layer (of the default list, at least one entry must:
Nemotron-H has no gate_proj); a match that cannot be written in PEFT format is an error
rather than a silently skipped layer.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Optional, cast

import torch
from torch import nn

from megatron_vlm.checkpoint.peft_format import PeftNames, read_peft_adapter, save_peft_adapter
from megatron_vlm.errors import ConfigError
from megatron_vlm.models.common.lora import LORA_KEY_PARTS, apply_lora, lora_modules, lora_scaling, merge_lora_

__all__ = ["LoRASetupError", "DEFAULT_TARGETS", "select_lora_targets", "setup_lora", "lora_factors", "write_adapter", "base_state_dict",
           "scaling_of"]

log = logging.getLogger("megatron_vlm")

class LoRASetupError(ConfigError):
    """A `[lora]` key that cannot be applied to this model (the run exits 2, as for a config error)."""


DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL_LINEAR = "all-linear"
"""PEFT's (and ms-swift's) shorthand entry: every candidate linear layer (never the LM head, as PEFT leaves out the
output layer)."""
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")
"""A module name or its last parts ("q_proj", "self_attn.q_proj", "layers.1.mlp.down_proj"): PEFT's list entries,
matched as the whole name or a dot-separated suffix of it (PEFT's rule); any other entry is a regex."""


def select_lora_targets(model: nn.Module, hf_config: dict, patterns: list[str], *, include_vision: bool) -> dict[str, str]:
    """our module name -> PEFT module name of the layers to adapt (see the module docstring)."""
    names = PeftNames(hf_config)
    explicit = bool(patterns)
    patterns = list(patterns) or DEFAULT_TARGETS
    matchers = []
    for pat in patterns:
        if pat == ALL_LINEAR:
            matchers.append((pat, lambda n, p=pat: True))
        elif _PLAIN.fullmatch(pat):
            matchers.append((pat, lambda n, p=pat: n == p or n.endswith("." + p)))
        else:
            try:
                rx = re.compile(pat)
            except re.error as e:
                raise ValueError(f"lora.target_modules: invalid regex {pat!r}: {e}") from None
            matchers.append((pat, lambda n, rx=rx: rx.fullmatch(n) is not None))
    hits = {pat: 0 for pat in patterns}
    selected: dict[str, str] = {}
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or name == "lm_head":
            continue
        if not include_vision and not name.startswith("language_model."):
            continue
        peft = names.to_peft(name, cast(tuple[int, int], tuple(mod.weight.shape)))
        if peft is None:  # fused / reshaped in the HF checkpoint (e.g. Qwen2.5-VL's vision qkv): no PEFT name
            continue
        matched = [pat for pat, m in matchers if m(peft)]
        if not matched:
            continue
        for pat in matched:
            hits[pat] += 1
        selected[name] = peft
    missing = [p for p, n in hits.items() if n == 0]
    if not explicit and selected:  # the defaults name every family's projections; Nemotron-H has no gate_proj
        missing = []
    if missing:
        scope = "the model" if include_vision else "the language model (lora.include_vision = false)"
        raise ValueError(f"lora.target_modules: {missing} match no adaptable linear layer of {scope} (names are "
                         "transformers' module names; layers fused in the Hugging Face checkpoint cannot be adapted)")
    return selected


def setup_lora(model: nn.Module, cfg, hf_config: dict, *, training: bool = True) -> dict[str, str]:
    """Apply `[lora]` (`cfg`) to an unsharded `model` (before FSDP): select, wrap, and load / merge
    `cfg.init_from`. Returns our name -> PEFT name of the adapted layers. Raises ValueError with the key.

    `training = False` (a model that is only merged and written, launch/convert_checkpoint.py) also takes an
    `init_from` adapter on the LM head, which training refuses: its loss reads `lm_head.weight` directly
    (training/lm_loss.py), so that adapter would neither train nor count in the loss."""
    init = None
    if cfg.init_from:
        try:
            init, factors = read_peft_adapter(cfg.init_from, hf_config)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"lora.init_from: {e}") from None
        for key, ours in (("r", cfg.r), ("lora_alpha", cfg.alpha), ("use_rslora", cfg.use_rslora)):
            theirs = init.get(key, False if key == "use_rslora" else None)
            if theirs != ours and not (isinstance(theirs, (int, float)) and float(theirs) == float(ours)):
                raise ValueError(f"lora.init_from: the adapter in {cfg.init_from} has {key} = {theirs!r}, "
                                 f"this section {ours!r}; they must agree")
    if init is not None and not cfg.target_modules:
        modules = dict(model.named_modules())
        selected = {}
        names = PeftNames(hf_config)
        for ours in factors:
            mod = modules.get(ours)
            if type(mod) is not nn.Linear:
                raise ValueError(f"lora.init_from: {ours} is not a linear layer of the model")
            if ours == "lm_head" and training:  # the loss reads lm_head.weight itself: never trained, not in the loss
                raise ValueError(f"lora.init_from: the adapter in {cfg.init_from} adapts the LM head (lm_head), which "
                                 "LoRA training cannot (the loss reads its weight directly); merge that adapter into "
                                 "the base model (python launch/convert_checkpoint.py --adapter ... --merge) and "
                                 "start from the merged folder")
            peft = names.to_peft(ours, cast(tuple[int, int], tuple(mod.weight.shape)))
            if peft is None and training:  # the adapter file at the end of the run could not be written
                raise ValueError(f"lora.init_from: {ours} (in {cfg.init_from}) has no single Hugging Face "
                                 "counterpart; an adapter on it cannot be written in PEFT format")
            selected[ours] = peft or ours
    else:
        selected = select_lora_targets(model, hf_config, cfg.target_modules, include_vision=cfg.include_vision)
    apply_lora(model, selected, r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout, use_rslora=cfg.use_rslora, init=cfg.init)
    if init is not None:
        extra, lacking = sorted(set(factors) - set(selected)), sorted(set(selected) - set(factors))
        if extra or lacking:
            raise ValueError(f"lora.init_from: the adapter's layers differ from lora.target_modules "
                             f"(only in the adapter: {extra[:5]}; only in the config: {lacking[:5]})")
        mods = lora_modules(model)
        with torch.no_grad():
            for ours, (a, b) in factors.items():
                mod = mods[ours]
                if tuple(a.shape) != tuple(mod.lora_A.weight.shape) or tuple(b.shape) != tuple(mod.lora_B.weight.shape):
                    raise ValueError(f"lora.init_from: {ours}: shapes {tuple(a.shape)} / {tuple(b.shape)} do not fit "
                                     f"{tuple(mod.lora_A.weight.shape)} / {tuple(mod.lora_B.weight.shape)}")
                mod.lora_A.weight.copy_(a)
                mod.lora_B.weight.copy_(b)
        if cfg.init_from_mode == "merge":
            merge_lora_(model)
        log.info("LoRA: %s the adapter of %s", "merged" if cfg.init_from_mode == "merge" else "continuing", cfg.init_from)
    n = sum(m.lora_A.weight.numel() + m.lora_B.weight.numel() for m in lora_modules(model).values())
    log.info("LoRA: r=%d alpha=%g on %d layers (%.2fM adapter parameters)", cfg.r, cfg.alpha, len(selected), n / 1e6)
    return selected


def lora_factors(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """our module name -> (lora_A, lora_B) from a full (unsharded) state dict of a LoRA model."""
    out = {}
    for key, a in state_dict.items():
        if key.endswith(".lora_A.weight"):
            prefix = key[: -len(".lora_A.weight")]
            out[prefix] = (a, state_dict[f"{prefix}.lora_B.weight"])
    return out


def base_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict without adapter factors."""
    return {k: v for k, v in state_dict.items() if not any(p in k for p in LORA_KEY_PARTS)}


def write_adapter(path: Path, state_dict: dict[str, torch.Tensor], hf_config: dict, cfg,
                  base_model_name_or_path: Optional[str] = None) -> Path:
    """Write the adapter factors of a full state dict (our names) as a PEFT folder at `path`.

    With `init_from_mode = "merge"` the adapter belongs to base + the `init_from` adapter, a model no
    folder holds: `base_model_name_or_path` is left out (null), since naming the original base would make
    `AutoPeftModel*.from_pretrained(path)` silently build a model without the earlier adapter."""
    if getattr(cfg, "init_from", None) and getattr(cfg, "init_from_mode", "continue") == "merge":
        if base_model_name_or_path is not None:
            log.warning("LoRA: the adapter in %s was trained on %s with %s merged in; its adapter_config.json names "
                        "no base model (apply it to that merged model, or use the merged export)",
                        path, base_model_name_or_path, cfg.init_from)
        base_model_name_or_path = None
    return save_peft_adapter(path, lora_factors(state_dict), hf_config, r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout,
                             use_rslora=cfg.use_rslora, base_model_name_or_path=base_model_name_or_path)


def scaling_of(cfg) -> float:
    return lora_scaling(cfg.r, cfg.alpha, cfg.use_rslora)
