"""Equivalence of two math answers: normalised text, numeric value, or symbolic identity.

`math_equal(pred, gold)` is the core of the math verifier. Order of checks:
1. normalised strings are equal ("Yes" vs "yes.", "\\text{B}" vs "B");
2. both parse (latex_math, no evaluation of text) and their values agree:
   - numbers: |a - b| <= rel_tol * max(|a|, |b|) (1e-9 absolute near zero); a prediction written as
     a decimal with >= `rounding_min_decimals` places also matches the gold value rounded to as
     many places (5.20 for 3\\sqrt{3});
   - expressions with symbols: expand(a - b) == 0, else simplify(a - b) == 0;
   - percentages: "50%" matches 50 and 0.5;
   - tuples / intervals element-wise with the same brackets; sets / lists as multisets.
Sympy can be slow on pathological inputs; callers run this in a reward worker with a timeout.
"""
from __future__ import annotations

import re
from typing import Optional

import sympy

from megatron_vlm.rl.rewards.extract import last_boxed, strip_math_delimiters
from megatron_vlm.rl.rewards.latex_math import LatexParseError, ParsedAnswer, Seq, parse_latex

__all__ = ["normalize_text", "math_equal", "values_equal"]

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")


def normalize_text(s: str) -> str:
    """Formatting-insensitive form of an answer: no math delimiters, text wrappers, spaces, case,
    trailing period."""
    s = strip_math_delimiters(s.strip())
    for _ in range(3):
        s = _TEXT_CMD.sub(r"\1", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[,;:! ]|\\quad|~", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\s+", "", s).lower()
    return s.rstrip(".")


def _decimal_places(text: str) -> int:
    m = re.fullmatch(r"\s*-?\d*\.(\d+)\s*", text)
    return len(m.group(1)) if m else 0


def _number(e: sympy.Basic) -> Optional[complex]:
    if not (getattr(e, "is_number", False)) or e.free_symbols:
        return None
    if e in (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return None
    try:
        v = complex(sympy.N(e, 30))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None
    if v != v or abs(v) == float("inf"):
        return None
    return v


def _expr_equal(a: sympy.Basic, b: sympy.Basic, rel_tol: float, pred_decimals: int, rounding_min_decimals: int) -> bool:
    if a == b:
        return True
    va, vb = _number(a), _number(b)
    if va is not None and vb is not None:
        if abs(va - vb) <= max(rel_tol * max(abs(va), abs(vb)), 1e-9):
            return True
        if rounding_min_decimals and pred_decimals >= rounding_min_decimals and va.imag == 0 and vb.imag == 0:
            return round(vb.real, pred_decimals) == round(va.real, pred_decimals)
        return False
    if (va is None) != (vb is None) and not (a.free_symbols or b.free_symbols):
        return False  # e.g. oo vs a number
    try:
        diff = sympy.expand(a - b)
        if diff == 0:
            return True
        return sympy.simplify(diff) == 0
    except (TypeError, ValueError, NotImplementedError, AttributeError, RecursionError):
        return False


def values_equal(a, b, *, rel_tol: float = 1e-6, pred_decimals: int = 0, rounding_min_decimals: int = 2) -> bool:
    """Compare two parsed values (sympy expressions or Seq), `a` being the prediction."""
    if isinstance(a, Seq) or isinstance(b, Seq):
        if not (isinstance(a, Seq) and isinstance(b, Seq)) or len(a.items) != len(b.items):
            return False
        if a.kind != b.kind:
            return False
        if a.kind == "tuple":
            if (a.open, a.close) != (b.open, b.close):
                return False
            return all(values_equal(x, y, rel_tol=rel_tol) for x, y in zip(a.items, b.items))
        remaining = list(b.items)
        for x in a.items:
            for j, y in enumerate(remaining):
                if values_equal(x, y, rel_tol=rel_tol):
                    del remaining[j]
                    break
            else:
                return False
        return True
    return _expr_equal(a, b, rel_tol, pred_decimals, rounding_min_decimals)


def _candidates(p: ParsedAnswer) -> list:
    if p.percent and not isinstance(p.value, Seq):
        return [p.value, p.value / 100]
    return [p.value]


def math_equal(pred: str, gold: str, *, rel_tol: float = 1e-6, rounding_min_decimals: int = 2) -> bool:
    """Is the predicted answer text equivalent to the gold answer text? (see module docstring)."""
    if not isinstance(pred, str) or not isinstance(gold, str) or not pred.strip() or not gold.strip():
        return False
    boxed = last_boxed(gold)
    if boxed is not None:  # ViRL39K stores answers as "\boxed{...}"
        gold = boxed
    if normalize_text(pred) == normalize_text(gold):
        return True
    try:
        p = parse_latex(pred)
        g = parse_latex(gold)
    except LatexParseError:
        return False
    decimals = _decimal_places(pred)
    for x in _candidates(p):
        for y in _candidates(g):
            if values_equal(x, y, rel_tol=rel_tol, pred_decimals=decimals, rounding_min_decimals=rounding_min_decimals):
                return True
    return False
