"""Avg@k / pass@k accuracy (megatron_vlm.eval.accuracy): hand-computed values, the unbiased pass@k
estimator against brute-force enumeration, and scoring through the reward verifiers.
(Lives under tests/unit/rl because the eval package's accuracy is the GRPO reward verifiers.)"""
import itertools

import pytest

from megatron_vlm.eval.accuracy import avg_at_k, pass_at_k, score_accuracy
from megatron_vlm.rl.rewards.config import FormatRewardConfig, MathRewardConfig
from megatron_vlm.rl.rewards.manager import RewardManager


def test_avg_at_k_by_hand():
    assert avg_at_k([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]) == pytest.approx(3 / 8)
    assert avg_at_k([[0.6], [0.4]], threshold=0.5) == 0.5
    with pytest.raises(ValueError, match="no prompts"):
        avg_at_k([])


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 4), (4, 4, 2), (7, 1, 7)])
def test_pass_at_k_matches_enumeration(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="n=3, c=4"):
        pass_at_k(3, 4, 1)


def test_score_accuracy_with_verifiers():
    completions = [
        [r"\boxed{4}", r"\boxed{5}", r"the answer is 4"],
        [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{2}"],
    ]
    with RewardManager([MathRewardConfig(), FormatRewardConfig(weight=0.1)], timeout_s=10, num_workers=1) as m:
        res = score_accuracy(m, completions, ["4", "1/2"], label="math")
        assert res.scores == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
        assert res.avg_at_k == pytest.approx(4 / 6)
        assert res.pass_at_k == 1.0 and res.k == 3 and res.num_prompts == 2
        assert res.per_prompt == pytest.approx([2 / 3, 2 / 3])
        assert res.metrics()["eval/avg@3"] == pytest.approx(4 / 6)
        with pytest.raises(ValueError, match=r"completions\[1\]: 1 samples, expected k = 3"):
            score_accuracy(m, [["a", "b", "c"], ["a"]], ["1", "2"], label="math")
        with pytest.raises(ValueError, match="answers: 1 entries for 2 prompts"):
            score_accuracy(m, completions, ["4"], label="math")
