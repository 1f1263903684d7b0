"""The multiple-choice verifier reads a letter followed by a comma or semicolon ("B, because ...", "The answer is
B, 42") as that option, as it reads "B." / "B:" / "B)"; a letter that only starts a list of letters or prose about
other options ("B, C and D are wrong, A is right") selects nothing, and a final-answer phrase still wins over an
earlier line."""
from __future__ import annotations

import pytest

from megatron_vlm.rl.rewards.verifiers import choice_reward

CHOICES = {"choices": ["12", "42", "7", "9"]}  # A. 12  B. 42  C. 7  D. 9

# (completion, the option it selects; None = no option)
CASES = [
    # a letter, then a comma / semicolon, then a reason or the option's own text: that option
    ("B, because the area is 6 times 7", "B"),
    ("B, since the other options are too small", "B"),
    ("The answer is B, 42", "B"),
    ("Answer: B, 42.", "B"),
    ("B; 42", "B"),
    ("B,", "B"),
    ("(B), because the area is 42", "B"),
    ("Option B, because the area is 42", "B"),
    ("B, 42, because the area is 6 times 7", "B"),
    ("B: because the area is 42", "B"),
    ("B. Because the area is 42", "B"),
    # the forms accepted before stay accepted
    ("B. 42", "B"),
    ("B: 42", "B"),
    ("Answer: B) 42", "B"),
    ("The answer is B, because 6 times 7 is 42", "B"),
    # a letter in prose, a list of letters, or a letter whose text disagrees: nothing
    ("B, C and D are wrong, A is right", None),
    ("B, C", None),
    ("B; C", None),
    ("A, B", None),
    ("B, 40", None),
    ("B, as well as C, is too small", None),
    ("B, or maybe C", None),
    # precedence: the final-answer phrase after the prose wins
    ("B, C and D are wrong. The answer is A.", "A"),
    ("B, because it looks right.\nOn second thought, the answer is C, 7", "C"),
]


@pytest.mark.parametrize("completion, selected", CASES)
def test_letter_then_comma_or_semicolon(completion, selected):
    scores = {letter: choice_reward(completion, letter, metadata=CHOICES) for letter in "ABCD"}
    assert scores == {letter: float(letter == selected) for letter in "ABCD"}
