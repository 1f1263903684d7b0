"""LoRA (low-rank adaptation) of linear layers, with the numerics of PEFT's `LoraLayer`.

`LoRALinear` replaces an `nn.Linear` in place and keeps its `weight` / `bias` Parameters under the
same names (so state-dict adapters, checkpoints, FSDP2 and the memory planner see the base layer
unchanged) and adds two trainable factors, `lora_A` [r, in] and `lora_B` [out, r]:

    y = x W^T + b + scaling * B(A(dropout(x)))        scaling = alpha / r   (rsLoRA: alpha / sqrt(r))

exactly as PEFT computes it, so an adapter written in PEFT's format gives the same logits through
`peft.PeftModel`. Initialisation follows PEFT: "default" = A Kaiming-uniform (a = sqrt(5), as
`nn.Linear`), B = 0; "gaussian" = A normal with standard deviation 1/r,
B = 0. Both start as the base model.

`LoRAAdapter` is the adapter alone (factors, dropout, scaling, on / off), of which `LoRALinear` is the
nn.Linear form: parallel.backend = "mcore" layers hold the same adapters without base layers and add
`add_lora` to the slices of their fused projections (models/mcore/layer.py), with the same math.

`lora_disabled(model)` switches every adapter off for a block (GRPO's reference policy is the base
model: the same weights, no second copy); `merged_state_dict` folds W + scaling * B A into a plain
state dict (the merged export). Routed MoE experts are grouped 3-D weights, not `nn.Linear`, so they
are never adapted; this module only ever wraps `nn.Linear`.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoRAAdapter", "LoRALinear", "apply_lora", "mirror_lora", "lora_modules", "lora_disabled", "lora_scaling", "merged_state_dict",
           "merge_lora_", "LORA_KEY_PARTS"]

LORA_KEY_PARTS = (".lora_A.", ".lora_B.")
"""State-dict keys containing one of these belong to an adapter, not to the base model."""


def lora_scaling(r: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA (rank-stabilised LoRA)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


class LoRAAdapter(nn.Module):
    """The adapter alone: factors `lora_A` [r, in] / `lora_B` [out, r], dropout, scaling, on / off switch.

    `LoRALinear` is this plus its base `nn.Linear`. The adapter without a base layer exists for layers
    whose projections are fused into one weight (parallel.backend = "mcore": megatron-core's `linear_qkv`
    holds q / k / v, `linear_fc1` gate | up): the layer adds `add_lora(out, x)` to the slice of its fused
    output that the native projection would have produced, so both backends run this same math."""

    def _init_lora(self, in_features: int, out_features: int, *, r: int, alpha: float, dropout: float,
                   use_rslora: bool, init: str, device, dtype) -> None:
        if r <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {r}")
        self.lora_A = nn.Linear(in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r, self.alpha, self.use_rslora, self.init = r, alpha, use_rslora, init
        self.scaling = lora_scaling(r, alpha, use_rslora)
        self.lora_enabled = True
        if torch.device(device).type != "meta":
            self.reset_lora_parameters()

    @classmethod
    def of(cls, adapted: LoRAAdapter) -> LoRAAdapter:
        """An adapter holding the same factor / dropout modules (the same Parameters) as `adapted`."""
        out = cls()
        out.lora_A, out.lora_B, out.lora_dropout = adapted.lora_A, adapted.lora_B, adapted.lora_dropout
        out.r, out.alpha, out.use_rslora, out.init = adapted.r, adapted.alpha, adapted.use_rslora, adapted.init
        out.scaling, out.lora_enabled = adapted.scaling, adapted.lora_enabled
        return out

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """PEFT's initialisation (B = 0, so the adapted layer starts equal to the base layer)."""
        if self.init == "gaussian":
            nn.init.normal_(self.lora_A.weight, std=1.0 / self.r)
        elif self.init == "default":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        else:
            raise ValueError(f"LoRA init {self.init!r}: expected 'default' or 'gaussian'")
        nn.init.zeros_(self.lora_B.weight)

    def add_lora(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for input `x`) + scaling * B(A(dropout(x))); `out` when disabled."""
        if not self.lora_enabled:
            return out
        # PEFT casts the input to the adapter's dtype and the result back (bf16 base + fp32 adapter work too)
        a = self.lora_A.weight
        delta = self.lora_B(self.lora_A(self.lora_dropout(x.to(a.dtype)))) * self.scaling
        return out + delta.to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A, [out, in] (the update a merge adds to the base weight)."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return (f"in_features={self.lora_A.in_features}, out_features={self.lora_B.out_features}, r={self.r}, "
                f"alpha={self.alpha}, rslora={self.use_rslora}")


class LoRALinear(nn.Linear, LoRAAdapter):
    """An `nn.Linear` (same `weight` / `bias` Parameters) plus a LoRA adapter; see the module docstring."""

    def __init__(self, base: nn.Linear, *, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 init: Literal["default", "gaussian"] = "default") -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: the base layer's Parameters are reused, not reallocated
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self._init_lora(self.in_features, self.out_features, r=r, alpha=alpha, dropout=dropout, use_rslora=use_rslora,
                        init=init, device=base.weight.device, dtype=base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(F.linear(x, self.weight, self.bias), x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"r={self.r}, alpha={self.alpha}, rslora={self.use_rslora}")


def apply_lora(model: nn.Module, names: Iterable[str], *, r: int, alpha: float, dropout: float = 0.0,
               use_rslora: bool = False, init: Literal["default", "gaussian"] = "default") -> list[str]:
    """Replace each named `nn.Linear` of `model` by a `LoRALinear`; freeze every base parameter.

    Returns the wrapped names. Call it before sharding (FSDP2 wraps the new parameters like any other);
    after it only the adapter factors require grad."""
    names = list(names)
    modules = dict(model.named_modules())
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        mod = modules.get(name)
        if type(mod) is not nn.Linear:
            raise ValueError(f"LoRA target {name!r} is {type(mod).__name__ if mod is not None else 'not a module'}, "
                             "not an nn.Linear")
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, child, LoRALinear(mod, r=r, alpha=alpha, dropout=dropout, use_rslora=use_rslora, init=init))
    for mod in lora_modules(model).values():
        mod.lora_A.weight.requires_grad_(True)
        mod.lora_B.weight.requires_grad_(True)
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRAAdapter]:
    """name -> adapter (a LoRALinear, or a LoRAAdapter of a fused megatron-core projection) of every adapted layer."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRAAdapter)}


def mirror_lora(target: nn.Module, source: nn.Module) -> list[str]:
    """Give `target` (an unsharded copy of `source`'s architecture, e.g. the rollout engine's own weights) an
    adapter at each name where `source` has one, with the same rank / alpha / rsLoRA, so that `source`'s state
    dict (adapter factors included) loads into it and its forward computes what `source`'s does. No dropout:
    a copy that only decodes runs in eval mode. Returns the names adapted (none when `source` has no adapter)."""
    adapters = lora_modules(source)
    if not adapters:
        return []
    first = next(iter(adapters.values()))
    return apply_lora(target, adapters, r=first.r, alpha=first.alpha, use_rslora=first.use_rslora)


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block the model computes its base weights only (adapters skipped, not zeroed)."""
    mods = list(lora_modules(model).values())
    before = [m.lora_enabled for m in mods]
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.lora_enabled = b


def merged_state_dict(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A plain (unsharded) state dict with LoRA factors -> the base layout with W + scaling * B A folded
    in (computed in fp32, written in W's dtype); adapter keys removed."""
    out = {k: v for k, v in state_dict.items() if not any(p in k for p in LORA_KEY_PARTS)}
    for key, a in state_dict.items():
        if not key.endswith(".lora_A.weight"):
            continue
        prefix = key[: -len(".lora_A.weight")]
        b = state_dict.get(f"{prefix}.lora_B.weight")
        w = out.get(f"{prefix}.weight")
        if b is None or w is None:
            raise ValueError(f"{prefix}: a LoRA factor without its lora_B / base weight in the state dict")
        out[f"{prefix}.weight"] = (w.float() + (b.float() @ a.float()) * scaling).to(w.dtype)
    return out


@torch.no_grad()
def merge_lora_(model: nn.Module) -> None:
    """Fold every adapter into its base weight in place and restart it from PEFT's initialisation (B = 0)
    — used to continue training a new adapter on top of a merged earlier one. Unsharded models only."""
    for name, mod in lora_modules(model).items():
        if not isinstance(mod, LoRALinear):
            raise ValueError(f"{name}: an adapter of a fused projection (parallel.backend = 'mcore'); merge before "
                             "the megatron-core layers are built")
        mod.weight.add_(mod.delta_weight().to(mod.weight.dtype))
        mod.reset_lora_parameters()
