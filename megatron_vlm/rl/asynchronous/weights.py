"""Weight push of asynchronous GRPO: the trainer's current weights into the rollout ranks' models.

Why tensor by tensor: a full state dict staged in host memory is a second model (6 GiB for a 3B model
in bf16 on every rollout rank and on the trainer). Here the trainer gathers one (FSDP-sharded)
parameter at a time, training rank 0 broadcasts it over the bridge, and each rollout rank receives it
straight into its own parameter while its engine is paused at a token boundary (`engine.paused()`),
then moves the engine's version: a completion in flight continues with the new weights, its later
tokens record the new version (partial rollout with mixed versions, as AReaL does). Only a tensor
whose dtype or device differs from the wire's needs a buffer of its own size.

The trainer announces each push with a control message {"kind": "weights", "version", "names":
[(name, shape, dtype)]}; the first push after start (or resume) sends every entry of the state
dict, later ones the trainable parameters and the buffers (`trainable_names`).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Optional

import torch

from megatron_vlm.parallel.full_weights import full_tensor
from megatron_vlm.rl.asynchronous.bridge import Bridge

__all__ = ["push_weights", "receive_weights", "trainable_names"]


def trainable_names(model: torch.nn.Module) -> list[str]:
    """The entries a push after a step sends: the trainable parameters and every buffer of the state dict.

    Why the buffers: training moves some of them outside the optimizer (an MoE router's score-correction bias,
    updated by the load balancer after each step, picks the experts the rollout routes through); they are small,
    and `push_weights` skips the names the state dict lacks (non-persistent buffers)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return names + [n for n, _ in model.named_buffers() if n not in names]


def push_weights(model: torch.nn.Module, bridge: Optional[Bridge], version: int, names: Optional[Iterable[str]] = None,
                 extra: Optional[dict] = None) -> float:
    """Every training rank calls this (the gather of a sharded parameter is a collective of the
    training ranks); training rank 0 (`bridge` not None) sends. `names`: the entries to send (None =
    the whole state dict). Returns the seconds it took."""
    t0 = time.perf_counter()
    state = model.state_dict()
    keys = list(state) if names is None else [n for n in names if n in state]
    header = None
    if bridge is not None:
        header = {"kind": "weights", "version": int(version),
                  "names": [(k, tuple(state[k].shape), str(state[k].dtype).removeprefix("torch.")) for k in keys]}
        header.update(extra or {})
        bridge.broadcast_object(header)
    with torch.no_grad():
        for k in keys:
            full = full_tensor(state[k].detach())
            if bridge is None:
                continue
            wire = full.to("cpu").contiguous() if full.device.type != "cpu" or not full.is_contiguous() else full
            bridge.broadcast_tensor_(wire)
    return time.perf_counter() - t0


def receive_weights(model: torch.nn.Module, bridge: Bridge, header: dict, engine=None) -> float:
    """The rollout side of `push_weights`, after its control message `header`: each tensor into
    `model`'s entry of that name (in place), then `engine.load_weights(None, version)`; with `engine`
    the whole receive runs with decoding paused at a token boundary. Returns the seconds it took."""
    t0 = time.perf_counter()
    lock = engine.paused() if engine is not None else contextlib.nullcontext()
    with lock, torch.no_grad():
        # the entries read once decoding is paused: the engine's first call may re-make the q / k / v Parameters
        # (fused into one tensor, models/common/fused_projections.py), and a write into replaced ones would never
        # reach its decode steps
        state = model.state_dict()
        missing = [n for n, _, _ in header["names"] if n not in state]
        if missing:
            raise KeyError(f"weight push: the rollout model has no entries {missing[:5]} (is model.path the trainer's "
                           "model?)")
        for name, shape, dtype in header["names"]:
            target = state[name]
            wire_dtype = getattr(torch, dtype)
            if tuple(target.shape) != tuple(shape):
                raise ValueError(f"weight push: {name} has shape {tuple(shape)} on the trainer, {tuple(target.shape)} here")
            if target.dtype == wire_dtype and target.device.type == "cpu" and target.is_contiguous():
                bridge.broadcast_tensor_(target)
            else:
                buf = torch.empty(shape, dtype=wire_dtype)
                bridge.broadcast_tensor_(buf)
                target.copy_(buf)
        if engine is not None:
            engine.load_weights(None, version=header["version"])
    return time.perf_counter() - t0

