"""`answer_tag` on the choice and exact-match verifiers, as the math verifier has it: a completion that puts its
answer in an <answer> block and writes more after it (a check, a note) is scored on the block, not on its last line;
without a block the usual extraction applies; a tag spelled with brackets or an exact match that compares the whole
completion are refused."""
from __future__ import annotations

import pytest

from megatron_vlm.rl.rewards.config import ChoiceRewardConfig, ExactMatchRewardConfig, MathRewardConfig
from megatron_vlm.rl.rewards.verifiers import choice_reward, exact_match_reward

PROMPT = "Which colour is the sky?\nA. green\nB. blue\nC. red"


def test_choice_reads_the_answer_block_before_a_trailing_line():
    completion = "<answer>B</answer>\nDouble-checked against option C"
    assert choice_reward(completion, "B", prompt=PROMPT, answer_tag="answer") == 1.0
    assert choice_reward(completion, "B", prompt=PROMPT) == 0.0  # the last line names C: not the answer given
    assert choice_reward("I pick B", "B", prompt=PROMPT, answer_tag="answer") == choice_reward("I pick B", "B", prompt=PROMPT)


def test_exact_match_reads_the_answer_block():
    completion = "<answer>Paris</answer>\n(I am fairly sure.)"
    assert exact_match_reward(completion, "Paris", answer_tag="answer") == 1.0
    assert exact_match_reward(completion, "Paris") == 0.0
    assert exact_match_reward("<answer>Lyon</answer>\nParis", "Paris", answer_tag="answer") == 0.0


@pytest.mark.parametrize("cls", [ChoiceRewardConfig, ExactMatchRewardConfig, MathRewardConfig])
def test_a_bracketed_tag_is_refused(cls):
    with pytest.raises(ValueError, match="answer_tag"):
        cls(answer_tag="<answer>").validate()
    cls(answer_tag="answer").validate()


def test_exact_match_on_the_whole_completion_refuses_a_tag():
    with pytest.raises(ValueError, match="answer_tag: reads the extracted answer"):
        ExactMatchRewardConfig(answer_tag="answer", extract=False).validate()
