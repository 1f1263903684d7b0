"""Rules of the `math` reward for the answer forms of real completions, one rule at a time.

Why: the corpus (math_reward_corpus_forms.py) measures agreement; these tests pin each rule and,
above all, the near misses each rule must keep at 0 — a wrong rollout scored 1 teaches the policy
to write it. The labels are written by hand from the mathematics (a set is not one of its
elements, an open interval is not a closed one, a ratio that names its order is not its reverse,
"not 3" is not 3). The bounded-work guards for the new paths (many boxes, long gaps, long lists and
ratios) are hang guards, not timings (those live in benchmarks/math_reward_bench.py).
"""
import pytest

from megatron_vlm.rl.rewards.extract import boxed_answer, extract_answer, last_boxed, last_boxes
from megatron_vlm.rl.rewards.latex_math import LatexParseError, Seq, parse_latex
from megatron_vlm.rl.rewards.math_equiv import math_equal
from megatron_vlm.rl.rewards.verifiers import math_reward


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"roots $\boxed{3}$ and $\boxed{5}$.", "3, 5"),
        (r"Hence $x=\boxed{3}$ or $x=\boxed{5}$.", "x= 3, x= 5"),
        (r"\boxed{a = 12} and \boxed{b = 3}", "a = 12, b = 3"),
        (r"Thus $x = \boxed{1}$, $y = \boxed{2}$, $z = \boxed{3}$.", "x = 1, y = 2, z = 3"),
        (r"$$\boxed{1} \quad \boxed{2}$$", "1, 2"),
        (r"\boxed{1} \text{ or } \boxed{2}", "1, 2"),
        # words between boxes: only the last box is the answer
        (r"First \boxed{4}. After checking, the answer is \boxed{5}.", "5"),
        ("$\\boxed{2}$\n\n**Final Answer**\n$\\boxed{3}$", "3"),
        ("\\boxed{2}" + " " * 200 + "\\boxed{3}", "3"),  # a long gap is not a connector
        (r"\boxed{1} then \boxed{\boxed{2}}", "2"),  # nested: the inner box, as before
        (r"\boxed{Thus $\boxed{3}$ and $\boxed{5}$}", "3, 5"),  # both inside the same box
        ("Solving, we get $x = 2$ or $x = 3$.", "x = 2, x = 3"),  # no box: the last math, joined
        ("The area is $6$ and the side is $3$.", "3"),
        (r"\boxed{2} and an unclosed \boxed{3", "2"),
    ],
)
def test_several_boxes(text, expected):
    assert extract_answer(text, fallback_last_math=True) == expected


def test_answer_in_parts():
    parts = "(1) So $\\boxed{a_n = 2n - 1}$.\n\n(2) Summing, $\\boxed{S_n = n^2}$."
    assert last_boxes(parts, 2) == "a_n = 2n - 1, S_n = n^2"
    assert last_boxes(parts, 3) is None
    assert last_boxes(r"First \boxed{4}. Wait, the answer is \boxed{5}.", 2) is None  # no new part
    assert math_reward(parts, "a_n = 2n - 1, S_n = n^2") == 1.0
    assert math_reward(parts, "S_n = n^2") == 1.0
    assert math_reward(parts, "a_n = 2n - 1, S_n = n^2 + 1") == 0.0
    assert math_reward(r"First \boxed{4}. Wait, the answer is \boxed{5}.", "4, 5") == 0.0


def test_last_boxed_is_unchanged():
    assert last_boxed(r"\boxed{3}, \boxed{5}") == "5"
    assert boxed_answer(r"\boxed{3}, \boxed{5}") == "3, 5"


@pytest.mark.parametrize(
    "text, kind, items",
    [
        ("4:11", "ratio", 2),
        (r"1:2:3", "ratio", 3),
        (r"3 \colon 2", "ratio", 2),
        ("(1;0;4)", "tuple", 3),
        (r"\{-1; 3\}", "set", 2),
        ("1; 0; 4", "set", 3),
    ],
)
def test_parses_ratios_and_semicolons(text, kind, items):
    v = parse_latex(text).value
    assert isinstance(v, Seq) and v.kind == kind and len(v.items) == items


@pytest.mark.parametrize(
    "text",
    [
        r"x = 3 \text{ is not a solution}",
        r"\text{at least } 4",
        r"5 \text{ or more}",
        r"\text{less than } 4",
        r"\text{approximately } 3.14",
        r"x = 3, \text{ but } x = -3 \text{ is extraneous}",
        r"\text{the sum of } 2 \text{ and } 3",
        r"\text{the product of 3 and 5}",
        r"x > 1 \text{ and } x < 3",
        r"\text{all real numbers except } 2",
        "0:5",
    ],
)
def test_qualified_or_unsupported_answers_are_not_parsed(text):
    with pytest.raises(LatexParseError):
        parse_latex(text)


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        # names against values
        ("2", "|PQ| = 2", True),
        ("PQ = 2", "|PQ| = 2", True),
        ("|x| = 2", "x = 2", False),  # |x| = 2 is x = ±2, not the length of a segment
        ("x = 2", "|x| = 2", False),
        (r"\overline{AB} = 5", "5", True),
        (r"\overline{z} = 3", "3", False),  # a conjugate, not a segment: not parsed
        ("|AB| = 3", "|AC| = 3", False),
        ("m = 2", "m:n = 2", False),
        ("2x = 6", "3", False),
        ("x^2 = 4", "2", False),
        # ratios and their order
        (r"\frac{EC}{AE} = \frac{\sqrt5}{2}", r"\frac{AE}{EC} = \frac{2}{\sqrt5}", True),
        (r"\frac{EC}{AE} = \frac{2}{\sqrt5}", r"\frac{AE}{EC} = \frac{2}{\sqrt5}", False),
        ("S_2:S_1 = 5:9", "S_1:S_2 = 5:9", False),
        ("c:b:a = 3:2:1", "a:b:c = 1:2:3", True),
        ("a:b:c = 3:2:1", "a:b:c = 1:2:3", False),
        ("AB:BC = 1:2", r"\frac{AB}{BC} = \frac12", True),
        ("-1:2", "1:2", False),
        ("2:4", "1:2", True),
        # functions and their variable
        ("f(t) = t^2", "f(x) = x^2", True),
        ("f(x) = 2x", "g(x) = 2x", False),
        ("f(t) = 2t", "2x", False),
        # lists, sets, solutions
        ("(1, 2)", "(1, 2), (3, 0)", False),
        ("(1, 2), (1, 2)", "(1, 2), (3, 0)", False),
        ("(x, y) = (2, 1)", "x = 1, y = 2", False),
        ("(x, y) = (1, 2)", "y = 2, x = 1", True),
        ("x = 1, y = 2, z = 3", "(1, 2)", False),
        ("x = 1, y = 2, x = 3", "(1, 2), (3, 0)", False),
        ("x_1 = 2, x_2 = 3", "x_1 = 3, x_2 = 2", False),
        (r"\vec{v} = (1, 2)", r"\vec{u} = (1, 2)", False),
        (r"\vec{v} = (1, 2)", "(1, 2)", True),
        ("2, 2", "2", True),
        ("2, 3", "2", False),
        (r"\emptyset", "0", False),
        # intervals across forms
        ("2 < x", r"[2, \infty)", False),
        (r"-1 < g(t) \le 2", "(-1, 2)", False),
        (r"0 \le |x| \le 3", r"[-3, 0] \cup [0, 3]", False),  # written as one interval, [-3, 3]
        (r"0 \le |x| \le 3", "[-3, 3]", True),
        (r"0 < |x| < 3", r"(-3, 0) \cup (0, 3)", True),
        (r"|2x - 1| < 3", "(-1, 2)", True),
        (r"|x| < -1", "(-1, 1)", False),
        (r"x \ne 2", r"(-\infty, 2) \cup (2, \infty)", False),
        (r"\{x \in \mathbb{R} \mid x \le 2\}", r"(-\infty, 2]", True),
        (r"x \in \{1, 2\}", "1, 2", True),
        # words around the answer
        (r"\text{The answer is: } 5", "5", True),
        (r"\text{Answer: } (1, 2)", "(1, 2)", True),
        (r"x = \frac{1}{2} \text{ is the minimum point}", r"\frac12", True),
        (r"\text{No, } 4 \text{ is not possible}", "4", False),
        # choice labels, systems, periodic answers
        ("(B)", "C", False),
        (r"\textbf{(B)}\ 12", "(C) 12", False),
        (r"\textbf{(B)}\ 12", "12", True),
        (r"\begin{cases} x = 1 \\ y = 2 \end{cases}", "(2, 1)", False),
        (r"x = k\pi, k \in \mathbb{Z}", r"x = 2n\pi, n \in \mathbb{Z}", False),
        (r"x = k\pi, k \in \mathbb{Z}", r"x = n\pi \ (n \in \mathbb{Z})", True),
        # trigonometric values and extremes as names; set-builder unions
        (r"\cos A = \frac{3}{5}", r"\frac35", True),
        (r"\sin A = \frac{3}{5}", r"\cos A = \frac35", False),
        (r"\cos 2A = \frac{3}{5}", r"\frac35", False),
        (r"f(x)_{\min} = 3", r"f(x)_{\max} = 3", False),
        (r"(-\infty, -1] \cup (3, +\infty)", r"\{x | x < -1 \text{ or } x > 3\}", False),
        ("There are no such numbers, not 42", "42", False),
    ],
)
def test_near_misses_and_their_correct_forms(pred, gold, expected):
    assert math_equal(pred, gold) is expected


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "completion, gold",
    [
        ("\\boxed{1}, " * 20000, "1"),  # many boxes joined by connectors: at most 8 are read
        ("\\boxed{1}" + " " * 100000 + "\\boxed{2}", "1, 2"),
        ("\\boxed{" + ", ".join(f"x^{{{k % 20 + 2}}} + {k}" for k in range(40)) + "}",
         ", ".join(f"x^{{{k % 20 + 2}}} + {k + 1}" for k in range(40))),
        ("\\boxed{" + ", ".join(f"x^{{{k % 20 + 2}}} + {k}" for k in range(16)) + "}",
         ", ".join(f"x^{{{k % 20 + 2}}} + {k + 1}" for k in range(16))),
        ("\\boxed{" + ":".join(["2"] * 200) + "}", "1"),
        ("\\boxed{" + " and ".join(["x > 1"] * 60) + "}", "(1, 2)"),
        ("\\boxed{\\{x | " + "|" * 200 + "\\}}", "1"),
        ("\\boxed{" + "is the " * 70 + "5}", "5"),
    ],
    ids=lambda v: (v[:24] + f"...[{len(v)} chars]") if len(v) > 40 else v,
)
def test_new_paths_stay_bounded(completion, gold):
    assert math_reward(completion, gold) in (0.0, 1.0)
