"""The rotary's layout check (`_broadcasts_to`, plain Python because it runs for every call) agrees with
`torch.broadcast_shapes(shape, target) == target` on random shapes with 0 / 1 / other sizes and
ranks, and a cos / sin that does not fit x is still refused with the same error."""
import random

import pytest
import torch

from kernels.reference.rotary import _broadcasts_to, apply_rotary


def _torch_says(shape, target) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        return False


def test_broadcasts_to_equals_torch_broadcast_shapes():
    rng = random.Random(0)
    sizes = [0, 1, 1, 2, 3]
    for _ in range(3000):
        target = tuple(rng.choice(sizes) for _ in range(rng.randint(0, 4)))
        shape = tuple(rng.choice(sizes) for _ in range(rng.randint(0, 5)))
        assert _broadcasts_to(shape, target) == _torch_says(shape, target), (shape, target)


def test_bad_cos_shape_is_refused():
    x = torch.randn(2, 5, 3, 8)
    with pytest.raises(ValueError, match="do not broadcast"):
        apply_rotary(x, torch.randn(2, 4, 8), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="do not broadcast"):
        apply_rotary(x, torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8))
