"""Equivalence of two math answers: normalised text, numeric value, relation or symbolic identity.

`math_equal(pred, gold)` is the core of the math verifier. An answer with nothing left once normalised
("", ".", "$$", "\\text{}", an empty box: `is_empty_answer`) equals nothing, itself included: an empty
completion must not score against a reference that normalises to empty. Order of checks:
1. normalised strings are equal ("Yes" vs "yes.", "\\text{B}" vs "B", "\\text{(C)}" vs "C");
   a choice label with its value ("\\textbf{(B)}\\ 12") compares by letter with a lettered answer, by
   value otherwise;
2. both parse (latex_math, no evaluation of text) and their values agree:
   - numbers: two integers only when they are the same integer; otherwise
     |a - b| <= rel_tol * max(|a|, |b|) (1e-9 absolute near zero); a decimal written with
     d >= 2 places matches any value that rounds to it: a prediction (5.20 for 3\\sqrt{3}) or a gold
     answer (gold 3.14 accepts \\pi and 3.14159, not 3.1 or 3.15);
   - percentages: "50%" matches 50, 0.5 and 1/2 (and a gold "50%" accepts 50 and 0.5);
   - expressions with symbols: expand(a - b) == 0, else numeric probes at fixed points of mixed sign
     (symbolic work is capped first: over MAX_SYMBOLIC_OPS operations or a power of a symbolic base
     above MAX_SYMBOLIC_DEGREE, the answer is "not equal" without any expansion);
   - tuples / intervals element-wise with the same brackets; sets / lists as sets (any order, a
     repeated element counts once); a set equals a single value only when every element is it
     ("\\{-1\\}" = -1, "2, 5" != 2); `\\emptyset` the empty set; ratios a:b:c up to a positive factor,
     a two-part ratio also as its quotient;
   - inequalities in one variable (x > 3, 3 < x, 2x > 6, -1 < 2x + 1 < 5, -1 < g(t) < 2, |x - 1| <= 2,
     2 <= |w| <= 3, chains flipped) are intervals or unions, so they match interval notation and each
     other; other relations match when sides flipped and multiplied out agree: (l1 - r1) = c * (l2 - r2)
     with c a constant (c > 0 for <, <=) (relations.py);
   - equations: "x = 5" with a named left side (x, ABC, |PQ|, AE/EC, S_1:S_2, a + b, \\cos A, P(t),
     (x, y); relations.is_name) against a value compares the right-hand side, in both directions; two
     equations with the same name compare their right-hand sides (P(t) and P(x) after renaming the
     variable, reversed ratio names with reversed values); equations in repeated blocks
     ("x=1, y=2; x=3, y=0") are solution tuples;
   - matrices element-wise; a one-column or one-row matrix also matches a tuple.
Everything is bounded before sympy starts; callers still run this in a reward worker with a timeout.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import sympy

from megatron_vlm.rl.rewards.extract import boxed_answer, strip_math_delimiters
from megatron_vlm.rl.rewards.latex_math import LatexParseError, Matrix, ParsedAnswer, Rel, Seq, parse_latex
from megatron_vlm.rl.rewards.relations import answer_side, as_interval, by_names, is_name, named_solutions, rel_equal
from megatron_vlm.rl.rewards.symbolic_limits import MAX_ITEM_PAIRS, MAX_SYMBOLIC_DEGREE, MAX_SYMBOLIC_OPS, too_big

__all__ = ["normalize_text", "is_empty_answer", "math_equal", "values_equal", "answer_parts", "rounded_equal",
           "MAX_SYMBOLIC_OPS", "MAX_SYMBOLIC_DEGREE"]

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_PROBES = (sympy.Rational(7, 13), sympy.Rational(-11, 7), sympy.Rational(23, 9), sympy.Rational(-3, 17), sympy.Rational(5, 3))


def normalize_text(s: str) -> str:
    """Formatting-insensitive form of an answer: no math delimiters, text wrappers, spaces, case,
    trailing period, parentheses around a single letter."""
    s = strip_math_delimiters(s.strip())
    for _ in range(3):
        s = _TEXT_CMD.sub(r"\1", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[,;:! ]|\\quad|~", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s).lower().rstrip(".")
    m = re.fullmatch(r"\(([a-z])\)", s)
    return m.group(1) if m else s


_EMPTY_FORMS = ("", "\\boxed{}", "\\fbox{}")


def is_empty_answer(s: str) -> bool:
    """Nothing left of `s` once normalised (`normalize_text`; an empty box counts as empty): no answer at all."""
    return normalize_text(s) in _EMPTY_FORMS


def _decimal_places(text: str) -> int:
    m = re.fullmatch(r"\s*\$?\s*-?\d*\.(\d+)\s*\$?\s*(?:\\?%)?\s*", text)
    return len(m.group(1)) if m else 0


def _number(e) -> Optional[complex]:
    if not isinstance(e, sympy.Basic) or not getattr(e, "is_number", False) or e.free_symbols:
        return None
    if e.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return None
    try:
        v = complex(sympy.N(e, 30))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None
    if v != v or abs(v) == float("inf"):
        return None
    return v


def _probe_equal(diff: sympy.Basic) -> bool:
    """diff vanishes at every probe point where it is defined (at least three)."""
    syms = sorted(diff.free_symbols, key=lambda s: s.name)
    defined = 0
    for k in range(len(_PROBES)):
        point = {s: _PROBES[(k + j) % len(_PROBES)] + j for j, s in enumerate(syms)}
        try:
            v = complex(sympy.N(diff.subs(point), 20))
        except (TypeError, ValueError, OverflowError, ZeroDivisionError):
            continue
        if v != v or abs(v) == float("inf"):
            continue
        if abs(v) > 1e-9:
            return False
        defined += 1
    return defined >= 3


def _within_rounding(v: complex, decimal_value: complex, places: int) -> bool:
    return abs(v.imag) < 1e-12 and abs(decimal_value.imag) < 1e-12 and abs(v.real - decimal_value.real) <= 0.5 * 10.0 ** -places + 1e-12


def _expr_equal(a, b, rel_tol: float, pred_decimals: int, gold_decimals: int, rounding_min_decimals: int) -> bool:
    if not isinstance(a, sympy.Basic) or not isinstance(b, sympy.Basic):
        return False
    if a == b:
        return True
    if a.is_Integer and b.is_Integer:  # counts and residues: 1000000008 is not 1000000007 at any tolerance
        return False
    va, vb = _number(a), _number(b)
    if va is not None and vb is not None:
        if abs(va - vb) <= max(rel_tol * max(abs(va), abs(vb)), 1e-9):
            return True
        if rounding_min_decimals and pred_decimals >= rounding_min_decimals and _within_rounding(vb, va, pred_decimals):
            return True
        if rounding_min_decimals and gold_decimals >= rounding_min_decimals and (pred_decimals == 0 or pred_decimals > gold_decimals):
            return _within_rounding(va, vb, gold_decimals)
        return False
    if not (a.free_symbols or b.free_symbols):
        return False  # e.g. oo vs a number
    if too_big(a) or too_big(b):
        return False
    try:
        diff = sympy.expand(a - b)
        if diff == 0:
            return True
        if too_big(diff):
            return False
        return _probe_equal(diff)
    except (TypeError, ValueError, NotImplementedError, AttributeError, RecursionError):
        return False


def _ratio_equal(a: Seq, b: Seq, eq) -> bool:
    """a:b:c = ka:kb:kc for a positive constant k (2:4 = 1:2, not 2:1)."""
    if len(a.items) != len(b.items):
        return False
    k = a.items[0] / b.items[0]
    if k.free_symbols or not k.is_number:
        return all(eq(x, y) for x, y in zip(a.items, b.items))
    if not k.is_positive:
        return False
    return all(eq(x, k * y) for x, y in zip(a.items[1:], b.items[1:]))


def _set_equal(xs: tuple, ys: tuple, eq) -> bool:
    """Same elements, in any order, a repeated element counting once (capped: MAX_ITEM_PAIRS)."""
    if len(xs) * len(ys) > MAX_ITEM_PAIRS:
        return False
    seen: dict = {}

    def same(i: int, j: int) -> bool:
        if (i, j) not in seen:
            seen[(i, j)] = eq(xs[i], ys[j])
        return seen[(i, j)]

    return all(any(same(i, j) for j in range(len(ys))) for i in range(len(xs))) and all(
        any(same(i, j) for i in range(len(xs))) for j in range(len(ys))
    )


def _is_set(v) -> bool:
    return isinstance(v, Seq) and v.kind == "set"


def _is_tuples(v) -> bool:
    """A tuple, or a set of tuples (solutions such as "(1, 2), (3, 0)")."""
    if isinstance(v, Seq) and v.kind == "tuple":
        return True
    return _is_set(v) and bool(v.items) and all(isinstance(i, Seq) and i.kind == "tuple" for i in v.items)


def _matrix_vs_tuple(m: Matrix, t: Seq, **kw) -> bool:
    flat = [x for row in m.rows for x in row]
    if not (len(m.rows) == 1 or all(len(r) == 1 for r in m.rows)) or t.kind != "tuple" or len(flat) != len(t.items):
        return False
    return t.open == "(" and t.close == ")" and all(values_equal(x, y, **kw) for x, y in zip(flat, t.items))


def values_equal(a, b, *, rel_tol: float = 1e-6, pred_decimals: int = 0, gold_decimals: int = 0,
                 rounding_min_decimals: int = 2) -> bool:
    """Compare two parsed values (sympy expressions, Seq, Rel, Matrix), `a` being the prediction."""
    kw: dict[str, Any] = {"rel_tol": rel_tol}
    full: dict[str, Any] = dict(kw, pred_decimals=pred_decimals, gold_decimals=gold_decimals, rounding_min_decimals=rounding_min_decimals)

    def eq(x, y) -> bool:
        return values_equal(x, y, **kw)

    a, b = _canon(a), _canon(b)
    # solutions written as equations against tuples: "x=1, y=2; x=3, y=0" = "(1, 2), (3, 0)"
    if _is_tuples(b):
        a = named_solutions(a) or a
    elif _is_tuples(a):
        b = named_solutions(b) or b
    # a set against a single value: every element is that value ("\{-1\}" = -1, "2, 2" = 2; "2, 5" != 2)
    if _is_set(a) and a.items and not _is_set(b) and not (isinstance(b, Rel) and by_names(a, b, eq) is not None):
        return all(values_equal(x, b, **full) for x in a.items)
    if _is_set(b) and b.items and not _is_set(a) and not (isinstance(a, Rel) and by_names(b, a, eq) is not None):
        return all(values_equal(a, y, **full) for y in b.items)
    if isinstance(a, Rel) or isinstance(b, Rel):
        if isinstance(a, Rel) and isinstance(b, Rel):
            return rel_equal(a, b, eq)
        if isinstance(b, Rel) and (named := by_names(a, b, eq)) is not None:
            return named
        if isinstance(a, Rel) and (named := by_names(b, a, eq)) is not None:
            return named
        if isinstance(a, Rel):
            side = answer_side(a)
            return side is not None and values_equal(side, b, **full)
        side = answer_side(b)
        return side is not None and values_equal(a, side, **full)
    if _is_ratio(a) or _is_ratio(b):
        if _is_ratio(a) and _is_ratio(b):
            return _ratio_equal(a, b, eq)
        if _is_ratio(a) and len(a.items) == 2 and isinstance(b, sympy.Basic):
            return values_equal(a.items[0] / a.items[1], b, **full)
        if _is_ratio(b) and len(b.items) == 2 and isinstance(a, sympy.Basic):
            return values_equal(a, b.items[0] / b.items[1], **full)
        return False
    if isinstance(a, Matrix) or isinstance(b, Matrix):
        if isinstance(a, Matrix) and isinstance(b, Matrix):
            if len(a.rows) != len(b.rows) or len(a.rows[0]) != len(b.rows[0]):
                return False
            return all(eq(x, y) for ra, rb in zip(a.rows, b.rows) for x, y in zip(ra, rb))
        if isinstance(a, Matrix) and isinstance(b, Seq):
            return _matrix_vs_tuple(a, b, **kw)
        if isinstance(b, Matrix) and isinstance(a, Seq):
            return _matrix_vs_tuple(b, a, **kw)
        return False
    if isinstance(a, Seq) or isinstance(b, Seq):
        if not (isinstance(a, Seq) and isinstance(b, Seq)):
            return False
        if a.kind != b.kind:
            return False
        if a.kind == "tuple":
            if (a.open, a.close) != (b.open, b.close) or len(a.items) != len(b.items):
                return False
            return all(eq(x, y) for x, y in zip(a.items, b.items))
        return _set_equal(a.items, b.items, eq)
    return _expr_equal(a, b, rel_tol, pred_decimals, gold_decimals, rounding_min_decimals)


def _is_ratio(v) -> bool:
    return isinstance(v, Seq) and v.kind == "ratio"


def _canon(v):
    """Inequalities become intervals (or unions of two)."""
    if isinstance(v, Rel):
        iv = as_interval(v)
        if iv is not None:
            return iv
    return v


def _candidates(p: ParsedAnswer) -> list:
    if p.percent and isinstance(p.value, sympy.Basic):
        return [p.value, p.value / 100]
    return [p.value]


_CHOICE = re.compile(r"\s*(?:\\text(?:bf|rm)?\s*\{\s*)?\(\s*([A-Ea-e])\s*\)\s*\}?(?:\s|\\[ ,;:]|~)*(.*)", re.S)


def _choice_label(text: str) -> tuple[str, str]:
    """"\\textbf{(B)}\\ 12" -> ("b", "12"); "(C)" -> ("c", ""); anything else -> ("", "")."""
    m = _CHOICE.fullmatch(strip_math_delimiters(text))
    if m is None:
        return "", ""
    return m.group(1).lower(), m.group(2).strip()


def answer_parts(gold: str) -> int:
    """How many items the reference answer lists ("a_n = 2n - 1, T_n = n^2" -> 2); 1 when it is not a
    list or does not parse."""
    boxed = boxed_answer(gold) if isinstance(gold, str) else None
    try:
        value = parse_latex(boxed if boxed is not None else gold).value
    except LatexParseError:
        return 1
    return len(value.items) if isinstance(value, Seq) and value.kind == "set" and value.items else 1


def math_equal(pred: str, gold: str, *, rel_tol: float = 1e-6, rounding_min_decimals: int = 2) -> bool:
    """Is the predicted answer text equivalent to the gold answer text? (see module docstring)."""
    if not isinstance(pred, str) or not isinstance(gold, str) or not pred.strip() or not gold.strip():
        return False
    boxed = boxed_answer(gold)
    if boxed is not None:  # ViRL39K stores answers as "\boxed{...}"
        gold = boxed
    if is_empty_answer(pred) or is_empty_answer(gold):  # "" and "." normalise alike; neither is an answer
        return False
    if normalize_text(pred) == normalize_text(gold):
        return True
    (pl, pv), (gl, gv) = _choice_label(pred), _choice_label(gold)
    if pl and gl:  # "\textbf{(B)}\ 12" against "(B) 12": the options are distinct, the letters decide
        return pl == gl
    if pl or gl:
        letter, value, other = (pl, pv, gold) if pl else (gl, gv, pred)
        if re.fullmatch(r"[a-e]", normalize_text(other)):
            return letter == normalize_text(other)
        if not value:
            return False
        pred, gold = (value, gold) if pl else (pred, value)
    try:
        p = parse_latex(pred)
        g = parse_latex(gold)
    except LatexParseError:
        return False
    pd, gd = _decimal_places(pred), _decimal_places(gold)
    for i, x in enumerate(_candidates(p)):
        for j, y in enumerate(_candidates(g)):
            # a percentage read as a fraction has two more decimal places than written
            if values_equal(x, y, rel_tol=rel_tol, pred_decimals=pd + 2 * i if pd else 0,
                            gold_decimals=gd + 2 * j if gd else 0, rounding_min_decimals=rounding_min_decimals):
                return True
    return False


def _stated_number(text: str) -> Optional[float]:
    """The real number an answer states ("1.46", "\\frac{3}{2}", "x = 1.46", "1.5 cm"), as the double nearest it (a
    decimal literal: exactly `float(literal)`); None for anything else (a percentage, a list, an expression with
    symbols, a complex value, text that does not parse)."""
    boxed = boxed_answer(text)
    try:
        parsed = parse_latex(text if boxed is None else boxed)
    except LatexParseError:
        return None
    value = parsed.value
    if isinstance(value, Rel) and len(value.sides) == 2 and is_name(value.sides[0]):
        value = answer_side(value)
    if parsed.percent or not isinstance(value, sympy.Basic):
        return None
    if value.is_Rational:  # p / q correctly rounded, as float() rounds the decimal it was written as
        return int(value.p) / int(value.q)
    v = _number(value)
    return v.real if v is not None and abs(v.imag) < 1e-12 else None


def rounded_equal(pred: str, gold: str, places: int) -> Optional[bool]:
    """Does the prediction, rounded to `places` decimal places (Python's `round` of its double: 1.45 -> 1.4, the
    double nearest 1.45 lying below it), equal the gold number? MathVista's rule for answers of a given precision.
    None when either does not state one real number (the caller decides)."""
    p, g = _stated_number(pred), _stated_number(gold)
    if p is None or g is None:
        return None
    return round(p, places) == g
