"""Group-relative advantages against a hand-written per-group reference (Python floats,
statistics module), including std normalisation, equal-reward group dropping and bad input."""
import math
import statistics

import pytest
import torch

from megatron_vlm.rl.advantages import advantage_stats, compute_group_advantages


def _reference(rewards, g, normalize_std, drop_equal, eps=1e-6):
    out, keep = [], []
    for p in range(len(rewards) // g):
        grp = rewards[p * g:(p + 1) * g]
        mean = sum(grp) / g
        std = statistics.stdev(grp)  # sample std (n - 1)
        equal = max(grp) - min(grp) <= 1e-6
        for r in grp:
            a = (r - mean) / (std + eps) if normalize_std else r - mean
            if drop_equal and equal:
                a = 0.0
            out.append(a)
            keep.append(not (drop_equal and equal))
    return out, keep


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("drop_equal", [True, False])
def test_matches_reference(normalize_std, drop_equal):
    g = 4
    rewards = [1.0, 0.0, 0.0, 1.0,   0.5, 0.5, 0.5, 0.5,   0.0, 0.0, 0.0, 1.0,   2.0, -1.0, 0.25, 3.5]
    res = compute_group_advantages(torch.tensor(rewards), g, normalize_std=normalize_std, drop_equal_reward_groups=drop_equal)
    ref, keep = _reference(rewards, g, normalize_std, drop_equal)
    torch.testing.assert_close(res.advantages, torch.tensor(ref), rtol=1e-6, atol=1e-6)
    assert res.keep.tolist() == keep
    assert res.num_dropped_groups == (1 if drop_equal else 0)
    assert res.group_mean.tolist() == pytest.approx([0.5, 0.5, 0.25, 1.1875])
    # a correct answer among wrong ones gets a positive advantage, wrong ones negative
    assert res.advantages[11] > 0 > res.advantages[8]


def test_known_values_for_binary_rewards():
    # one correct of four: mean 0.25, sample std sqrt(0.25) = 0.5 -> advantages 1.5 and -0.5
    res = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=0.0)
    torch.testing.assert_close(res.advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_equal_groups_are_zero_without_dropping_and_no_nan():
    res = compute_group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2)
    assert torch.equal(res.advantages, torch.zeros(4)) and res.keep.all()


def test_dtype_and_stats():
    res = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.bfloat16), 2)
    assert res.advantages.dtype == torch.float32
    st = advantage_stats(res.advantages, res.keep)
    assert st["advantage/mean"] == pytest.approx(0.0, abs=1e-6)
    assert st["advantage/max"] == pytest.approx(1 / math.sqrt(2), rel=1e-4)
    assert advantage_stats(torch.zeros(2), torch.zeros(2, dtype=torch.bool))["advantage/std"] == 0.0


@pytest.mark.parametrize(
    "rewards, g, msg",
    [
        (torch.ones(5), 2, "multiple of group_size"),
        (torch.ones(2, 2), 2, "flat"),
        (torch.ones(4), 1, "group_size"),
        (torch.tensor([0.0, float("nan"), 1.0, 1.0]), 2, r"sample index \[1\]"),
    ],
)
def test_bad_input(rewards, g, msg):
    with pytest.raises(ValueError, match=msg):
        compute_group_advantages(rewards, g)
