"""A small, safe LaTeX-math parser that builds sympy objects directly.

Why our own parser: model outputs are untrusted, and sympy's text parsers (`sympify`, `parse_expr`)
evaluate Python code. Here the text is first normalised, then split into a whitelisted token set
(numbers, single letters, a fixed list of LaTeX commands, operators and brackets); any other
character or command rejects the input. A recursive-descent parser then calls sympy constructors
(Integer, Rational, Symbol, Add, Mul, Pow, sqrt, sin, ...) — nothing is ever evaluated as code.
Size limits (characters, tokens, nesting depth, digits, integer exponents) keep adversarial inputs
from making sympy compute huge numbers.

Covered: integers, decimals, thousands separators (1,000 / 1{,}000 / 1\\,000), \\frac / \\dfrac (also
\\frac12), \\sqrt and \\sqrt[n], powers, implicit multiplication (2\\sqrt{3}, 3\\pi, 2x; never two
numbers: "2 3" is rejected), unary minus, \\pi, \\infty, Greek letters, subscripted symbols,
trig / log functions (\\sin 2x is sin(2x)), |abs|, n!, percentages ("%", "\\%", "percent"), degrees,
trailing units and \\text{} words (dropped), relations (=, <, >, \\le, \\ge, \\ne, chains such as
-1 < x \\le 4; `Rel`), "x \\in S" (S), tuples / intervals (ordered, bracket kinds kept), \\cup of
intervals, \\mathbb{R}, \\emptyset, \\{sets\\} / bare comma or semicolon lists and "or" / "and" lists
(unordered), set-builder sets "\\{x \\mid x > 3\\}" (the condition), ratios "a:b:c" (`Seq` "ratio"), a
function named with its variable on a relation's side ("P(t) = 2t", "-1 < g(t) < 2": a sympy
undefined function applied to t), \\pm / \\mp (the set of both readings) and matrices (pmatrix /
bmatrix / matrix / array; `Matrix`). The text is first rewritten by latex_normalize.normalize_latex.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Union

import sympy

from megatron_vlm.rl.rewards.latex_normalize import QualifiedAnswer, normalize_latex, split_domain

__all__ = ["LatexParseError", "Seq", "Rel", "Matrix", "ParsedAnswer", "normalize_latex", "parse_latex", "MAX_INPUT_CHARS"]

MAX_INPUT_CHARS = 512
MAX_TOKENS = 256
MAX_DEPTH = 48
MAX_DIGITS = 40
MAX_INT_EXPONENT = 1000
MAX_RESULT_BITS = 20000
MAX_FACTORIAL = 100


class LatexParseError(ValueError):
    """The text is not in the supported LaTeX-math subset."""


@dataclass(frozen=True)
class Seq:
    """A tuple / interval (ordered), a set / bare list (unordered) or a ratio `a:b:c` of parsed items."""

    kind: str  # "tuple" | "set" | "ratio"
    items: tuple
    open: str = ""
    close: str = ""


@dataclass(frozen=True)
class Rel:
    """A relation or a chain of them: sides[0] ops[0] sides[1] ops[1] sides[2] ... The operators are
    "=", "<", ">", "<=", ">=", "!="."""

    ops: tuple
    sides: tuple


@dataclass(frozen=True)
class Matrix:
    """A matrix (rows of sympy expressions); a vector is a one-column or one-row matrix."""

    rows: tuple


Value = Union[sympy.Basic, Seq, Rel, Matrix]
_RELOPS = {"=": "=", "<": "<", ">": ">", "≤": "<=", "≥": ">=", "≠": "!="}
MAX_PM = 4
MAX_RATIO_PARTS = 8


@dataclass(frozen=True)
class ParsedAnswer:
    value: Value
    percent: bool
    """The text ended in a percent sign (the value is the number before it, not divided by 100)."""


_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi", "chi", "psi", "omega", "Gamma",
    "Delta", "Theta", "Lambda", "Xi", "Sigma", "Upsilon", "Phi", "Psi", "Omega",
}
_FUNCS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec, "csc": sympy.csc,
    "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan, "sinh": sympy.sinh, "cosh": sympy.cosh,
    "tanh": sympy.tanh, "ln": sympy.log, "log": sympy.log, "exp": sympy.exp,
}
_TOKEN = re.compile(r"\s*(?:(\\[{}])|(\\[A-Za-z]+)|(\d+(?:\.\d*)?|\.\d+)|([A-Za-z])|([-+*/^_(){}\[\],=!|%&<>≤≥≠∈:]))")
_COMMANDS = {"frac", "sqrt", "pi", "infty", "binom", "cup", "reals", "emptyset", "matbegin", "matend", "rowsep"}
def _tokenize(s: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    s = s.rstrip()
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None or m.end() == pos:
            raise LatexParseError(f"unsupported character {s[pos:].lstrip()[:1]!r}")
        pos = m.end()
        esc, cmd, num, letter, op = m.groups()
        if esc:
            tokens.append(("LSET" if esc == "\\{" else "RSET", esc))
        elif cmd:
            name = cmd[1:]
            if name not in _FUNCS and name not in _GREEK and name not in _COMMANDS:
                raise LatexParseError(f"unsupported command \\{name}")
            tokens.append(("CMD", name))
        elif num:
            # "2 3" is two numbers, never 6 (but "\log_2 8" and "x^2 3" are fine)
            if tokens and tokens[-1][0] == "NUM" and not (len(tokens) > 1 and tokens[-2] in (("OP", "_"), ("OP", "^"))):
                raise LatexParseError("two numbers in a row")
            if len(num.replace(".", "")) > MAX_DIGITS:
                raise LatexParseError("number too long")
            tokens.append(("NUM", num))
        elif letter:
            tokens.append(("LETTER", letter))
        else:
            tokens.append(("OP", op))
        if len(tokens) > MAX_TOKENS:
            raise LatexParseError("expression too long")
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.toks = tokens
        self.i = 0
        self.depth = 0
        self.abs_depth = 0  # inside |...| a '|' closes instead of opening a nested abs

    # -- helpers ---------------------------------------------------------------------------------
    def peek(self, k: int = 0):
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else ("EOF", "")

    def take(self):
        t = self.peek()
        if t[0] == "EOF":
            raise LatexParseError("unexpected end of input")
        self.i += 1
        return t

    def expect_op(self, op: str):
        t = self.take()
        if t != ("OP", op):
            raise LatexParseError(f"expected {op!r}, got {t[1]!r}")

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise LatexParseError("nesting too deep")

    # -- grammar -----------------------------------------------------------------------------------
    def parse_top(self) -> Value:
        items = [self.relation()]
        while self.peek() == ("OP", ","):
            self.take()
            items.append(self.relation())
        if self.peek()[0] != "EOF":
            raise LatexParseError(f"unexpected {self.peek()[1]!r}")
        if len(items) == 1:
            return items[0]
        return Seq("set", tuple(items))

    def relation(self) -> Value:
        # "x = 5", "(x, y) = (1, 2)", "-1 < x \le 4"; "x \in S" is S
        sides = [self.side()]
        ops: list[str] = []
        while self.peek()[0] == "OP" and self.peek()[1] in _RELOPS or self.peek() == ("OP", "∈"):
            op = self.take()[1]
            if op == "∈":
                if ops or len(sides) != 1:
                    raise LatexParseError("unsupported use of \\in")
                return self.union()
            ops.append(_RELOPS[op])
            sides.append(self.side())
            if len(ops) > 3:
                raise LatexParseError("relation chain too long")
        if not ops:
            return sides[0]
        return Rel(tuple(ops), tuple(sides))

    def side(self) -> Value:
        """One side of a relation: a function named with its variable ("P(t)" in "P(t) = 2t + 1", "g(t)"
        in "-1 < g(t) < 2"), a ratio "a:b:c", or a union / sequence / expression."""
        if (self.peek()[0] == "LETTER" and self.peek(1) == ("OP", "(") and self.peek(2)[0] == "LETTER"
                and self.peek(3) == ("OP", ")") and self.peek(4)[0] == "OP" and self.peek(4)[1] in _RELOPS):
            name, var = self.peek()[1], self.peek(2)[1]
            self.i += 4
            return sympy.Function(name)(sympy.Symbol(var))
        parts = [self.union()]
        while self.peek() == ("OP", ":"):
            self.take()
            parts.append(self.union())
            if len(parts) > MAX_RATIO_PARTS:
                raise LatexParseError("ratio too long")
        if len(parts) == 1:
            return parts[0]
        if not all(isinstance(p, sympy.Basic) for p in parts) or any(p == 0 for p in parts):
            raise LatexParseError("unsupported ratio")
        return Seq("ratio", tuple(parts))

    def union(self) -> Value:
        items = [self.sequence_or_expr()]
        while self.peek() == ("CMD", "cup"):
            self.take()
            items.append(self.sequence_or_expr())
        if len(items) == 1:
            return items[0]
        flat: list[Value] = []
        for it in items:
            flat.extend(it.items if isinstance(it, Seq) and it.kind == "set" else (it,))
        return Seq("set", tuple(flat))

    _SEQ_FOLLOW = {("EOF", ""), ("OP", ","), ("OP", ")"), ("OP", "]"), ("RSET", "\\}"), ("CMD", "cup")} | {
        ("OP", op) for op in _RELOPS
    }

    def sequence_or_expr(self) -> Value:
        t = self.peek()
        if t == ("OP", "(") or t == ("OP", "["):
            # a bracketed list standing alone (tuple / interval) — otherwise a normal expression
            save = self.i
            try:
                seq = self.bracket_list()
            except LatexParseError:
                seq = None
            if isinstance(seq, (Seq, Matrix)) and self.peek() in self._SEQ_FOLLOW:
                return seq
            self.i = save
            self.depth = 0 if self.depth < 0 else self.depth
        if t[0] == "LSET":
            return self.set_literal()
        if t == ("CMD", "reals"):
            self.take()
            return Seq("tuple", (-sympy.oo, sympy.oo), "(", ")")
        if t == ("CMD", "emptyset"):
            self.take()
            return Seq("set", ())
        if t == ("CMD", "matbegin"):
            return self.matrix()
        return self.expr()

    def matrix(self) -> Matrix:
        self.take()
        self.enter()
        rows, row = [], [self.expr()]
        while True:
            t = self.take()
            if t == ("OP", "&"):
                row.append(self.expr())
            elif t == ("CMD", "rowsep"):
                rows.append(tuple(row))
                if self.peek() == ("CMD", "matend"):
                    self.take()
                    break
                row = [self.expr()]
            elif t == ("CMD", "matend"):
                rows.append(tuple(row))
                break
            else:
                raise LatexParseError(f"unexpected {t[1]!r} in a matrix")
        self.depth -= 1
        if len({len(r) for r in rows}) != 1:
            raise LatexParseError("ragged matrix")
        return Matrix(tuple(rows))

    def bracket_list(self) -> Value:
        open_t = self.take()[1]
        self.enter()
        items = [self.relation()]
        while self.peek() == ("OP", ","):
            self.take()
            items.append(self.relation())
        close = self.take()
        if close not in (("OP", ")"), ("OP", "]")):
            raise LatexParseError(f"expected a closing bracket, got {close[1]!r}")
        self.depth -= 1
        if len(items) == 1 and not isinstance(items[0], Seq) and (open_t + close[1]) in ("()", "[]"):
            return items[0]
        return Seq("tuple", tuple(items), open_t, close[1])

    def set_literal(self) -> Value:
        self.take()
        self.enter()
        builder = self.set_builder_start()
        if builder:  # "\{x \mid x > 3\}" is the relation's solution set (an interval once compared);
            # conditions joined by "or" (a comma here) are a union
            conds = [self.relation()]
            while self.peek() == ("OP", ","):
                self.take()
                conds.append(self.relation())
            if self.take()[0] != "RSET":
                raise LatexParseError("unsupported set-builder condition")
            self.depth -= 1
            return conds[0] if len(conds) == 1 else Seq("set", tuple(conds))
        items = []
        if self.peek()[0] != "RSET":
            items.append(self.relation())
            while self.peek() == ("OP", ","):
                self.take()
                items.append(self.relation())
        if self.take()[0] != "RSET":
            raise LatexParseError("unclosed \\{")
        self.depth -= 1
        return Seq("set", tuple(items))

    def set_builder_start(self) -> bool:
        r"""At "x |", "x :" or "x \in \mathbb{R} |" after "\{": consume it."""
        if self.peek()[0] != "LETTER":
            return False
        k = 1
        if self.peek(1) == ("OP", "∈") and self.peek(2) == ("CMD", "reals"):
            k = 3
        if self.peek(k) in (("OP", "|"), ("OP", ":")):
            self.i += k + 1
            return True
        return False

    def expr(self) -> sympy.Basic:
        left = self.term()
        while self.peek() in (("OP", "+"), ("OP", "-")):
            op = self.take()[1]
            right = self.term()
            left = left + right if op == "+" else left - right
        return left

    def _starts_atom(self) -> bool:
        kind, val = self.peek()
        if kind == "CMD":
            return val in _FUNCS or val in _GREEK or val in ("frac", "sqrt", "pi", "infty", "binom")
        return kind in ("NUM", "LETTER", "LSET") or (kind == "OP" and val in ("(", "{", "|"))

    def term(self) -> sympy.Basic:
        left = self.unary()
        while True:
            t = self.peek()
            if t in (("OP", "*"), ("OP", "/")):
                self.take()
                right = self.unary()
                if t[1] == "*":
                    left = left * right
                else:
                    if right == 0:
                        raise LatexParseError("division by zero")
                    left = left / right
            elif self._starts_atom() and not (t == ("OP", "|") and self.abs_depth > 0):
                left = left * self.power()
            else:
                return left

    def unary(self) -> sympy.Basic:
        t = self.peek()
        if t == ("OP", "-"):
            self.take()
            return -self.unary()
        if t == ("OP", "+"):
            self.take()
            return self.unary()
        return self.power()

    def power(self) -> sympy.Basic:
        base = self.postfix()
        if self.peek() == ("OP", "^"):
            self.take()
            exp = self.exponent()
            base = self._pow(base, exp)
        return base

    def _pow(self, base, exp):
        if exp.is_Number:
            if abs(exp) > MAX_INT_EXPONENT:
                raise LatexParseError("exponent too large")
            if base.is_Rational:
                bits = max(abs(base.p).bit_length(), base.q.bit_length())
                if bits * abs(float(exp)) > MAX_RESULT_BITS:
                    raise LatexParseError("power too large")
        elif base.is_Number and abs(base) != 1 and exp.is_number:
            try:
                if abs(complex(exp)) > MAX_INT_EXPONENT:
                    raise LatexParseError("exponent too large")
            except (TypeError, ValueError):
                raise LatexParseError("unsupported exponent") from None
        if base == 0 and exp.is_Number and exp < 0:
            raise LatexParseError("division by zero")
        return sympy.Pow(base, exp)

    def exponent(self) -> sympy.Basic:
        t = self.peek()
        if t == ("OP", "{"):
            return self.group()
        if t == ("OP", "-"):
            self.take()
            return -self.exponent()
        if t[0] == "NUM":  # x^23 is x^{2}3 in LaTeX
            self.take()
            if len(t[1]) > 1 and t[1][0] != ".":
                self.toks.insert(self.i, ("NUM", t[1][1:]))
            return self.number(t[1][0])
        return self.postfix()

    def postfix(self) -> sympy.Basic:
        value = self.atom()
        while self.peek() == ("OP", "!"):
            self.take()
            if not (value.is_Integer and 0 <= value <= MAX_FACTORIAL):
                raise LatexParseError("factorial of a non-integer or too large a number")
            value = sympy.factorial(value)
        return value

    def number(self, text: str) -> sympy.Basic:
        f = Fraction(text)  # digits and one '.', checked by the tokenizer
        return sympy.Rational(f.numerator, f.denominator)

    def group(self) -> sympy.Basic:
        self.expect_op("{")
        self.enter()
        value = self.expr()
        self.expect_op("}")
        self.depth -= 1
        return value

    def frac_arg(self) -> sympy.Basic:
        t = self.peek()
        if t == ("OP", "{"):
            return self.group()
        if t[0] == "NUM":  # \frac12
            self.take()
            if len(t[1]) > 1:
                self.toks.insert(self.i, ("NUM", t[1][1:]))
            return self.number(t[1][0])
        if t[0] == "LETTER":
            self.take()
            return sympy.Symbol(t[1])
        raise LatexParseError("malformed \\frac")

    def symbol(self, name: str) -> sympy.Basic:
        if self.peek() == ("OP", "_"):
            self.take()
            t = self.take()
            if t == ("OP", "{"):
                parts = []
                while self.peek() != ("OP", "}"):
                    k, v = self.take()
                    if k not in ("NUM", "LETTER"):
                        raise LatexParseError("unsupported subscript")
                    parts.append(v)
                self.take()
                sub = "".join(parts)
            elif t[0] in ("NUM", "LETTER"):
                sub = t[1][0]
                if t[0] == "NUM" and len(t[1]) > 1:
                    self.toks.insert(self.i, ("NUM", t[1][1:]))
            else:
                raise LatexParseError("unsupported subscript")
            name = f"{name}_{sub}"
        return sympy.Symbol(name)

    def function_call(self, name: str) -> sympy.Basic:
        fn = _FUNCS[name]
        base = None
        if name == "log" and self.peek() == ("OP", "_"):
            self.take()
            base = self.group() if self.peek() == ("OP", "{") else self.atom()
        power = None
        if self.peek() == ("OP", "^"):  # \sin^2 x
            self.take()
            power = self.exponent()
        if self.peek() == ("OP", "("):
            self.take()
            self.enter()
            arg = self.expr()
            self.expect_op(")")
            self.depth -= 1
        elif self.peek() == ("OP", "{"):
            arg = self.group()
        else:  # "\sin 2x" is sin(2x): the following run of numbers / letters / constants
            arg = self.power()
            while self.peek()[0] == "LETTER" or self.peek()[0] == "CMD" and (self.peek()[1] in _GREEK or self.peek()[1] == "pi"):
                arg = arg * self.power()
        value = fn(arg) if base is None else sympy.log(arg, base)
        return self._pow(value, power) if power is not None else value

    def atom(self) -> sympy.Basic:
        self.enter()
        try:
            kind, val = self.take()
            if kind == "NUM":
                return self.number(val)
            if kind == "LETTER":
                return self.symbol(val)
            if kind == "OP" and val == "(":
                value = self.expr()
                self.expect_op(")")
                return value
            if kind == "OP" and val == "{":
                value = self.expr()
                self.expect_op("}")
                return value
            if kind == "OP" and val == "|":
                self.abs_depth += 1
                value = self.expr()
                self.abs_depth -= 1
                self.expect_op("|")
                return sympy.Abs(value)
            if kind == "CMD":
                if val == "frac":
                    num = self.frac_arg()
                    den = self.frac_arg()
                    if den == 0:
                        raise LatexParseError("division by zero")
                    return num / den
                if val == "binom":
                    n, k = self.frac_arg(), self.frac_arg()
                    if not (n.is_Integer and k.is_Integer and 0 <= k <= n <= 1000):
                        raise LatexParseError("unsupported \\binom")
                    return sympy.binomial(n, k)
                if val == "sqrt":
                    index = None
                    if self.peek() == ("OP", "["):
                        self.take()
                        index = self.expr()
                        self.expect_op("]")
                        if not (index.is_Integer and 2 <= index <= MAX_INT_EXPONENT):
                            raise LatexParseError("unsupported root index")
                    arg = self.group() if self.peek() == ("OP", "{") else self.postfix()
                    return sympy.sqrt(arg) if index is None else sympy.root(arg, index)
                if val == "pi":
                    return sympy.pi
                if val == "infty":
                    return sympy.oo
                if val in _GREEK:
                    return self.symbol(val)
                if val in _FUNCS:
                    return self.function_call(val)
            raise LatexParseError(f"unexpected {val!r}")
        finally:
            self.depth -= 1


def parse_latex(text: str) -> ParsedAnswer:
    """Parse an answer string; raises LatexParseError if it is outside the supported subset."""
    if not isinstance(text, str):
        raise LatexParseError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_INPUT_CHARS:
        raise LatexParseError("answer too long")
    text, integer = split_domain(text)
    try:
        norm, percent = normalize_latex(text)
    except QualifiedAnswer as e:
        raise LatexParseError(str(e)) from None
    if not norm:
        raise LatexParseError("empty answer")
    parsed = _parse_pm(norm, percent)
    if integer is None:
        return parsed
    return ParsedAnswer(rename(parsed.value, {sympy.Symbol(integer): INTEGER_PARAMETER}), parsed.percent)


INTEGER_PARAMETER = sympy.Symbol("ℤ")
"""The integer parameter of a periodic answer ("k" in "k \\in \\mathbb{Z}"), whatever letter it had."""


def rename(v, mapping: dict):
    """Substitute symbols throughout a parsed value (a function's variable, an integer parameter)."""
    if isinstance(v, sympy.Basic):
        return v.xreplace(mapping)
    if isinstance(v, Seq):
        return Seq(v.kind, tuple(rename(i, mapping) for i in v.items), v.open, v.close)
    if isinstance(v, Rel):
        return Rel(v.ops, tuple(rename(i, mapping) for i in v.sides))
    if isinstance(v, Matrix):
        return Matrix(tuple(tuple(rename(i, mapping) for i in row) for row in v.rows))
    return v


def _parse_pm(norm: str, percent: bool) -> ParsedAnswer:
    n_pm = len(re.findall(r"\\(?:pm|mp)(?![A-Za-z])", norm))
    if n_pm == 0:
        return ParsedAnswer(_parse_tokens(norm), percent)
    if n_pm > MAX_PM:
        raise LatexParseError("too many \\pm")
    # "a \pm b" is the set {a + b, a - b} (every \pm read the same way, \mp the other)
    items: list[Value] = []
    for plus, minus in (("+", "-"), ("-", "+")):
        variant = re.sub(r"\\pm(?![A-Za-z])", plus, norm)
        variant = re.sub(r"\\mp(?![A-Za-z])", minus, variant)
        value = _parse_tokens(variant)
        items.extend(value.items if isinstance(value, Seq) and value.kind == "set" else (value,))
    return ParsedAnswer(Seq("set", tuple(items)), percent)


def _parse_tokens(norm: str) -> Value:
    tokens = _tokenize(norm)
    try:
        return _Parser(tokens).parse_top()
    except RecursionError:
        raise LatexParseError("nesting too deep") from None
    except (TypeError, ZeroDivisionError, ArithmeticError) as e:
        raise LatexParseError(f"cannot build the expression: {type(e).__name__}") from None
