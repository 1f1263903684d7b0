"""Held-out loss and perplexity: the mean negative log-likelihood of the trained (assistant) tokens
of the eval split, packed as for training, summed over all ranks.

Every rank runs the same number of forward calls (FSDP all-gathers are collective): the eval loader
pads the ranks with empty packs, which run a one-token forward but are not counted.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_vlm.data.batch import IGNORE_INDEX
from megatron_vlm.data.loader import build_eval_dataloader
from megatron_vlm.parallel.collectives import all_reduce_sum
from megatron_vlm.training.context import RunContext
from megatron_vlm.training.model_bundle import ModelBundle

__all__ = ["heldout_loss", "heldout_loader"]


def _filler_pack(pad_id: int) -> dict:
    return {"input_ids": torch.tensor([[pad_id]]), "labels": torch.tensor([[IGNORE_INDEX]]),
            "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32), "num_samples": 0}


def heldout_loader(ctx: RunContext, bundle: ModelBundle, *, bad_records=None):
    """The eval split packed in file order for this rank, or None without an eval split; ConfigError
    when no record of it is usable."""
    return build_eval_dataloader(ctx.cfg.data, bundle.processor, dp_rank=getattr(bundle.dims, "dp_rank", ctx.env.rank),
                                 dp_size=bundle.dims.dp_size, mode="packs", bad_records=bad_records)


@torch.no_grad()
def heldout_loss(ctx: RunContext, bundle: ModelBundle, *, bad_records=None, max_batches: int = 0,
                 loader=None) -> Optional[dict]:
    """{"loss", "perplexity", "tokens"} over the eval split (at most `max_batches` packs per rank,
    0 = all), or None without an eval split or trained tokens. `loader`: the split's loader from
    `heldout_loader` (built here when not given)."""
    if loader is None:
        loader = heldout_loader(ctx, bundle, bad_records=bad_records)
    if loader is None:
        return None
    nll = tok = 0.0
    bundle.wrapper.eval()
    for i, pack in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        real = int(pack.get("num_samples", 1)) > 0
        logp = bundle.wrapper(ctx.to_device(pack if real else _filler_pack(bundle.processor.pad_token_id)))
        if real:
            nll += float(-logp.double().sum())
            tok += float(logp.numel())
    bundle.wrapper.train()
    # the tp / cp ranks of a group evaluate the same packs: count each once
    nll, tok = (v / bundle.dims.data_copies for v in all_reduce_sum([nll, tok], ctx.device))
    if tok == 0:
        return None
    loss = nll / tok
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tok}
