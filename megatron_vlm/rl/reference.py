"""The frozen reference policy for GRPO's KL penalty.

A separate, frozen copy of the initial policy (`model.path`, loaded once; a resumed run therefore
keeps the same reference). It is not sharded: every rank holds the full reference weights in the
compute dtype, on the device, or on the CPU with `rl.ref_offload` (moved to the device only while
it scores a step: `with ref.on_device(): ...`). Log-probs use the same fused, vocabulary-chunked
path as the policy (`TokenLogprobModel`), at the rollout temperature. With `rl.kl_coef = 0` no
reference model is built at all.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_vlm.training.lm_loss import TokenLogprobModel

__all__ = ["ReferencePolicy"]


class ReferencePolicy:
    def __init__(self, model: torch.nn.Module, *, device: torch.device, offload: bool, temperature: float):
        model.eval().requires_grad_(False)
        self.device = device
        self.offload = offload and device.type != "cpu"
        self.temperature = temperature
        self.scorer = TokenLogprobModel(model)
        self.scorer.to("cpu" if self.offload else device)
        self._on_device = not self.offload

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, device: torch.device, offload: bool,
                        temperature: float) -> "ReferencePolicy":
        from megatron_vlm.checkpoint.hf import load_hf_model

        return cls(load_hf_model(path, dtype=dtype, device="cpu"), device=device, offload=offload, temperature=temperature)

    @contextlib.contextmanager
    def on_device(self) -> Iterator["ReferencePolicy"]:
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
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @torch.no_grad()
    def token_logprobs(self, batch: dict) -> torch.Tensor:
        """log p_ref of the labelled tokens of a packed batch (already on the device), in order."""
        if not self._on_device:
            with self.on_device():
                return self.scorer(batch, temperature=self.temperature)
        return self.scorer(batch, temperature=self.temperature)
