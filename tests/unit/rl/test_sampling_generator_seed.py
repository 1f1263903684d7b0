"""Every seed the config accepts (train.seed in [0, 2**32 - 1]) seeds the sampling generator of a generation call:
above ~3.6e7 the mixed (seed, step, rank, salt) value passed 2**63 and torch.Generator.manual_seed raised
"Overflow when unpacking long long" at the first rollout / sampled evaluation, after the model had loaded."""
from __future__ import annotations

import torch

from megatron_vlm.inference.generators import sampling_generator


def _draw(seed: int, step: int, rank: int = 0) -> torch.Tensor:
    return torch.rand(4, generator=sampling_generator(seed, step, rank, torch.device("cpu"), salt=7))


def test_every_accepted_seed_seeds_a_generator():
    for seed in (0, 1, 40_000_000, 2**32 - 1):
        assert not torch.equal(_draw(seed, 1), _draw(seed, 2))  # one stream per step
        assert torch.equal(_draw(seed, 3, rank=5), _draw(seed, 3, rank=5))  # a pure function of its inputs


def test_small_seeds_draw_what_they_drew_before():
    """Seeds whose mixed value fits are unchanged (a resumed run of an earlier version draws the same tokens)."""
    g = torch.Generator().manual_seed(((3 * 1_000_003 + 9) * 8191 + 2) * 31 + 7)
    assert torch.equal(_draw(3, 9, rank=2), torch.rand(4, generator=g))
