"""A verifier that times out or fails scores 0 and is counted in the results (docs/evaluation.md):
the count must reach the benchmark's results, once per data-parallel shard."""
from __future__ import annotations

from megatron_vlm.config.eval_section import EvalConfig
from megatron_vlm.eval.answer_accuracy import GeneratedAnswers
from megatron_vlm.eval.benchmark_eval import VerifierScorer, merge_verifier_failures
from megatron_vlm.rl.rewards.manager import RewardBatch


class _Manager:
    """Stands in for the reward worker pool: the first completion timed out, the second raised."""

    def score(self, flat, answers, prompts, metas, only):
        n = len(flat)
        return RewardBatch(total=[0.0] * n, per_reward={only[0]: [0.0, 0.0] + [1.0] * (n - 2)}, timeouts=1, errors=1)

    def close(self):
        pass


def test_scorer_counts_timeouts_and_errors():
    scorer = VerifierScorer(EvalConfig())
    scorer.manager = _Manager()  # type: ignore[assignment]
    rows = [GeneratedAnswers(i, "3", {"verifier": "math", "answer": "3"}, [r"\boxed{3}"]) for i in range(3)]
    rows.append(GeneratedAnswers(3, "red", {"verifier": "short_answer"}, ["red"]))
    assert scorer.score(rows) == [[0.0], [0.0], [1.0], [1.0]]
    assert scorer.failures == {"timeouts": 1, "errors": 1, "reasoning_unclosed": 0}
    scorer.score(rows[:3])
    assert scorer.failures == {"timeouts": 2, "errors": 2, "reasoning_unclosed": 0}


def test_failures_merged_once_per_data_parallel_shard():
    # ranks 0, 1 are the tp pair of shard 0 (they scored the same rows), rank 2 alone holds shard 1
    parts = [(0, {"timeouts": 2, "errors": 0}), (0, {"timeouts": 2, "errors": 0}), (1, {"timeouts": 1, "errors": 3})]
    assert merge_verifier_failures(parts) == {"timeouts": 3, "errors": 3, "reasoning_unclosed": 0}


def test_failures_listed_in_the_table():
    from megatron_vlm.eval.report import results_table
    bad = {"num_bad_records": 0, "by_category": {}, "records": []}
    r = {"name": "X", "num_rows": 2, "metrics": {"num_scored": 2, "greedy_accuracy": 0.5}, "bad_records": bad,
         "verifier_failures": {"timeouts": 1, "errors": 0}}
    assert "X: verifier timeouts 1, errors 0 (each scored 0)" in results_table([r], {"greedy": True})
