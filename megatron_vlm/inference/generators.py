"""The random generator of one generation call, a pure function of (seed, step, rank, salt).

Why a function of those four and not a shared stream: a resumed run, another rank count's rank r, a
rollout rank of asynchronous GRPO and the held-out evaluation must draw the same tokens as the run they
repeat, whatever ran before them on this process.
"""
from __future__ import annotations

import torch

__all__ = ["sampling_generator"]


def sampling_generator(seed: int, step: int, rank: int, device: torch.device, salt: int = 0) -> torch.Generator:
    """A generator on `device` seeded from (seed, step, rank, salt). The mixed value is taken modulo 2**63 - 1:
    manual_seed takes a 64-bit integer, which a train.seed above ~3.6e7 passed (values below are unchanged)."""
    g = torch.Generator(device=device)
    g.manual_seed((((seed * 1_000_003 + step) * 8191 + rank) * 31 + salt) % (2**63 - 1))
    return g
