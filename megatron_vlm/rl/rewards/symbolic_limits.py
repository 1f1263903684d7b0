"""Up-front size limits for symbolic work on parsed answers.

Why: sympy's expand / cancel on an adversarial answer (`(a+b+c+d)^{1000}`) can run for minutes, and
a reward worker's timeout kills the whole verification. Every symbolic step in math_equiv.py and
relations.py first asks `too_big`, and an answer over the limits is "not equal" without any work.
"""
from __future__ import annotations

import sympy

__all__ = ["MAX_SYMBOLIC_OPS", "MAX_SYMBOLIC_DEGREE", "MAX_ITEM_PAIRS", "too_big"]

MAX_SYMBOLIC_OPS = 120
"""Expressions with more operations than this are not compared symbolically (answer: not equal)."""
MAX_SYMBOLIC_DEGREE = 24
"""Powers of a symbolic base above this exponent are not expanded (answer: not equal)."""
MAX_ITEM_PAIRS = 256
"""Two lists / sets whose item counts multiply to more than this are not compared (not equal)."""


def too_big(e: sympy.Basic) -> bool:
    """More than MAX_SYMBOLIC_OPS operations, or a power of a symbolic (or trigonometric) base whose
    exponent is symbolic or above MAX_SYMBOLIC_DEGREE."""
    if sympy.count_ops(e, visual=False) > MAX_SYMBOLIC_OPS:
        return True
    for p in e.atoms(sympy.Pow):
        if p.base.free_symbols or p.base.has(sympy.sin, sympy.cos, sympy.tan, sympy.log, sympy.exp):
            exp = p.exp
            if (not exp.is_Number or abs(exp) > MAX_SYMBOLIC_DEGREE) and (exp.is_Number or exp.free_symbols):
                return True
    return False
