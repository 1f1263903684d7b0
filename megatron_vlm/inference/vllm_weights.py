"""The trainer's weights as Hugging Face tensors, in buckets of bounded size, for the vLLM engine's push.

Why buckets and not a state dict: a full host copy of the model is what the push must avoid. The
trainer's state dict is walked one layer at a time (the tensors a family adapter fuses or splits,
e.g. a vision block's q / k / v, always lie in one layer), each sharded entry gathered to its full
tensor only then (a collective: every rank walks the same order), LoRA factors folded into their base
weight (W + scaling B A, what `save_hf_model` exports), megatron-core layers mapped back to native
names, and the family's `to_hf` gives the checkpoint names vLLM's `load_weights` reads — the names of
the exported folder, so a push and a fresh engine on the export hold the same weights. Tensors stay
on the trainer's device (a CUDA engine reads them there).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from megatron_vlm.parallel.full_weights import block_groups, full_tensor

__all__ = ["hf_weight_buckets"]



def hf_weight_buckets(model: nn.Module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(HF name, full tensor) lists of at most `bucket_bytes` each (a larger tensor alone), in state-dict
    order; see the module docstring. Every rank of a sharded model must iterate it to the end."""
    from megatron_vlm.models.common.lora import lora_modules, merged_state_dict
    from megatron_vlm.models.mcore.layer import native_state_dict
    from megatron_vlm.models.registry import family_for_args

    adapter = family_for_args(model.args).state_dict_adapter(model.args)
    adapted = lora_modules(model)
    scaling = next(iter(adapted.values())).scaling if adapted else None
    state = model.state_dict()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for names in block_groups(state).values():
        part = {k: full_tensor(state[k]).detach() for k in names}
        if scaling is not None:
            part = merged_state_dict(part, scaling)
        for hf_name, t in adapter.to_hf(native_state_dict(part, model)).items():
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((hf_name, t))
            size += nbytes
    if bucket:
        yield bucket
