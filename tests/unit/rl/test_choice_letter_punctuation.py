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


IMAGE_CHOICES = {"choices": ["<image 2>", "<image 3>", "<image 4>", "<image 5>"]}  # MMMU: each option is a picture


@pytest.mark.parametrize("completion", ["B. The second shape", "The answer is B, the triangle.", "(B) the red one",
                                        "B", "Answer: B"])
def test_a_letter_then_words_about_a_picture_option_chooses_it(completion):
    """An option that is a picture ("<image 3>", shown at its place in the prompt) has no text a completion could
    repeat: the words after the letter describe the picture, as MMMU's own answer parser reads "B. <words>" as B."""
    assert choice_reward(completion, "B", metadata=IMAGE_CHOICES) == 1.0
    assert choice_reward(completion, "A", metadata=IMAGE_CHOICES) == 0.0


def test_text_options_still_compare_the_words_after_the_letter():
    assert choice_reward("B. The second shape", "B", metadata=CHOICES) == 0.0
    assert choice_reward("B. 42", "B", metadata=CHOICES) == 1.0
