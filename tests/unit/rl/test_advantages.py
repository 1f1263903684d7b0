"""Group-relative advantages against a hand-written per-group reference (Python floats,
statistics module), including std normalisation, equal-reward group dropping and bad input; the
dr_grpo and rloo estimators against their papers' definitions (Dr. GRPO: the group mean-centred
reward; RLOO: the reward minus the mean of the other G - 1, = G / (G - 1) x the mean-centred reward);
DAPO's overlong penalty at the edges of its buffer."""
import math
import statistics

import pytest
import torch

from megatron_vlm.rl.advantages import advantage_stats, compute_group_advantages, overlong_penalty


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


REWARDS = [1.0, 0.0, 0.0, 1.0,   0.5, 0.5, 0.5, 0.5,   0.0, 0.0, 0.0, 1.0,   2.0, -1.0, 0.25, 3.5]


@pytest.mark.parametrize("g", [2, 4])
def test_dr_grpo_is_the_group_mean_centred_reward(g):
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    res = compute_group_advantages(rewards, g, estimator="dr_grpo")
    expected = []
    for p in range(len(REWARDS) // g):
        grp = REWARDS[p * g:(p + 1) * g]
        expected += [r - sum(grp) / g for r in grp]
    assert res.advantages.dtype == torch.float64
    torch.testing.assert_close(res.advantages, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)
    # the same as grpo without the std division, and different from grpo with it
    torch.testing.assert_close(res.advantages, compute_group_advantages(rewards, g, normalize_std=False).advantages)
    assert not torch.allclose(res.advantages, compute_group_advantages(rewards, g).advantages)


@pytest.mark.parametrize("g", [2, 4, 8])
def test_rloo_is_leave_one_out_and_g_over_g_minus_1_times_dr_grpo(g):
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    res = compute_group_advantages(rewards, g, estimator="rloo")
    expected = []
    for p in range(len(REWARDS) // g):
        grp = REWARDS[p * g:(p + 1) * g]
        for i, r in enumerate(grp):
            others = grp[:i] + grp[i + 1:]
            expected.append(r - sum(others) / (g - 1))
    torch.testing.assert_close(res.advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=1e-14)
    dr = compute_group_advantages(rewards, g, estimator="dr_grpo").advantages
    torch.testing.assert_close(res.advantages, g / (g - 1) * dr, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_zero_variance_groups_are_counted_and_dropped_by_every_estimator(estimator):
    res = compute_group_advantages(torch.tensor(REWARDS), 4, estimator=estimator, drop_equal_reward_groups=True)
    assert res.zero_variance.tolist() == [False, True, False, False]
    assert res.keep.tolist() == [True] * 4 + [False] * 4 + [True] * 8 and res.num_dropped_groups == 1
    assert (res.advantages[4:8] == 0).all()


def test_std_division_is_refused_for_dr_grpo_and_rloo():
    for est in ("dr_grpo", "rloo"):
        with pytest.raises(ValueError, match="normalize_adv_std"):
            compute_group_advantages(torch.tensor(REWARDS), 4, estimator=est, normalize_std=True)
    with pytest.raises(ValueError, match="advantage"):
        compute_group_advantages(torch.tensor(REWARDS), 4, estimator="ppo")


def _dapo_length_reward(n, l_max, l_cache):
    """DAPO (Yu et al. 2025) eq. 13, as written: 0 / linear / -1."""
    if n <= l_max - l_cache:
        return 0.0
    if n <= l_max:
        return ((l_max - l_cache) - n) / l_cache
    return -1.0


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_overlong_penalty_at_the_buffer_edges(penalty):
    l_max, buf = 20, 5
    lengths = [1, 14, 15, 16, 18, 19, 20]
    got = overlong_penalty(lengths, l_max, buf, penalty)
    assert got == pytest.approx([penalty * _dapo_length_reward(n, l_max, buf) for n in lengths], abs=0)
    # edges: nothing at the start of the buffer, -penalty / buffer one token into it, -penalty at max_new_tokens
    assert got[2] == 0.0 and got[3] == pytest.approx(-penalty / buf) and got[-1] == pytest.approx(-penalty)
    assert overlong_penalty([25], l_max, buf, penalty) == [-penalty]  # DAPO's -1 beyond L_max (not reachable here)
    assert overlong_penalty([1, 2], 2, 1, 1.0) == [0.0, -1.0]  # buffer of one token
    for bad in (0, 20):
        with pytest.raises(ValueError, match="overlong_buffer"):
            overlong_penalty([1], l_max, bad, 1.0)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("value", [0.2, 0.9, 0.3, 1 / 3, 0.7])
@pytest.mark.parametrize("g", [3, 4, 6, 8, 16])
def test_identical_fractional_rewards_give_exactly_zero(estimator, value, g):
    """G equal rewards that floats cannot average exactly (8 x 0.2: the mean lands an ulp off) still give
    advantage 0, not rounding noise divided by a rounding-noise std (grpo gave -0.0147 for 8 x 0.2)."""
    rewards = torch.tensor([value] * g + [0.0, 1.0] + [0.5] * (g - 2))
    out = compute_group_advantages(rewards, g, estimator=estimator)
    assert torch.equal(out.advantages[:g], torch.zeros(g))
    assert out.advantages[g:].abs().max() > 0.1  # the informative group is untouched
    assert out.zero_variance.tolist() == [True, False]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_invalid_samples_are_left_out_of_their_group(estimator):
    """`valid`: a group's advantages are those of its valid members alone (the same estimator on the shorter group),
    0 for the invalid ones; a group left with fewer than 2 has no signal (zeros, no NaN, zero variance)."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 7.0,   2.0, 9.0, 9.0, 9.0,   9.0, 9.0, 9.0, 9.0,   1.0, 0.0, 1.0, 0.0])
    valid = torch.tensor([1, 1, 1, 0,   1, 0, 0, 0,   0, 0, 0, 0,   1, 1, 1, 1], dtype=torch.bool)
    res = compute_group_advantages(rewards, 4, estimator=estimator, valid=valid, drop_equal_reward_groups=True)
    alone = compute_group_advantages(torch.tensor([1.0, 0.0, 0.5]), 3, estimator=estimator).advantages
    whole = compute_group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, estimator=estimator).advantages
    torch.testing.assert_close(res.advantages, torch.cat([alone, torch.zeros(9), whole]))
    assert res.zero_variance.tolist() == [False, True, True, False] and res.num_dropped_groups == 2
    assert res.keep.view(4, 4)[:, 0].tolist() == [True, False, False, True]
