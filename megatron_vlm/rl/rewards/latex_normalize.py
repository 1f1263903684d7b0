"""Rewrite formatting-only LaTeX (and the words around an answer) into the parser's token subset.

Why a separate step: model answers mix math with typesetting (`\\left(`, `\\dfrac`, `\\,`), units
(`5 \\text{ cm}`), connectives (`1 \\text{ or } 2`) and whole sentences (`\\text{The minimum is } -2`,
`x = 3 is the only solution`). latex_math.py parses only a small whitelisted token set, so
everything that does not change the value is rewritten or dropped here first, with plain regular
expressions over at most MAX_INPUT_CHARS characters (linear, nothing evaluated).

Words are the risky part: dropping "not" from "x = 3 is not a solution" would score a wrong
answer as right. So words that qualify or negate a value ("not", "no", "except", "at least",
"less than", "approximately", "if", ...) make the whole answer unparseable (it can then only match
the gold answer as text), while only a fixed list of filler words ("the", "is", "value",
"minimum", "answer", "solution", ...) is removed; any other word stays and is read as a product of
letters, which matches nothing numeric.
"""
from __future__ import annotations

import re

__all__ = ["QualifiedAnswer", "normalize_latex", "split_domain"]


class QualifiedAnswer(ValueError):
    """The answer text negates or qualifies its value (e.g. "not 3", "at least 4")."""


UNIT_WORDS = {
    "cm", "mm", "m", "km", "in", "inch", "inches", "ft", "feet", "foot", "yd", "yard", "yards", "mi", "mile", "miles",
    "unit", "units", "degree", "degrees", "deg", "radian", "radians", "rad", "sq", "square", "cubic", "meter", "meters",
    "metre", "metres", "centimeter", "centimeters", "millimeter", "millimeters", "kilometer", "kilometers", "second",
    "seconds", "sec", "minute", "minutes", "min", "hour", "hours", "hr", "hrs", "kg", "g", "gram", "grams", "lb", "lbs",
    "pound", "pounds", "dollar", "dollars", "cent", "cents", "percent", "liter", "liters", "l", "ml", "cm2", "m2", "cm3",
    "m3", "mph", "kmh", "s", "h", "mg", "km/h", "m/s", "ways", "people", "students", "days", "weeks", "years",
}
QUALIFIERS = {
    "not", "no", "none", "never", "neither", "nor", "except", "excluding", "without", "cannot", "impossible",
    "undefined", "least", "most", "more", "less", "fewer", "than", "greater", "smaller", "larger", "between",
    "above", "below", "exceed", "exceeds", "under", "over", "approximately", "approx", "about", "around", "nearly",
    "almost", "roughly", "maybe", "perhaps", "possibly", "unless", "if", "when", "whenever", "where", "while",
    "until", "before", "after", "because", "since", "minus", "plus", "times", "half", "twice", "double",
    "triple", "isn", "doesn", "aren", "wrong", "incorrect", "false", "other", "otherwise", "but", "however",
    "rejected", "reject", "extraneous", "invalid", "discard", "discarded",
}
"""Words that change what the value next to them means; an answer containing one is not parsed."""
FILLER = {
    "the", "a", "an", "is", "are", "was", "be", "it", "its", "this", "that", "which", "so", "thus", "hence",
    "therefore", "we", "get", "got", "have", "has", "obtain", "find", "found", "answer", "answers", "final",
    "value", "values", "solution", "solutions", "only", "unique", "result", "required", "equals", "equal",
    "to", "of", "yes", "there", "exactly", "minimum", "maximum", "smallest", "largest", "greatest",
    "total", "number", "area", "length", "perimeter", "volume", "distance", "probability", "ratio",
    "vector", "matrix", "point", "coordinates", "measure", "angle", "side", "radius", "height",
    "root", "roots", "zero", "zeros", "real", "possible", "all",
    "correct", "option", "choice", "then", "given", "by", "expression", "equation", "function", "as", "follows",
    "projection", "center", "centre", "slope", "intercept", "vertex", "focus", "term", "general", "formula",
    "sequence", "speed", "time", "price", "cost", "rate", "age", "range", "domain", "set", "solved", "satisfies",
    "coordinate", "our", "becomes", "gives", "simplifies", "simplified",
}
"""Words a model writes around an answer without changing its value; they are removed. (Not "sum",
"product", "max", ...: "the product of 3 and 5" must not become the list 3, 5.)"""

_TEXT_BLOCK = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}(\s*\^\s*\{?\s*[23]\s*\}?)?"
)
_CONNECTIVES = {"or", "and"}
_WORD = re.compile(r"(?<![\\A-Za-z_^])([A-Za-z][a-z]+)(?![A-Za-z])")  # "is", "The"; not "AB" (a name)
_NAME_MARK = re.compile(  # a vector of any letters; a segment or arc of two or more (\overline{z} is a conjugate)
    r"\\(?:overrightarrow|overleftrightarrow|vec|boldsymbol)\s*(?:\{\s*([A-Za-z]+)\s*\}|([A-Za-z])(?![A-Za-z]))"
    r"|\\(?:overline|widehat)\s*\{\s*([A-Za-z]{2,})\s*\}"
)


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


_OPERATION = re.compile(r"\b(?:sum|product|difference|quotient|average|mean|remainder|square|cube|root)s?\s+of\b", re.I)


def _check_qualifiers(text: str) -> None:
    for w in _words(text):
        if w in QUALIFIERS:
            raise QualifiedAnswer(f"the answer is qualified by {w!r}")
    if _OPERATION.search(text):  # "the sum of 2 and 3" is 5, not the list 2, 3
        raise QualifiedAnswer("the answer names an operation on the values")


def _unwrap_text(m: re.Match) -> str:
    inner = m.group(1).strip()
    low = inner.lower().strip(" .")
    if low in _CONNECTIVES:  # "1 \text{ or } 2" is a list ("and" is checked against inequalities later)
        return " , " if low == "or" else " and "
    if low == "percent":
        return " % "
    if low in (",", ";"):
        return " , "
    _check_qualifiers(inner)
    # words (units such as "cm", "km/h" with their ^2 / ^3, "square units", filler such as "the
    # answer is") are dropped; digits or single-letter symbols are kept
    if re.fullmatch(r"[A-Za-z ./,:]*", inner) and (len(re.sub(r"[^A-Za-z]", "", inner)) > 1 or not inner):
        return " "
    return " " + inner + (m.group(2) or "") + " "


def _drop_filler(s: str) -> str:
    """Remove filler words written outside \\text{} ("x = 3 is the solution" -> "x = 3")."""
    if not _WORD.search(s):
        return s
    _check_qualifiers(s)
    out = _WORD.sub(lambda m: " " if m.group(1).lower() in FILLER else m.group(0), s)
    if out == s:
        return s
    out = re.sub(r"^[\s,.:;]+|[\s,:;]+$", "", out)
    return re.sub(r",\s*(?=,)", "", out)


_DOMAIN = re.compile(
    r"(?:\s|,|;|\\[,;:! ]|\\q?quad|~)*\(?\s*(?:\\text\s*\{\s*(?:where|for|with)\s*\}|where|for|with)?\s*"
    r"([A-Za-z])\s*\\in\s*\\mathbb\s*\{?\s*([ZN])\s*\}?\s*(?:\^\s*\{?\s*[*+]\s*\}?|_\s*\{?\s*\+\s*\}?)?\s*\)?\s*\.?\s*$"
)
_SYSTEM = re.compile(
    r"\\begin\s*\{cases\}(.*?)\\end\s*\{cases\}"
    r"|\\left\s*\\\{\s*\\begin\s*\{array\}\s*\{[^{}]*\}(.*?)\\end\s*\{array\}\s*\\right\s*\.",
    re.S,
)


_WHERE_ATTAINED = re.compile(
    r"\s*(?:\\text\s*\{\s*(?:at|when|where)\s*\}|(?<![A-Za-z\\])(?:at|when|where)(?![A-Za-z]))\s*"
    r"[A-Za-z](?:_\s*\{?\s*[A-Za-z0-9]+\s*\}?)?\s*=\s*[^,<>=]*$"
)


def split_domain(text: str) -> tuple[str, str | None]:
    """Remove a trailing domain clause: "x = \\frac{\\pi}{4} + k\\pi, k \\in \\mathbb{Z}" -> the answer and
    "k" (the integer parameter, renamed by the parser so that k and n compare equal);
    "a_n = 2n - 1 (n \\in \\mathbb{N}^*)" -> the answer and None (the index keeps its name)."""
    m = _DOMAIN.search(text)
    if m is None or m.start() == 0:
        return text, None
    return text[:m.start()], m.group(1) if m.group(2) == "Z" else None


def _system(m: re.Match) -> str:
    """\\begin{cases} x = 1 \\\\ y = 2 \\end{cases} (a system's solution) -> "x = 1, y = 2"."""
    body = m.group(1) if m.group(1) is not None else m.group(2)
    rows = [r.replace("&", " ").strip() for r in body.split("\\\\")]
    return " " + " , ".join(r for r in rows if r) + " "


_UNICODE = str.maketrans({
    "\u2212": "-",  # MINUS SIGN
    "\u00d7": " \\times ", "\u22c5": " \\cdot ", "\u00f7": " \\div ",
    "\u03c0": " \\pi ", "\u221e": " \\infty ", "\u221a": " \\sqrt ", "\u222a": " \\cup ",
    "\u00a0": " ", "\u2009": " ", "\u202f": " ",  # no-break, thin and narrow no-break spaces
})
"""Unicode operators models write for their LaTeX commands (\u2212 for -, \u00d7 for \\times, \u03c0 for \\pi)."""

_MIXED = re.compile(r"(?<![\w.^_}\\)])(\d{1,9})\s*\\frac\s*(?:\{\s*(\d{1,9})\s*\}|(\d))\s*(?:\{\s*(\d{1,9})\s*\}|(\d))")


def _mixed_number(m: re.Match) -> str:
    """"2\\frac{1}{4}" is the mixed number 9/4 (as written in school answers), not 2 * 1/4; only a
    proper fraction of integers after an integer reads so."""
    whole, num, den = int(m.group(1)), int(m.group(2) or m.group(3)), int(m.group(4) or m.group(5))
    if not 0 < num < den:
        return m.group(0)
    return f"\\frac{{{whole * den + num}}}{{{den}}}"


_REPEATING = re.compile(r"(?<![\d.])(\d{0,20})\.(\d{0,20})\\(?:overline|dot)\s*(?:\{\s*(\d{1,20})\s*\}|(\d))")


def _repeating_decimal(m: re.Match) -> str:
    """"0.1\\overline{6}" (also \\dot{6}) is the exact fraction 1/6: 0.1666... = (16 - 1) / 90."""
    whole, fixed, period = m.group(1) or "0", m.group(2), m.group(3) or m.group(4)
    den = 10 ** len(fixed) * (10 ** len(period) - 1)
    num = int(whole) * den + int(fixed + period) - int(fixed or "0")
    return f"\\frac{{{num}}}{{{den}}}"


_GROUPED = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?:\{,\}\d{3})+(?!\d)")


def normalize_latex(text: str) -> tuple[str, bool]:
    """Rewrite formatting-only LaTeX into the parser's subset. Returns (text, had_percent).

    Raises QualifiedAnswer when words in the answer qualify or negate its value."""
    s = text.translate(_UNICODE).strip()
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a):len(s) - len(b)]
            break
    s = re.sub(r"\.?\s*I hope it is correct\.?\s*$", "", s)  # the closing line of a common answer format
    s = s.replace("\\$", " ").replace("$", " ")
    # "-\frac14 \text{ at } x = \frac12", "3 when x = 1": where an extreme is attained is not the value
    m = _WHERE_ATTAINED.search(s)
    if m and s[:m.start()].strip():
        s = s[:m.start()]
    s = _SYSTEM.sub(_system, s)
    s = re.sub(r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])\s*\.?", "", s)
    s = s.replace("\\\\", " \\rowsep ")  # matrix row separator, before "\\ " (a space) is dropped
    s = re.sub(r"\\(?:[,;:! ]|quad|qquad|displaystyle|limits)", " ", s).replace("~", " ")
    s = re.sub(r"\\colon(?![A-Za-z])", ":", s)
    s = s.replace(";", ",")  # "1; 0; 4", "(1;0;4)": a semicolon separates items like a comma
    s = re.sub(r"\\(?:mid|vert|lvert|rvert)(?![A-Za-z])", "|", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = _MIXED.sub(_mixed_number, s)
    s = _REPEATING.sub(_repeating_decimal, s)
    s = re.sub(r"\\(?:cdot|times|ast)(?![A-Za-z])", "*", s)
    s = re.sub(r"\\div(?![A-Za-z])", "/", s)
    # degrees, also Celsius / Fahrenheit: "12^\\circ\\text{C}", "-5^{\\circ} F"
    s = re.sub(r"(?:\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|°)"
               r"(?:\s*(?:\\(?:text|mathrm)\s*\{\s*[CF]\s*\}|[CF](?![A-Za-z])))?", " ", s)
    # 1{,}000 groups digits; 1{,}5 and 0{,}25 are decimal commas, read as lists (no value)
    s = _GROUPED.sub(lambda m: m.group(0).replace("{,}", ""), s).replace("{,}", ",")
    s = re.sub(r"\\mathbb\s*\{\s*R\s*\}|\\mathbb\s*R(?![A-Za-z])|\\R(?![A-Za-z])", r"\\reals ", s)
    s = re.sub(r"\\(?:varnothing|emptyset)(?![A-Za-z])|\\\{\s*\\\}", r"\\emptyset ", s)
    s = re.sub(r"\\(?:leqslant|leq|le)(?![A-Za-z])|<=", "≤", s)
    s = re.sub(r"\\(?:geqslant|geq|ge)(?![A-Za-z])|>=", "≥", s)
    s = re.sub(r"\\(?:neq|ne)(?![A-Za-z])|!=", "≠", s)
    s = re.sub(r"\\lt(?![A-Za-z])", "<", s)
    s = re.sub(r"\\gt(?![A-Za-z])", ">", s)
    s = re.sub(r"\\in(?![A-Za-z])", "∈", s)
    s = re.sub(r"\\(?:angle|measuredangle|triangle)(?![A-Za-z])", " ", s)
    # extremes as names: "f(x)_{\max}", "f_{\max}(x)", "y_{\min}" -> f_{max}, y_{min}
    s = re.sub(r"_\s*\{\s*\\?(max|min)\s*\}|_\s*\\(max|min)(?![A-Za-z])", lambda m: "_{" + (m.group(1) or m.group(2)) + "}", s)
    s = re.sub(r"([A-Za-z])\s*\(\s*[A-Za-z]\s*\)\s*(_\{(?:max|min)\})", r"\1\2", s)
    s = re.sub(r"(_\{(?:max|min)\})\s*\(\s*[A-Za-z]\s*\)", r"\1", s)
    # segment and vector names: \overline{AB}, \vec{v}, \mathbf{M} name the thing (letters only)
    s = _NAME_MARK.sub(lambda m: " " + (m.group(1) or m.group(2) or m.group(3)) + " ", s)
    # matrices: \begin{pmatrix} a & b \\ c & d \end{pmatrix} (also bmatrix, matrix, array{cc})
    s = re.sub(r"\\begin\s*\{array\}\s*\{[^{}]*\}", r"\\begin{matrix}", s)
    s = re.sub(r"\\begin\s*\{[pbBvV]?matrix\}", r" \\matbegin ", s)
    s = re.sub(r"\\end\s*\{(?:[pbBvV]?matrix|array)\}", r" \\matend ", s)
    s = re.sub(r"^\s*\(\s*(\\matbegin\b.*\\matend)\s*\)\s*$", r"\1", s)
    for _ in range(3):  # nested text blocks
        s = _TEXT_BLOCK.sub(_unwrap_text, s)
    if re.search(r"(?<![A-Za-z\\])and(?![A-Za-z])", s) and re.search(r"[<>≤≥]", s):
        # "x > 1 and x < 3" is an intersection, not the list (union) that "and" makes elsewhere
        raise QualifiedAnswer("inequalities joined by 'and'")
    s = re.sub(r"(?<![A-Za-z\\])(?:or|and)(?![A-Za-z])", " , ", s)  # "x = 1 or x = 2"
    s = re.sub(r"(?<![A-Za-z\\])percent(?![A-Za-z])", "%", s)
    s = s.replace("\\%", "%").strip()
    percent = s.endswith("%")
    if percent:
        s = s[:-1].strip()
    # trailing unit words after a number, a closing bracket or another such word: "5 cm",
    # "12 square units", "3 cm^2", "10 apples" (plain words of three or more letters); not the
    # variable in "-2 \ge m"
    words = s.split()
    while len(words) > 1:
        w = re.sub(r"\^?\{?[23]\}?$", "", words[-1]).rstrip(".")
        prev = words[-2]
        if (w.lower() in UNIT_WORDS or re.fullmatch(r"[A-Za-z]{3,}", w) and w.lower() not in QUALIFIERS) and (
            re.search(r"[0-9})\]]$", prev) or re.fullmatch(r"[A-Za-z]{2,}", prev)
        ):
            words.pop()
        else:
            break
    s = _drop_filler(" ".join(words))
    # thousands separators: "1,000", "1 000" (from 1\,000), also after "x ="
    m = re.fullmatch(r"((?:[A-Za-z]\s*=\s*)?)(-?\d{1,3}(?:(?:,| )\d{3})+(?:\.\d+)?)", s.strip())
    if m:
        s = m.group(1) + re.sub(r"[, ]", "", m.group(2))
    return s.strip().rstrip("."), percent
