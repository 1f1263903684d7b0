"""The frozen reference policy for GRPO's KL penalty.

A separate, frozen copy of the initial policy (`model.path`, loaded once; a resumed run therefore
keeps the same reference). It is not sharded: every rank holds the full reference weights in the
compute dtype, on the device, or on the CPU with `rl.update.ref_offload` (moved to the device only while
it scores a step: `with ref.on_device(): ...`). Log-probs use the same fused, vocabulary-chunked
path as the policy (`TokenLogprobModel`), at the rollout temperature, of the same distribution as the policy's
(a VLM's vision tokens, which the rollout engines never sample, removed from the softmax: training/masked_vocab.py). Under bf16 precision it casts its inputs as the trainer's mixed
precision does (`copy_input_casts`, models/common/parallel_plan.py), so at the policy's own weights its log-probs
are the policy's, bit for bit, and the KL penalty starts at 0. With `rl.loss.kl_coef = 0` no
reference model is built at all.

With `[lora]` the reference is the policy's own model with its adapters switched off
(`BaseModelReference`): the base weights, sharded like the policy, and no second copy.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from megatron_vlm.inference.policy_engine import vision_token_ids
from megatron_vlm.models.common.lora import lora_disabled
from megatron_vlm.models.common.parallel_plan import copy_input_casts
from megatron_vlm.parallel.device_cache import empty_device_cache
from megatron_vlm.training.lm_loss import TokenLogprobModel

__all__ = ["ReferencePolicy", "BaseModelReference"]


def _mask_kw(model) -> dict:
    """The scorer's `masked_token_ids` (the vision tokens), passed only when the model has some."""
    ids = tuple(vision_token_ids(model))
    return {"masked_token_ids": ids} if ids else {}


class ReferencePolicy:
    def __init__(self, model: torch.nn.Module, *, device: torch.device, offload: bool, temperature: float,
                 param_dtype: Optional[torch.dtype] = None):
        """`param_dtype`: the trainer's mixed-precision dtype (`mixed_param_dtype`; None: full precision), whose
        input casts the reference makes too (`copy_input_casts`: log p_ref = log p of the policy at equal weights)."""
        model.eval().requires_grad_(False)
        self.device = device
        self.offload = offload and device.type != "cpu"
        self.temperature = temperature
        self.mask_kw = _mask_kw(model)
        self.scorer = TokenLogprobModel(model)
        copy_input_casts(model, param_dtype, root=self.scorer)
        self.scorer.to("cpu" if self.offload else device)
        self._on_device = not self.offload

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, device: torch.device, offload: bool,
                        temperature: float, param_dtype: Optional[torch.dtype] = None) -> ReferencePolicy:
        from megatron_vlm.checkpoint.hf import load_hf_model

        return cls(load_hf_model(path, dtype=dtype, device="cpu"), device=device, offload=offload, temperature=temperature,
                   param_dtype=param_dtype)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[ReferencePolicy]:
        """Keep the weights on the device for the block (a no-op without offload)."""
        if self._on_device:
            yield self
            return
        self.scorer.to(self.device)
        self._on_device = True
        try:
            yield self
        finally:
            self.scorer.to("cpu")
            self._on_device = False
            empty_device_cache(self.device)

    @torch.no_grad()
    def token_logprobs(self, batch: dict) -> torch.Tensor:
        """log p_ref of the labelled tokens of a packed batch (already on the device), in order."""
        if not self._on_device:
            with self.on_device():
                return self.scorer(batch, temperature=self.temperature, **self.mask_kw)
        return self.scorer(batch, temperature=self.temperature, **self.mask_kw)


class BaseModelReference:
    """The reference of a LoRA run: `wrapper` (the policy's FSDP root) with every adapter of `model`
    disabled, in eval mode (no adapter dropout). Its forward is collective like the policy's
    (`collective`: every rank scores the same number of packs)."""

    collective = True

    def __init__(self, wrapper: torch.nn.Module, model: torch.nn.Module, *, temperature: float):
        self.wrapper, self.model, self.temperature = wrapper, model, temperature
        self.mask_kw = _mask_kw(model)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[BaseModelReference]:
        yield self  # the policy's weights are already where they train

    @torch.no_grad()
    def token_logprobs(self, batch: dict) -> torch.Tensor:
        was_training = self.wrapper.training
        self.wrapper.eval()
        try:
            with lora_disabled(self.model):
                return self.wrapper(batch, temperature=self.temperature, **self.mask_kw)
        finally:
            self.wrapper.train(was_training)
