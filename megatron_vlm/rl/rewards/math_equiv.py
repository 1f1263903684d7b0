"""Equivalence of two math answers: normalised text, numeric value, relation or symbolic identity.

`math_equal(pred, gold)` is the core of the math verifier. Order of checks:
1. normalised strings are equal ("Yes" vs "yes.", "\\text{B}" vs "B", "\\text{(C)}" vs "C");
2. both parse (latex_math, no evaluation of text) and their values agree:
   - numbers: |a - b| <= rel_tol * max(|a|, |b|) (1e-9 absolute near zero); a decimal written with
     d >= 2 places matches any value that rounds to it: a prediction (5.20 for 3\\sqrt{3}) or a gold
     answer (gold 3.14 accepts \\pi and 3.14159, not 3.1 or 3.15);
   - percentages: "50%" matches 50, 0.5 and 1/2 (and a gold "50%" accepts 50 and 0.5);
   - expressions with symbols: expand(a - b) == 0, else numeric probes at fixed points of mixed sign
     (symbolic work is capped first: over MAX_SYMBOLIC_OPS operations or a power of a symbolic base
     above MAX_SYMBOLIC_DEGREE, the answer is "not equal" without any expansion);
   - tuples / intervals element-wise with the same brackets; sets / lists as multisets; a one-item set
     equals its item; `\\emptyset` the empty set;
   - inequalities in one variable (x > 3, 3 < x, 2x > 6, -1 < x \\le 4, chains flipped) are intervals,
     so they match interval notation and each other; other relations match when sides flipped and
     multiplied out agree: (l1 - r1) = c * (l2 - r2) with c a constant (c > 0 for <, <=);
   - equations: "x = 5" (a named left side: x, x_1, ABC, f(x), (x, y)) against a value compares the
     right-hand side, in both directions; two equations with the same named left side compare their
     right-hand sides; a list "x = 2, y = 3" matches the tuple (2, 3);
   - matrices element-wise; a one-column or one-row matrix also matches a tuple.
Everything is bounded before sympy starts; callers still run this in a reward worker with a timeout.
"""
from __future__ import annotations

import re
from typing import Optional

import sympy

from megatron_vlm.rl.rewards.extract import last_boxed, strip_math_delimiters
from megatron_vlm.rl.rewards.latex_math import LatexParseError, Matrix, ParsedAnswer, Rel, Seq, parse_latex

__all__ = ["normalize_text", "math_equal", "values_equal", "MAX_SYMBOLIC_OPS", "MAX_SYMBOLIC_DEGREE"]

MAX_SYMBOLIC_OPS = 120
"""Expressions with more operations than this are not compared symbolically (answer: not equal)."""
MAX_SYMBOLIC_DEGREE = 24
"""Powers of a symbolic base above this exponent are not expanded (answer: not equal)."""

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_PROBES = (sympy.Rational(7, 13), sympy.Rational(-11, 7), sympy.Rational(23, 9), sympy.Rational(-3, 17), sympy.Rational(5, 3))
_ORDER = {"<": 0, "<=": 0, ">": 1, ">=": 1}
_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "=": "=", "!=": "!="}


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


def _too_big(e: sympy.Basic) -> bool:
    if sympy.count_ops(e, visual=False) > MAX_SYMBOLIC_OPS:
        return True
    for p in e.atoms(sympy.Pow):
        if p.base.free_symbols or p.base.has(sympy.sin, sympy.cos, sympy.tan, sympy.log, sympy.exp):
            exp = p.exp
            if not exp.is_Number or abs(exp) > MAX_SYMBOLIC_DEGREE:
                if exp.is_Number or exp.free_symbols:
                    return True
    return False


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
    if _too_big(a) or _too_big(b):
        return False
    try:
        diff = sympy.expand(a - b)
        if diff == 0:
            return True
        if _too_big(diff):
            return False
        return _probe_equal(diff)
    except (TypeError, ValueError, NotImplementedError, AttributeError, RecursionError):
        return False


# --- relations ------------------------------------------------------------------------------------


def _is_name(v) -> bool:
    """x, x_1, ABC (a product of symbols), f (from f(x)), or a tuple of names: the thing asked for."""
    if isinstance(v, Seq):
        return v.kind == "tuple" and all(_is_name(i) for i in v.items)
    if isinstance(v, sympy.Symbol):
        return True
    return isinstance(v, sympy.Mul) and all(isinstance(f, sympy.Symbol) for f in v.args)


def _linear_bound(d: sympy.Basic):
    """d = k*s + m with one symbol s and a numeric k != 0: (s, -m/k, sign of k); else None."""
    syms = d.free_symbols
    if len(syms) != 1:
        return None
    s = next(iter(syms))
    if _too_big(d):
        return None
    k = sympy.expand(sympy.diff(d, s))
    if k.free_symbols or k == 0 or not k.is_real:
        return None
    m = sympy.expand(d - k * s)
    if m.free_symbols:
        return None
    return s, -m / k, k > 0


def _as_interval(r: Rel) -> Optional[Seq]:
    """An inequality in one variable as an interval (Seq tuple with its brackets), else None."""
    if not all(isinstance(x, sympy.Basic) for x in r.sides) or not all(op in _ORDER for op in r.ops):
        return None
    if len(r.ops) == 1:
        op = r.ops[0]
        lhs, rhs = r.sides
        if op in (">", ">="):
            lhs, rhs, op = rhs, lhs, _FLIP[op]
        found = _linear_bound(sympy.expand(lhs - rhs))  # lhs - rhs op 0
        if found is None:
            return None
        _, c, positive = found
        closed = op == "<="
        if positive:  # s < c
            return Seq("tuple", (-sympy.oo, c), "(", "]" if closed else ")")
        return Seq("tuple", (c, sympy.oo), "[" if closed else "(", ")")
    if len(r.ops) == 2 and _ORDER[r.ops[0]] == _ORDER[r.ops[1]] and isinstance(r.sides[1], sympy.Symbol):
        lo, hi = r.sides[0], r.sides[2]
        ops = r.ops
        if _ORDER[ops[0]] == 1:  # 4 > x > -1
            lo, hi, ops = hi, lo, (_FLIP[ops[1]], _FLIP[ops[0]])
        if r.sides[1] in lo.free_symbols or r.sides[1] in hi.free_symbols:
            return None
        return Seq("tuple", (lo, hi), "[" if ops[0] == "<=" else "(", "]" if ops[1] == "<=" else ")")
    return None


def _canon(v):
    """Inequalities become intervals; singletons stay as they are."""
    if isinstance(v, Rel):
        iv = _as_interval(v)
        if iv is not None:
            return iv
    return v


def _rel_equal(a: Rel, b: Rel, **kw) -> bool:
    if len(a.ops) == 1 and len(b.ops) == 1:
        if a.ops[0] == "=" == b.ops[0] and _is_name(a.sides[0]) and _is_name(b.sides[0]):
            return a.sides[0] == b.sides[0] and values_equal(a.sides[1], b.sides[1], **kw)
        if not all(isinstance(x, sympy.Basic) for x in a.sides + b.sides):
            return (a.ops == b.ops and all(values_equal(x, y, **kw) for x, y in zip(a.sides, b.sides))) or (
                b.ops[0] == _FLIP[a.ops[0]] and all(values_equal(x, y, **kw) for x, y in zip(a.sides, b.sides[::-1]))
            )

        def canon(r: Rel):
            op, (l, rr) = r.ops[0], r.sides
            if op in (">", ">="):
                return _FLIP[op], rr - l
            return op, l - rr

        (op1, d1), (op2, d2) = canon(a), canon(b)
        if op1 != op2:
            return False
        if _too_big(d1) or _too_big(d2) or d2 == 0:
            return False
        try:
            ratio = sympy.cancel(sympy.expand(d1) / sympy.expand(d2))
        except (TypeError, ValueError, NotImplementedError, ZeroDivisionError):
            return False
        if ratio.free_symbols or not ratio.is_number or ratio == 0 or ratio.has(sympy.zoo, sympy.nan):
            return False
        return bool(ratio > 0) if op1 in ("<", "<=") else True
    if len(a.ops) == len(b.ops):
        if a.ops == b.ops and all(values_equal(x, y, **kw) for x, y in zip(a.sides, b.sides)):
            return True
        flipped = tuple(_FLIP[o] for o in b.ops[::-1])
        return a.ops == flipped and all(values_equal(x, y, **kw) for x, y in zip(a.sides, b.sides[::-1]))
    return False


def _answer_side(r: Rel):
    """The value an equation states, "x = 5" -> 5 (chains "x = 4 = 2^2" -> the last side)."""
    if all(op == "=" for op in r.ops) and _is_name(r.sides[0]):
        return r.sides[-1]
    return None


def _named_list_as_tuple(v) -> Optional[Seq]:
    """"x = 2, y = 3" -> (2, 3) when every item is an equation with a different named left side."""
    if not (isinstance(v, Seq) and v.kind == "set" and len(v.items) > 1):
        return None
    if not all(isinstance(i, Rel) and _answer_side(i) is not None and len(i.sides) == 2 for i in v.items):
        return None
    if len({i.sides[0] for i in v.items}) != len(v.items):
        return None
    return Seq("tuple", tuple(i.sides[1] for i in v.items), "(", ")")


def _matrix_vs_tuple(m: Matrix, t: Seq, **kw) -> bool:
    flat = [x for row in m.rows for x in row]
    if not (len(m.rows) == 1 or all(len(r) == 1 for r in m.rows)) or t.kind != "tuple" or len(flat) != len(t.items):
        return False
    return t.open == "(" and t.close == ")" and all(values_equal(x, y, **kw) for x, y in zip(flat, t.items))


def values_equal(a, b, *, rel_tol: float = 1e-6, pred_decimals: int = 0, gold_decimals: int = 0,
                 rounding_min_decimals: int = 2) -> bool:
    """Compare two parsed values (sympy expressions, Seq, Rel, Matrix), `a` being the prediction."""
    kw = {"rel_tol": rel_tol}
    a, b = _canon(a), _canon(b)
    # a one-item set is its item: "\{-1\}" vs "-1"
    if isinstance(a, Seq) and a.kind == "set" and len(a.items) == 1 and not (isinstance(b, Seq) and b.kind == "set"):
        return values_equal(a.items[0], b, rel_tol=rel_tol, pred_decimals=pred_decimals, gold_decimals=gold_decimals)
    if isinstance(b, Seq) and b.kind == "set" and len(b.items) == 1 and not (isinstance(a, Seq) and a.kind == "set"):
        return values_equal(a, b.items[0], rel_tol=rel_tol, pred_decimals=pred_decimals, gold_decimals=gold_decimals)
    if isinstance(a, Rel) or isinstance(b, Rel):
        if isinstance(a, Rel) and isinstance(b, Rel):
            return _rel_equal(a, b, **kw)
        if isinstance(a, Rel):
            side = _answer_side(a)
            return side is not None and values_equal(side, b, rel_tol=rel_tol, pred_decimals=pred_decimals, gold_decimals=gold_decimals)
        side = _answer_side(b)
        return side is not None and values_equal(a, side, rel_tol=rel_tol, pred_decimals=pred_decimals, gold_decimals=gold_decimals)
    if isinstance(a, Matrix) or isinstance(b, Matrix):
        if isinstance(a, Matrix) and isinstance(b, Matrix):
            if len(a.rows) != len(b.rows) or len(a.rows[0]) != len(b.rows[0]):
                return False
            return all(values_equal(x, y, **kw) for ra, rb in zip(a.rows, b.rows) for x, y in zip(ra, rb))
        if isinstance(a, Matrix) and isinstance(b, Seq):
            return _matrix_vs_tuple(a, b, **kw)
        if isinstance(b, Matrix) and isinstance(a, Seq):
            return _matrix_vs_tuple(b, a, **kw)
        return False
    if isinstance(a, Seq) or isinstance(b, Seq):
        if isinstance(a, Seq) and isinstance(b, Seq) and b.kind == "tuple":
            a = _named_list_as_tuple(a) or a
        if not (isinstance(a, Seq) and isinstance(b, Seq)) or len(a.items) != len(b.items):
            return False
        if a.kind != b.kind:
            return False
        if a.kind == "tuple":
            if (a.open, a.close) != (b.open, b.close):
                return False
            return all(values_equal(x, y, **kw) for x, y in zip(a.items, b.items))
        remaining = list(b.items)
        for x in a.items:
            for j, y in enumerate(remaining):
                if values_equal(x, y, **kw):
                    del remaining[j]
                    break
            else:
                return False
        return True
    return _expr_equal(a, b, rel_tol, pred_decimals, gold_decimals, rounding_min_decimals)


def _candidates(p: ParsedAnswer) -> list:
    if p.percent and isinstance(p.value, sympy.Basic):
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
    pd, gd = _decimal_places(pred), _decimal_places(gold)
    for i, x in enumerate(_candidates(p)):
        for j, y in enumerate(_candidates(g)):
            # a percentage read as a fraction has two more decimal places than written
            if values_equal(x, y, rel_tol=rel_tol, pred_decimals=pd + 2 * i if pd else 0,
                            gold_decimals=gd + 2 * j if gd else 0, rounding_min_decimals=rounding_min_decimals):
                return True
    return False
