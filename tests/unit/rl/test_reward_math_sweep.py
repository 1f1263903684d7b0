"""Defects a fresh-eyes sweep found in the `math` reward by comparing it with math-verify.

Why: each case is a verdict a user would call wrong: a correct answer scored 0 (a lost learning
signal) or a wrong one scored 1 (worse: the policy learns to write it). Labels come from the
mathematics and agree with Hugging Face math-verify on each of these inputs."""
import pytest

from megatron_vlm.rl.rewards.math_equiv import math_equal
from megatron_vlm.rl.rewards.verifiers import choice_reward, math_reward


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        (r"2\frac{1}{4}", r"\frac94", True),  # a mixed number is a sum
        (r"2 \frac{1}{4}", "2.25", True),
        (r"2\dfrac14", r"\frac{9}{4}", True),
        (r"-2\frac{1}{4}", r"-\frac{9}{4}", True),
        (r"3\frac{1}{2} \text{ hours}", "3.5", True),
        (r"2\frac{1}{4}", r"\frac12", False),  # not the product 2 * 1/4
        (r"\frac12", r"2\frac{1}{4}", False),
        (r"2\frac{x}{4}", r"\frac{x}{2}", True),  # a letter: a product, as before
        (r"x^2\frac{1}{2}", r"\frac{x^2}{2}", True),  # an exponent is not the whole part
    ],
)
def test_mixed_numbers(pred, gold, equal):
    assert math_equal(pred, gold) is equal


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        ("1000000008", "1000000007", False),
        ("12345679", "12345678", False),
        ("3628801", "3628800", False),
        ("1000000007", "1000000007", True),
        ("1000000007", "1{,}000{,}000{,}007", True),
        ("1000000007.0", "1000000007", True),
    ],
)
def test_integers_compare_exactly(pred, gold, equal):
    assert math_equal(pred, gold) is equal


def test_integer_tolerance_still_applies_to_decimals():
    assert math_reward(r"\boxed{24.001}", "24", rel_tol=1e-3) == 1.0
    assert math_reward(r"\boxed{1.41421356}", r"\sqrt2") == 1.0


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        ("1{,}5", "15", False),  # a decimal comma, not a thousands separator
        ("1{,}00", "100", False),
        ("1{,}000", "1000", True),
        ("12{,}345{,}678", "12345678", True),
    ],
)
def test_thousands_separator_groups_of_three(pred, gold, equal):
    assert math_equal(pred, gold) is equal


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        ("\u22125", "-5", True),  # U+2212 MINUS SIGN
        ("x\u22121", "x - 1", True),
        ("\u2212\\frac{1}{2}", "-0.5", True),
        ("2\u00d73", "6", True),  # MULTIPLICATION SIGN
        ("6\u00f73", "2", True),  # DIVISION SIGN
        ("2\u22c53", "6", True),  # DOT OPERATOR
        ("\u03c0/2", r"\frac{\pi}{2}", True),
        ("2\u03c0", r"2\pi", True),
        ("\u221e", r"\infty", True),
        ("[2, \u221e)", r"[2, \infty)", True),
        ("5\u00a0000", "5000", True),  # a no-break space between digit groups
        ("\u22125", "5", False),
        ("2\u00d73", "5", False),
    ],
)
def test_unicode_operators(pred, gold, equal):
    assert math_equal(pred, gold) is equal


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        ("Therefore, the answer is **5**.", "5", 1.0),
        ("So the final answer is **\u22125**.", "-5", 1.0),
        ("The answer is **x = 3**.", "3", 1.0),
        ("Therefore, the answer is **5**.", "6", 0.0),
        ("The final answer is \u22125", "-5", 1.0),
    ],
)
def test_bold_and_unicode_after_the_answer_phrase(completion, gold, score):
    assert math_reward(completion, gold) == score


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        (r"So $\boxed{3}$. (Answer format: \boxed{})", "3", 1.0),  # an empty box is no answer
        (r"$\boxed{3}$ \boxed{ }", "3", 1.0),
        (r"The answer is $4$. \boxed{}", "4", 1.0),
        (r"So $\boxed{3}$. \boxed{}", "4", 0.0),
    ],
)
def test_an_empty_box_is_skipped(completion, gold, score):
    assert math_reward(completion, gold) == score


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        (r"12^\circ\text{C}", "12", True),
        (r"12^{\circ} C", "12", True),
        (r"-5\,^\circ\mathrm{F}", "-5", True),
        (r"12^\circ\text{C}", "13", False),
    ],
)
def test_degrees_celsius_and_fahrenheit(pred, gold, equal):
    assert math_equal(pred, gold) is equal


_CHOICES = {"choices": ["1/2", "3/4", "2", r"$\sqrt{2}$"]}


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        (r"\boxed{\frac{1}{2}}", "1/2", 1.0),  # the option's value in another form (MathVista: gold = option text)
        (r"\boxed{\frac{1}{2}}", "A", 1.0),
        ("The answer is 0.5", "A", 1.0),
        (r"\boxed{\sqrt2}", "D", 1.0),
        (r"\boxed{2.0}", "C", 1.0),
        (r"\boxed{\frac34}", "B", 1.0),
        (r"\boxed{\frac34}", "A", 0.0),
        (r"\boxed{3}", "C", 0.0),  # no option has the value
    ],
)
def test_choice_by_option_value(completion, gold, score):
    assert choice_reward(completion, gold, metadata=_CHOICES) == score


def test_choice_value_matching_two_options_is_no_choice():
    meta = {"choices": ["0.5", r"\frac{1}{2}", "3"]}
    assert choice_reward(r"\boxed{\frac{2}{4}}", "A", metadata=meta) == 0.0
    assert choice_reward(r"\boxed{\frac{2}{4}}", "B", metadata=meta) == 0.0


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        ("so the temperature is \u22125 degrees", "-5", 1.0),  # a unicode minus is a sign
        ("so the temperature is \u22125 degrees", "5", 0.0),
        ("It was 3/4 of the way", "3/4", 1.0),  # a fraction, not its denominator
        ("It was 3/4 of the way", "4", 0.0),
        ("The total is 1.5e3", "3", 0.0),  # not the exponent of 1.5e3
        ("we need a_1 and then 7", "7", 1.0),
        ("The total is 1,000,000 dollars", "1000000", 1.0),
        ("The total is -2.5 now", "-2.5", 1.0),
    ],
)
def test_last_number_fallback(completion, gold, score):
    assert math_reward(completion, gold, fallback_last_math=False, fallback_last_number=True) == score


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        (r"0.\overline{3}", r"\frac13", True),  # a repeating decimal is its exact fraction
        (r"0.\overline{12}", r"\frac{4}{33}", True),
        (r"1.2\overline{3}", r"\frac{37}{30}", True),
        (r".\overline{6}", r"\frac23", True),
        (r"-0.\dot{3}", r"-\frac13", True),
        (r"0.\overline{3}", "0.33", True),  # the documented rounding rule, as for 1/3
        (r"0.\overline{3}", r"\frac{3}{10}", False),
        (r"0.\overline{12}", r"\frac{12}{100}", False),
        (r"\overline{AB}", r"\overline{AB}", True),  # segments keep their meaning
    ],
)
def test_repeating_decimals(pred, gold, equal):
    assert math_equal(pred, gold) is equal


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        ("So we are done.\n\n### Final Answer\n5", "5", 1.0),  # a heading, the value on the next line
        ("**Final Answer**\n5", "5", 1.0),
        ("Final Answer\n\n5", "5", 1.0),
        ("**Final Answer**\n5", "6", 0.0),
        ("Hence the answer is 3, since 3 > 2.", "3", 1.0),  # the reason after the value is not the value
        ("Hence the answer is 3, because the other root is negative.", "3", 1.0),
        ("Hence the answer is 3, since 3 > 2.", "2", 0.0),
        ("The answer is 2, 3.", "2, 3", 1.0),
        ("Answer: 7 (seven)", "7", 1.0),
        ("Answer: 7 (seven)", "6", 0.0),
    ],
)
def test_final_answer_heading_and_trailing_words(completion, gold, score):
    assert math_reward(completion, gold) == score


def test_trailing_words_that_qualify_still_count():
    assert math_reward("Answer: 5 (approximately)", "5") == 0.0
    assert math_reward("Answer: 5 (not exact)", "5") == 0.0


@pytest.mark.parametrize(
    "completion, score",
    [
        ("The answer is (B) 5", 1.0),  # the option's value without its unit
        (r"The answer is (B) $\frac{10}{2}$ cm", 1.0),
        ("The answer is (B) 7", 0.0),  # a letter with another option's value: no choice
        ("The answer is (B) 5 cm", 1.0),
    ],
)
def test_choice_letter_with_the_value_in_another_form(completion, score):
    assert choice_reward(completion, "B", metadata={"choices": ["3 cm", "5 cm", "7 cm"]}) == score


def test_final_answer_heading_only_at_the_start_of_a_line():
    text = "Now let us find the final answer\nWe have $a=2$ and $b=3$, hence\n$$a+b=5$$"
    assert math_reward(text, "5") == 1.0  # not a heading: the last math environment is the answer
