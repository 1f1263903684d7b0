"""Built-in verifiers on a table of cases: answer extraction, LaTeX fractions, radicals, powers,
units, degrees, percentages, tuples / sets, multiple choice (letters and option texts), format,
exact match and malformed output. Expected values are the mathematically correct verdicts."""
import pytest

from megatron_vlm.rl.rewards.extract import extract_answer, last_boxed
from megatron_vlm.rl.rewards.latex_math import LatexParseError, parse_latex
from megatron_vlm.rl.rewards.math_equiv import math_equal
from megatron_vlm.rl.rewards.verifiers import (
    choice_reward,
    exact_match_reward,
    format_reward,
    math_reward,
    parse_choices,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the area is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"first \boxed{1}, finally \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),
        (r"\fbox{7}", "7"),
        (r"\boxed 5 is it", "5"),
        (r"The final answer is $3\sqrt{3}$.", r"3\sqrt{3}"),
        ("Therefore, the answer is 12 cm.", "12 cm"),
        ("Answer:\n42", "42"),
        ("**Answer:** (C)", "(C)"),
        (r"bad \boxed{unclosed", None),
        ("no answer here, just 3 and 4", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_options():
    assert extract_answer("it is 3, or maybe 4.5 units", fallback_last_number=True) == "4.5"
    assert extract_answer(r"<answer> \boxed{9} </answer> \boxed{8}", answer_tag="answer") == "9"
    assert extract_answer("<answer>B</answer>", answer_tag="answer") == "B"
    assert extract_answer(r"\boxed{" + "1" * 600 + "}") is None  # over MAX_ANSWER_CHARS
    assert last_boxed(r"\boxed{\left\{ 1 \right\}}") == r"\left\{ 1 \right\}"


MATH_CASES = [
    # fractions
    (r"\frac{40}{3}", r"\frac{40}{3}", True),
    (r"\dfrac{80}{6}", r"\frac{40}{3}", True),
    (r"\frac12", "0.5", True),
    ("13.3333333333", r"\frac{40}{3}", True),
    ("13.33", r"\frac{40}{3}", True),  # rounded to the written places
    ("13.3", r"\frac{40}{3}", False),  # one decimal place is too coarse
    ("13.34", r"\frac{40}{3}", False),
    ("-1/2", r"-\frac{1}{2}", True),
    (r"\frac{3}{4}", r"\frac{4}{3}", False),
    # radicals
    (r"3\sqrt{3}", r"\sqrt{27}", True),
    (r"2\sqrt{221}", r"\sqrt{884}", True),
    (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}", True),
    (r"\sqrt[3]{8}", "2", True),
    ("5.20", r"3\sqrt{3}", True),
    (r"3\sqrt{2}", r"2\sqrt{3}", False),
    # powers, constants, symbols
    (r"2^{10}", "1024", True),
    (r"2\pi", r"\pi \cdot 2", True),
    (r"4\pi", r"2\pi", False),
    ("2x + 2", "2(x+1)", True),
    (r"\sin^2 x + \cos^2 x", "1", True),
    (r"x^2 - 1", "(x-1)(x+1)", True),
    ("x^2 + 1", "(x+1)^2", False),
    # units, degrees, percentages, thousands, equations
    (r"60^\circ", "60", True),
    (r"60^{\circ}", r"\frac{\pi}{3}", False),
    (r"5 \text{ cm}", "5", True),
    ("12 square units", "12", True),
    (r"7\mathrm{cm}^2", "7", True),
    (r"50\%", "0.5", True),
    (r"50\%", "50", True),
    ("0.25", r"25\%", True),
    ("1,000", "1000", True),
    ("x = 5", "5", True),
    (r"\$12", "12", True),
    # tuples, intervals, sets
    ("(1, 2)", "(1,2)", True),
    ("(1, 2)", "(2, 1)", False),
    ("(1, 2]", "(1, 2)", False),
    (r"\{1, 2\}", r"\{2, 1\}", True),
    ("3, 1, 2", "1, 2, 3", True),
    ("1, 2", "1, 2, 3", False),
    # text answers and the gold's own \boxed
    ("Yes", "yes", True),
    (r"\text{No}", "no", True),
    ("4", r"\boxed{4}", True),
    (r"\infty", r"\infty", True),
    (r"\infty", "1000000", False),
    ("6", "7", False),
    # malformed predictions
    ("", "3", False),
    (r"\frac{1}{0}", "1", False),
    (r"\frac{1", "1", False),
    ("((((", "1", False),
    ("3 +", "3", False),
]


@pytest.mark.parametrize("pred, gold, expected", MATH_CASES)
def test_math_equal_table(pred, gold, expected):
    assert math_equal(pred, gold) is expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"<think>area = 1/2 * 6 * 8</think> The area is \boxed{24}.", "24", 1.0),
        (r"<think>...</think> \boxed{24.0}", "24", 1.0),
        (r"The final answer is $\frac{40}{3}$.", r"\frac{40}{3}", 1.0),
        ("The answer is 24", "24", 1.0),
        ("24", "24", 0.0),  # no stated final answer
        (r"\boxed{25}", "24", 0.0),
        (r"\boxed{24", "24", 0.0),
        ("I don't know", "24", 0.0),
        (r"\boxed{\text{C}}", r"\boxed{C}", 1.0),  # ViRL39K stores boxed answers
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_math_reward_options():
    assert math_reward("so it is 24 apples", "24") == 0.0
    assert math_reward("so it is 24 apples", "24", fallback_last_number=True) == 1.0
    assert math_reward("<answer>24</answer>", "24", answer_tag="answer") == 1.0
    assert math_reward(r"\boxed{24.001}", "24", rel_tol=1e-3) == 1.0
    assert math_reward(r"\boxed{24.1}", "24", rel_tol=1e-3) == 0.0


PROMPT = "Find the length of AB.\nChoices:\nA. 3 cm\nB. 5 cm\n(C) 7 cm\nD: 9 cm"


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("The answer is (B).", "B", 1.0),
        (r"\boxed{B}", "B", 1.0),
        (r"\boxed{\text{B}}", "B", 1.0),
        ("Answer: (b)", "B", 1.0),
        ("Option B", "B", 1.0),
        ("<think>..</think>\nB", "B", 1.0),
        (r"\boxed{5 cm}", "B", 1.0),  # option text
        ("Answer: B. 5 cm", "B", 1.0),
        ("Answer: B. 7 cm", "B", 0.0),  # letter and text disagree
        ("Answer: C", "B", 0.0),
        (r"\boxed{7 cm}", "B", 0.0),
        (r"\boxed{B}", "5 cm", 1.0),  # reference given as option text
        (r"\boxed{C}", "7 cm", 1.0),
        ("I think it is long", "B", 0.0),
        ("<think>..</think>\nA triangle has three sides.", "A", 0.0),  # the article "A" is not a choice
        ("Answer: A", "A", 1.0),
        ("Answer: B) 5 cm", "B", 1.0),
        ("choice (c)", "C", 1.0),
        ("", "B", 0.0),
    ],
)
def test_choice_reward(completion, answer, expected):
    assert choice_reward(completion, answer, prompt=PROMPT) == expected


def test_choices_from_metadata_and_inline():
    meta = {"choices": ["red", "green", "blue"]}
    assert choice_reward(r"\boxed{C}", "blue", metadata=meta) == 1.0
    assert choice_reward(r"\boxed{green}", "B", metadata=meta) == 1.0
    assert choice_reward(r"\boxed{D}", "B", metadata=meta) == 0.0
    assert parse_choices("Pick one: A. 12 B. 15 C. 18 D. 21", "ABCD") == {"A": "12", "B": "15", "C": "18", "D": "21"}
    assert choice_reward("Answer: 18", "C", prompt="Pick one: A. 12 B. 15 C. 18 D. 21") == 1.0
    # no options at all: compare the texts
    assert choice_reward(r"\boxed{yes}", "Yes") == 1.0


@pytest.mark.parametrize("prompt", [
    "Options: A: red, B: blue, C: green",
    "Options: A. red; B. blue; C. green.",
    "(A) red, (B) blue, or (C) green",
    "Pick one: A) red, B) blue and C) green",
])
def test_inline_options_lose_their_separators(prompt):
    """Inline options written as a list ("A: red, B: blue, C: green") are the texts without the list's commas,
    semicolons and final "or" / "and": the option's text is an answer, and a text reference is that option."""
    assert parse_choices(prompt, "ABCDEFGHIJ") == {"A": "red", "B": "blue", "C": "green"}
    assert choice_reward("blue", "B", prompt=prompt) == 1.0
    assert choice_reward(r"\boxed{blue}", "B", prompt=prompt) == 1.0
    assert choice_reward("B", "blue", prompt=prompt) == 1.0  # the reference is the option's text
    assert choice_reward("red", "B", prompt=prompt) == 0.0
    assert choice_reward("Answer: 5", "B", prompt="Choices: A. 3, B. 5, C. 7") == 1.0


@pytest.mark.parametrize(
    "completion, kwargs, expected",
    [
        (r"<think>because</think> \boxed{3}", {}, 1.0),
        (r"<think>because</think> \boxed{3}", {"require_boxed": True}, 1.0),
        ("<think>because</think> 3", {"require_boxed": True}, 0.0),
        ("<think></think> 3", {}, 0.0),  # empty reasoning
        ("<think>because</think>", {}, 0.0),  # no answer
        ("because</think> 3", {}, 0.0),  # missing opening tag
        ("because</think> 3", {"think_start": ""}, 1.0),
        ("<think>a</think><think>b</think> 3", {}, 0.0),
        ("3 <think>because</think>", {}, 0.0),
        ("<think>a</think> <answer>3</answer>", {"answer_start": "<answer>", "answer_end": "</answer>"}, 1.0),
        ("<think>a</think> 3", {"answer_start": "<answer>", "answer_end": "</answer>"}, 0.0),
    ],
)
def test_format_reward(completion, kwargs, expected):
    assert format_reward(completion, "", **kwargs) == expected


@pytest.mark.parametrize(
    "completion, answer, kwargs, expected",
    [
        ("The answer is Paris.", "paris", {}, 1.0),
        ("The answer is Paris.", "paris", {"case_sensitive": True}, 0.0),
        ("I think...\nred", "red", {}, 1.0),
        (r"\boxed{circle}", r"\boxed{circle}", {}, 1.0),
        ("  red  ", "red", {"extract": False}, 1.0),
        ("red square", "red", {}, 0.0),
    ],
)
def test_exact_match_reward(completion, answer, kwargs, expected):
    assert exact_match_reward(completion, answer, **kwargs) == expected


@pytest.mark.parametrize(
    "text", ["1" * 41, "10^{10^{10}}", "((2^{999})^{999})^{999}", "(" * 60 + "1" + ")" * 60, "x" * 600, r"\overline{3}", "a'b"]
)
def test_parser_rejects_oversized_or_unknown_input(text):
    with pytest.raises(LatexParseError):
        parse_latex(text)
