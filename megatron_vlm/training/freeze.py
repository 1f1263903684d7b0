"""`train.train_layers`: regexes over parameter names or module class names (e.g.
`["Qwen3VLVisionPatchMerger"]` trains only the modules of that class); everything else is frozen.
A pattern can only be checked against the built model, so its errors are ConfigError: the runner turns
them into exit 2 and one line, as --check does, instead of a traceback."""
from __future__ import annotations

import re

import torch

from megatron_vlm.errors import ConfigError


def apply_train_layers(model: torch.nn.Module, patterns: list[str]) -> tuple[int, int]:
    """Freeze all parameters not matched; returns (trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    if not patterns:
        return total, total
    regexes = []
    for pat in patterns:
        try:
            regexes.append(re.compile(pat))
        except re.error as e:
            raise ConfigError(f"train.train_layers: invalid regex {pat!r}: {e}") from None
    keep: set[int] = set()
    hits = {pat: 0 for pat in patterns}
    for mod_name, mod in model.named_modules():
        cls = type(mod).__name__
        for pat, rx in zip(patterns, regexes):
            if rx.fullmatch(cls) or (mod_name and rx.search(mod_name) and not list(mod.children())):
                for p in mod.parameters():
                    keep.add(id(p))
                hits[pat] += 1
    for name, p in model.named_parameters():
        for pat, rx in zip(patterns, regexes):
            if rx.search(name):
                keep.add(id(p))
                hits[pat] += 1
    missing = [p for p, n in hits.items() if n == 0]
    if missing:
        raise ConfigError(f"train.train_layers: {missing} match no parameter name or module class of the model")
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total
