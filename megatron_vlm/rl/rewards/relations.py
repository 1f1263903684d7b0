"""Relations as answers: named values, inequalities as intervals, solutions written as equations.

Why: the same answer is written as a relation in one place and as a value in another. A gold
`|PQ| = 2` is answered `2`; `-1 < g(t) < 2` is the interval `(-1, 2)`; `2 \\le |w| \\le 3` is
`[-3, -2] \\cup [2, 3]`; `x=1, y=2; x=3, y=0` is the solution set `(1, 2), (3, 0)`; `P(t) = 2t + 1`
is `P(x) = 2x + 1`. Each rule here turns one form into the other exactly (never by guessing): a
left side counts as the *name* of the answer only if it is a symbol, a product or quotient of
symbols (`x`, `ABC`, `AE/EC`), a length `|PQ|`, a ratio of names (`S_1:S_2`), a function of its
variable (`P(t)`) or a tuple of names; `x^2 = 4` or `2x = 10` are equations, not names. The order a
ratio names is kept: `S_2:S_1 = 9:5` is `S_1:S_2 = 5:9`, `9:5` is not.

Comparison of the values themselves is passed in (`eq`, math_equiv.values_equal), so this module
has no sympy expansion of its own beyond linear coefficients, and every symbolic step is bounded by
symbolic_limits.too_big first.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import sympy
from sympy.core.function import AppliedUndef

from megatron_vlm.rl.rewards.latex_math import Rel, Seq, rename
from megatron_vlm.rl.rewards.symbolic_limits import too_big

__all__ = ["is_name", "as_interval", "answer_side", "named_solutions", "by_names", "rel_equal"]

_ORDER = {"<": 0, "<=": 0, ">": 1, ">=": 1}
_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "=": "=", "!=": "!="}
Eq = Callable[[object, object], bool]


# --- names -------------------------------------------------------------------------------------------


def _symbol_quotient(v) -> bool:
    """A product of symbols and lengths, each to the power 1 or -1, with at least one in the numerator."""
    factors = v.args if isinstance(v, sympy.Mul) else (v,)
    up = 0
    for f in factors:
        if isinstance(f, sympy.Symbol) or isinstance(f, sympy.Abs) and _symbol_quotient(f.args[0]):
            up += 1
        elif not (isinstance(f, sympy.Pow) and f.exp == -1 and _symbol_quotient(f.base)):
            return False
    return up > 0


_NAMED_FUNCS = (sympy.sin, sympy.cos, sympy.tan, sympy.cot, sympy.sec, sympy.csc)


def is_name(v) -> bool:
    """x, x_1, ABC, |PQ|, AE/EC, S_1:S_2, P(t), \\cos A, (x, y): the thing an equation's left side
    asks for."""
    if isinstance(v, Seq):
        return v.kind in ("tuple", "ratio") and all(is_name(i) for i in v.items)
    if isinstance(v, AppliedUndef):
        return all(isinstance(a, sympy.Symbol) for a in v.args)
    if isinstance(v, _NAMED_FUNCS):  # "\\tan \\alpha = -\\frac43": the value of tan(alpha)
        return isinstance(v.args[0], sympy.Symbol)
    if isinstance(v, sympy.Add):  # "a + b = 5", "AB + BC = 7" (no coefficients: "a - b", "2a + b" are not)
        return all(_symbol_quotient(t) for t in v.args)
    return isinstance(v, sympy.Basic) and _symbol_quotient(v)


def _quotient(v):
    """A two-part ratio as the quotient it stands for; anything else unchanged."""
    if isinstance(v, Seq) and v.kind == "ratio" and len(v.items) == 2:
        return v.items[0] / v.items[1]
    return v


def _segment(v):
    """|PQ| and PQ name the same length (two or more letters); |x| and x do not."""
    if isinstance(v, sympy.Abs) and isinstance(v.args[0], sympy.Mul) and _symbol_quotient(v.args[0]):
        return v.args[0]
    return v


def _same_name(a, b) -> bool:
    if a == b:
        return True
    qa, qb = _quotient(a), _quotient(b)
    return isinstance(qa, sympy.Basic) and isinstance(qb, sympy.Basic) and (qa == qb or _segment(qa) == _segment(qb))


def _reciprocal_names(a, b) -> bool:
    qa, qb = _quotient(a), _quotient(b)
    if isinstance(qa, sympy.Basic) and isinstance(qb, sympy.Basic):
        return qa * qb == 1 and qa != qb
    return (isinstance(a, Seq) and isinstance(b, Seq) and a.kind == b.kind == "ratio" and a.items == b.items[::-1]
            and a.items != b.items)


def _reversed_value(v):
    if isinstance(v, Seq) and v.kind == "ratio":
        return Seq("ratio", v.items[::-1])
    if isinstance(v, sympy.Basic) and v != 0:
        return 1 / v
    return None


def _named_equal(na, va, nb, vb, eq: Eq) -> bool:
    """Two equations with named left sides: same name (P(t) and P(x) after renaming the variable,
    |PQ| and PQ, S_1:S_2 and S_1/S_2) and equal values, or reversed names and reversed values."""
    if isinstance(na, AppliedUndef) or isinstance(nb, AppliedUndef):
        if not (isinstance(na, AppliedUndef) and isinstance(nb, AppliedUndef)):
            return False
        if na.func != nb.func or len(na.args) != len(nb.args) or len(set(na.args)) != len(na.args):
            return False
        return eq(va, rename(vb, dict(zip(nb.args, na.args))))
    if _same_name(na, nb):
        return eq(va, vb)
    if _reciprocal_names(na, nb):
        rv = _reversed_value(va)
        return rv is not None and eq(rv, vb)
    return False


def answer_side(r: Rel):
    """The value an equation states, "x = 5" -> 5 (chains "x = 4 = 2^2" -> the last side)."""
    if not all(op == "=" for op in r.ops):
        return None
    if is_name(r.sides[0]):
        return r.sides[-1]
    # a computation ending in its value, "3 \times 4 = 12": every side the same number
    last = r.sides[-1]
    if all(isinstance(s, sympy.Basic) and s.is_number for s in r.sides):
        try:
            if all(abs(complex(sympy.N(s - last, 30))) < 1e-9 for s in r.sides[:-1]):
                return last
        except (TypeError, ValueError, OverflowError):
            return None
    return None


# --- inequalities as intervals -------------------------------------------------------------------------


def _linear(u):
    """u = k*s + m in one variable s (a symbol, or a function of its variable such as g(t)), with a
    numeric k != 0: (k, m); else None."""
    if not isinstance(u, sympy.Basic):
        return None
    apps = u.atoms(AppliedUndef)
    if apps:
        if len(apps) > 1:
            return None
        s = sympy.Dummy()
        u = u.xreplace({apps.pop(): s})
        if u.free_symbols != {s}:
            return None
    else:
        if len(u.free_symbols) != 1:
            return None
        s = next(iter(u.free_symbols))
    if too_big(u):
        return None
    k = sympy.expand(sympy.diff(u, s))
    if k.free_symbols or k == 0 or not k.is_real:
        return None
    m = sympy.expand(u - k * s)
    if m.free_symbols:
        return None
    return k, m


def _interval(u, lo, hi, lo_closed: bool, hi_closed: bool) -> Optional[Seq]:
    """The interval of the variable when lo < u < hi (brackets as given) and u is linear in it."""
    found = _linear(u)
    if found is None:
        return None
    k, m = found
    a, b = (lo - m) / k, (hi - m) / k
    if k < 0:
        a, b, lo_closed, hi_closed = b, a, hi_closed, lo_closed
    inf = (sympy.oo, -sympy.oo)
    return Seq("tuple", (a, b), "[" if lo_closed and a not in inf else "(", "]" if hi_closed and b not in inf else ")")


def _abs_part(side):
    """c * |u| with a positive number c: (c, u); else None."""
    if isinstance(side, sympy.Abs):
        return sympy.Integer(1), side.args[0]
    if isinstance(side, sympy.Mul):
        absf = [f for f in side.args if isinstance(f, sympy.Abs)]
        if len(absf) == 1:
            c = side / absf[0]
            if c.is_number and c.is_positive:
                return c, absf[0].args[0]
    return None


def _is_bound(v, var_free=None) -> bool:
    return isinstance(v, sympy.Basic) and not isinstance(v, AppliedUndef) and (
        not v.free_symbols if var_free is None else not (v.free_symbols & var_free)
    )


def _abs_interval(u, lo, hi, lo_closed: bool, hi_closed: bool):
    """lo < |u| < hi with numeric bounds (lo may be None, hi may be oo): an interval or a union."""
    if hi is not sympy.oo and not (hi.is_number and hi.is_positive):
        return None
    if lo is None or (lo.is_number and (lo.is_negative or lo == 0 and lo_closed)):
        return _interval(u, -hi, hi, hi_closed, hi_closed)
    if not (lo.is_number and lo.is_nonnegative) or not bool(lo < hi):
        return None
    left = _interval(u, -hi, -lo, hi_closed, lo_closed)
    right = _interval(u, lo, hi, lo_closed, hi_closed)
    if left is None or right is None:
        return None
    return Seq("set", (left, right))


def as_interval(r: Rel) -> Optional[Seq]:
    """An inequality (or chain) in one variable as an interval (Seq tuple with its brackets) or a union
    of two (Seq set), else None: x > 3, 3 < x, 2x > 6, -1 < 2x + 1 < 5, -1 < g(t) < 2, |x - 1| <= 2,
    |x| > 2, 2 <= |w| <= 3."""
    if not all(isinstance(x, sympy.Basic) for x in r.sides) or not all(op in _ORDER for op in r.ops):
        return None
    if len(r.ops) == 1:
        op, (lhs, rhs) = r.ops[0], r.sides
        if op in (">", ">="):
            lhs, rhs, op = rhs, lhs, _FLIP[op]
        closed = op == "<="
        # lhs < rhs: |u| on one side and a number on the other
        left_abs, right_abs = _abs_part(lhs), _abs_part(rhs)
        if left_abs and _is_bound(rhs):
            c, u = left_abs
            return _abs_interval(u, None, rhs / c, False, closed)
        if right_abs and _is_bound(lhs):
            c, u = right_abs
            return _abs_interval(u, lhs / c, sympy.oo, closed, False)
        if lhs.free_symbols and _is_bound(rhs):  # u < c
            return _interval(lhs, -sympy.oo, rhs, False, closed)
        if rhs.free_symbols and _is_bound(lhs):  # c < u
            return _interval(rhs, lhs, sympy.oo, closed, False)
        found = _linear(lhs - rhs)  # variable on both sides: lhs - rhs < 0
        if found is None:
            return None
        return _interval(lhs - rhs, -sympy.oo, sympy.Integer(0), False, closed)
    if len(r.ops) == 2 and _ORDER[r.ops[0]] == _ORDER[r.ops[1]]:
        lo, mid, hi = r.sides
        ops = r.ops
        if _ORDER[ops[0]] == 1:  # 4 > x > -1
            lo, hi, ops = hi, lo, (_FLIP[ops[1]], _FLIP[ops[0]])
        mid_abs = _abs_part(mid)
        if mid_abs and _is_bound(lo) and _is_bound(hi):
            c, u = mid_abs
            return _abs_interval(u, lo / c, hi / c, ops[0] == "<=", ops[1] == "<=")
        var = mid.free_symbols | {a for a in mid.atoms(AppliedUndef)}
        if not _is_bound(lo, var) or not _is_bound(hi, var):
            return None
        return _interval(mid, lo, hi, ops[0] == "<=", ops[1] == "<=")
    return None


# --- equations and lists of them ---------------------------------------------------------------------------


def named_solutions(v) -> Optional[Seq]:
    """"x = 2, y = 3" -> (2, 3); "x=1, y=2; x=3, y=0" -> {(1, 2), (3, 0)}: equations whose symbol names
    repeat in the same blocks (in the order of the first block), else None."""
    if not (isinstance(v, Seq) and v.kind == "set" and len(v.items) > 1):
        return None
    if not all(isinstance(i, Rel) and i.ops == ("=",) and isinstance(i.sides[0], sympy.Symbol) for i in v.items):
        return None
    first: list = []
    for i in v.items:
        if i.sides[0] in first:
            break
        first.append(i.sides[0])
    k = len(first)
    if k < 2 or len(v.items) % k:
        return None
    groups = []
    for j in range(0, len(v.items), k):
        block = {i.sides[0]: i.sides[1] for i in v.items[j:j + k]}
        if set(block) != set(first):
            return None
        groups.append(Seq("tuple", tuple(block[n] for n in first), "(", ")"))
    return groups[0] if len(groups) == 1 else Seq("set", tuple(groups))


def by_names(eqs, r: Rel, eq: Eq) -> Optional[bool]:
    """Equations "y = 2, x = 1" against "(x, y) = (1, 2)": matched by name, in any order. None when
    the forms do not apply."""
    if not (isinstance(eqs, Seq) and eqs.kind == "set" and r.ops == ("=",)):
        return None
    names, values = r.sides
    if not (isinstance(names, Seq) and names.kind == "tuple" and all(isinstance(n, sympy.Symbol) for n in names.items)):
        return None
    if not (isinstance(values, Seq) and values.kind == "tuple" and len(values.items) == len(names.items)):
        return None
    if not all(isinstance(i, Rel) and i.ops == ("=",) and isinstance(i.sides[0], sympy.Symbol) for i in eqs.items):
        return None
    given = {i.sides[0]: i.sides[1] for i in eqs.items}
    if len(given) != len(eqs.items) or set(given) != set(names.items):
        return None
    return all(eq(given[n], v) for n, v in zip(names.items, values.items))


def rel_equal(a: Rel, b: Rel, eq: Eq) -> bool:
    """Two relations: named equations by name and value; other equations and inequalities when the
    sides flipped and multiplied out agree, (l1 - r1) = c * (l2 - r2) with c a constant (c > 0 for
    <, <=); chains side by side, or flipped."""
    if len(a.ops) == 1 and len(b.ops) == 1:
        if a.ops[0] == "=" == b.ops[0] and is_name(a.sides[0]) and is_name(b.sides[0]):
            if _named_equal(a.sides[0], a.sides[1], b.sides[0], b.sides[1], eq):
                return True
            if not (isinstance(a.sides[0], sympy.Add) or isinstance(b.sides[0], sympy.Add)):
                return False  # "a = 1.5" is not "b = 1.5", "y_1 = ..." not "y_2 = ...", "P(t)" not "Q(t)"
            if _same_name(a.sides[0], b.sides[0]) or not all(isinstance(x, sympy.Basic) for x in a.sides + b.sides):
                return False
            # a sum of names may still be the same equation as another: "x + y = 5" is "y = 5 - x"
        if not all(isinstance(x, sympy.Basic) for x in a.sides + b.sides):
            return (a.ops == b.ops and all(eq(x, y) for x, y in zip(a.sides, b.sides))) or (
                b.ops[0] == _FLIP[a.ops[0]] and all(eq(x, y) for x, y in zip(a.sides, b.sides[::-1]))
            )

        def canon(r: Rel):
            op, (lhs, rr) = r.ops[0], r.sides
            if op in (">", ">="):
                return _FLIP[op], rr - lhs
            return op, lhs - rr

        (op1, d1), (op2, d2) = canon(a), canon(b)
        if op1 != op2:
            return False
        if too_big(d1) or too_big(d2) or d2 == 0:
            return False
        try:
            ratio = sympy.cancel(sympy.expand(d1) / sympy.expand(d2))
        except (TypeError, ValueError, NotImplementedError, ZeroDivisionError):
            return False
        if ratio.free_symbols or not ratio.is_number or ratio == 0 or ratio.has(sympy.zoo, sympy.nan):
            return False
        return bool(ratio > 0) if op1 in ("<", "<=") else True
    if len(a.ops) == len(b.ops):
        if a.ops == b.ops and all(eq(x, y) for x, y in zip(a.sides, b.sides)):
            return True
        flipped = tuple(_FLIP[o] for o in b.ops[::-1])
        return a.ops == flipped and all(eq(x, y) for x, y in zip(a.sides, b.sides[::-1]))
    return False
