"""`reasoning_end` on the answer verifiers: only the text after the reasoning's last closing delimiter is scored
(as TRL's `reasoning_accuracy_reward` does with its `reasoning_delimiters`), a completion that never closes its
reasoning scores 0 and is counted, and the held-out evaluation scores a completion as the GRPO rounds do."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_vlm.config import load_config
from megatron_vlm.config.eval_section import BenchmarkConfig, EvalConfig
from megatron_vlm.errors import ConfigError
from megatron_vlm.eval.accuracy import score_accuracy
from megatron_vlm.eval.answer_accuracy import GeneratedAnswers
from megatron_vlm.eval.benchmark_eval import VerifierScorer
from megatron_vlm.eval.report import results_table
from megatron_vlm.rl.rewards.combined import CombinedRewards
from megatron_vlm.rl.rewards.config import (
    ChoiceRewardConfig,
    CustomRewardConfig,
    ExactMatchRewardConfig,
    MathRewardConfig,
    reward_from_dict,
)
from megatron_vlm.rl.rewards.manager import RewardManager, after_reasoning
from megatron_vlm.training.running_totals import CUMULATIVE_METRICS

DEMO = Path(__file__).resolve().parents[3] / "launch" / "configs" / "demo_math_grpo.toml"
THINK = "</think>"
# a boxed guess inside the reasoning, the real answer after it
GUESS_THEN_ANSWER = r"<think> maybe \boxed{5} ... </think> The answer is 7"
UNCLOSED = r"<think> so the answer is \boxed{7}"  # cut at max_new_tokens: the reasoning never closed


@pytest.fixture(scope="module")
def manager():
    rewards = [
        MathRewardConfig(name="whole"),
        MathRewardConfig(name="after", reasoning_end=THINK),
        ChoiceRewardConfig(name="choice", reasoning_end=THINK),
        ExactMatchRewardConfig(name="exact", reasoning_end=THINK),
        CustomRewardConfig(name="custom", function="tests.unit.rl.rl_reward_fns_for_tests.length_bonus",
                           reasoning_end=THINK),
    ]
    with RewardManager(rewards, timeout_s=10, num_workers=1) as m:
        yield m


def test_after_reasoning_takes_the_text_after_the_last_delimiter():
    assert after_reasoning("a </think> b </think> c", THINK) == " c"
    assert after_reasoning("<think> x </think>", THINK) == ""
    assert after_reasoning("<think> x", THINK) is None
    assert after_reasoning("no reasoning at all", "") == "no reasoning at all"


def test_a_boxed_guess_in_the_reasoning_is_not_the_answer(manager):
    batch = manager.score([GUESS_THEN_ANSWER, GUESS_THEN_ANSWER], ["7", "5"], only=["whole", "after"])
    assert batch.per_reward["whole"] == [0.0, 1.0]  # the whole completion: the boxed 5 in the reasoning is taken
    assert batch.per_reward["after"] == [1.0, 0.0]  # after </think>: 7
    assert batch.unclosed == 0


def test_every_answer_verifier_reads_only_the_answer(manager):
    choice = "<think> A looks right ... no. </think> The answer is (B)"
    exact = "<think> Answer: Paris </think> Answer: Rome"
    batch = manager.score([choice, exact], ["B", "Rome"], ["A. 1\nB. 2", ""], only=["choice", "exact"])
    assert batch.per_reward["choice"][0] == 1.0 and batch.per_reward["exact"][1] == 1.0
    # the custom function (its value: the completion's length / 10, at most 1) is handed only the text after it
    batch = manager.score(["<think> long reasoning here </think>123"], ["x"], only=["custom"])
    assert batch.per_reward["custom"] == [pytest.approx(0.3)]


def test_an_unclosed_reasoning_scores_0_and_is_counted(manager):
    before = manager.metrics()
    batch = manager.score([UNCLOSED, GUESS_THEN_ANSWER], ["7", "7"], only=["whole", "after", "custom"])
    assert batch.per_reward["whole"] == [1.0, 0.0]
    assert batch.per_reward["after"] == [0.0, 1.0]
    assert batch.per_reward["custom"][0] == 0.0  # not called: its length bonus would be > 0
    assert batch.unclosed == 2 and batch.errors == 0 and batch.timeouts == 0
    after = manager.metrics()
    assert after["reward/reasoning_unclosed"] - before["reward/reasoning_unclosed"] == 2
    assert after["reward/calls"] - before["reward/calls"] == 6  # each (reward, completion) scored, called or not
    assert after["reward/errors"] == before["reward/errors"]  # not a failure: the failure watch does not count it
    assert "reward/reasoning_unclosed" in CUMULATIVE_METRICS  # continues across a resume


def test_the_held_out_evaluation_scores_as_the_rounds_do(manager):
    """The rounds score through `score` (rl/rounds.py, the asynchronous rollout ranks alike); the held-out
    evaluation through `score_accuracy`; a run with reward models through `CombinedRewards`. Same values."""
    completions = [GUESS_THEN_ANSWER, UNCLOSED, "<think> 7? </think> \\boxed{7}", "\\boxed{7}"]
    answers = ["7"] * len(completions)
    train = manager.score(completions, answers).per_reward["after"]
    assert train == [1.0, 0.0, 1.0, 0.0]
    acc = score_accuracy(manager, [completions], ["7"], label="after")
    assert acc.scores == [train] and acc.unclosed == 2
    with CombinedRewards([MathRewardConfig(reasoning_end=THINK)], pool={"timeout_s": 10, "num_workers": 1}) as c:
        batch = c.score(completions, answers)
        assert batch.per_reward["math"] == train and batch.unclosed == 2
        assert c.metrics()["reward/reasoning_unclosed"] == 2


def test_benchmark_evaluation_with_eval_reasoning_end_scores_as_training(manager):
    """launch/evaluate.py's verifiers are built by the scorer, not from [[rl.rewards]]: `eval.reasoning_end`."""
    completions = [GUESS_THEN_ANSWER, UNCLOSED, "<think> 7? </think> \\boxed{7}"]
    train = manager.score(completions, ["7"] * 3).per_reward["after"]
    scorer = VerifierScorer(EvalConfig(reasoning_end=THINK, reward_workers=1))
    try:
        rows = [GeneratedAnswers(0, "7", {"verifier": "math", "answer": "7"}, completions),
                GeneratedAnswers(1, "red", {"verifier": "short_answer"}, ["<think> blue? </think> red", "<think> red"])]
        assert scorer.score(rows) == [train, [1.0, 0.0]]
        assert scorer.failures == {"timeouts": 0, "errors": 0, "reasoning_unclosed": 2}
    finally:
        scorer.close()
    with pytest.raises(ValueError, match="reasoning_end: no leading or trailing whitespace"):
        EvalConfig(reasoning_end=" </think>", benchmarks=[BenchmarkConfig(name="b", path="b.jsonl")]).validate()
    bad = {"num_bad_records": 0, "by_category": {}, "records": []}
    r = {"name": "X", "num_rows": 2, "metrics": {"num_scored": 2, "greedy_accuracy": 0.5}, "bad_records": bad,
         "verifier_failures": {"timeouts": 0, "errors": 0, "reasoning_unclosed": 3}}
    assert "X: verifier timeouts 0, errors 0, reasoning never closed 3 (each scored 0)" in results_table([r], {"greedy": True})


def test_config_accepts_the_key_where_it_works():
    cfg = load_config(DEMO, [f'rl.rewards[0].reasoning_end="{THINK}"'])
    assert cfg.rl.rewards[0].reasoning_end == THINK
    assert load_config(DEMO).rl.rewards[0].reasoning_end == ""  # off by default: the whole completion


@pytest.mark.parametrize("kind", ["format", "model", "judge"])
def test_config_refuses_the_key_where_it_cannot_work(kind, tmp_path):
    """format reads the reasoning block itself (think_end); model rewards score the whole completion."""
    table = {"type": kind, "reasoning_end": THINK}
    if kind != "format":
        table["path"] = "folder"
    with pytest.raises(ValueError, match=r"rl.rewards\[0\].reasoning_end: unknown key"):
        reward_from_dict(table)
    text = DEMO.read_text()
    old = "type = \"math\"\nfallback_last_number = true"
    assert old in text
    path = tmp_path / "c.toml"
    path.write_text(text.replace(old, "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in table.items())))
    with pytest.raises(ConfigError, match=r"^rl.rewards\[0\].reasoning_end: unknown key"):
        load_config(path)


@pytest.mark.parametrize("value", ["</think> ", "\n</think>", " "])
def test_config_refuses_whitespace_around_the_delimiter(value):
    with pytest.raises(ValueError, match=r"rl.rewards\[0\].reasoning_end: no leading or trailing whitespace"):
        reward_from_dict({"type": "math", "reasoning_end": value})
