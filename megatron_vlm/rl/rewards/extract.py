"""Find the final answer inside a model completion.

Completions are untrusted text: everything here is plain string scanning (no regex with nested
quantifiers over the whole text, no evaluation). The order of preference is the convention of
the seed recipes and of math-verify: the last `\\boxed{...}` (or `\\fbox{...}`), then an
`<answer>`-style tag when configured, then a "final answer is ..." / "Answer: ..." phrase, then
(optionally) the last number.
"""
from __future__ import annotations

import re
from typing import Optional

__all__ = [
    "MAX_ANSWER_CHARS",
    "last_boxed",
    "last_tag_content",
    "answer_phrase",
    "last_number",
    "extract_answer",
    "strip_math_delimiters",
]

MAX_ANSWER_CHARS = 512
"""Longer extracted answers are treated as "no answer": real final answers are short, and this bounds
the work any downstream parser does on adversarial text."""

_BOXED = ("\\boxed", "\\fbox")
_PHRASE = re.compile(
    r"(?:final\s+answer\s*(?:is|:|=)|the\s+answer\s+is|answer\s*:|correct\s+(?:answer|option|choice)\s+is)\s*",
    re.IGNORECASE,
)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")


def _braced(text: str, start: int) -> Optional[tuple[str, int]]:
    """Content of the balanced {...} group opening at text[start] == '{', and the index after it.
    Escaped braces (\\{ \\}) do not count."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
        i += 1
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} (also the brace-less `\\boxed 5` form)."""
    best = -1
    for cmd in _BOXED:
        best = max(best, text.rfind(cmd))
    while best >= 0:
        cmd = next(c for c in _BOXED if text.startswith(c, best))
        j = best + len(cmd)
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            got = _braced(text, j)
            if got is not None:
                return got[0].strip()
        elif j > best + len(cmd) and j < len(text):
            m = re.match(r"[^\s$]+", text[j:])
            if m:
                return m.group(0)
        # malformed (unclosed) box: try an earlier one
        nxt = -1
        for c in _BOXED:
            nxt = max(nxt, text.rfind(c, 0, best))
        best = nxt
    return None


def last_tag_content(text: str, tag: str) -> Optional[str]:
    """Content of the last <tag>...</tag> block."""
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    end = text.rfind(close_t)
    if end < 0:
        return None
    start = text.rfind(open_t, 0, end)
    if start < 0:
        return None
    return text[start + len(open_t):end].strip()


def answer_phrase(text: str) -> Optional[str]:
    """What follows the last "final answer is" / "the answer is" / "Answer:" phrase, up to the end of
    its line (a trailing period and surrounding $ or ** are dropped)."""
    last = None
    for m in _PHRASE.finditer(text):
        last = m
    if last is None:
        return None
    rest = text[last.end():]
    line = rest.split("\n", 1)[0].strip()
    if not line and "\n" in rest:  # "Answer:\n42"
        line = rest.split("\n", 2)[1].strip()
    boxed = last_boxed(line)
    if boxed is not None:
        return boxed
    line = line.strip("*").strip()
    if line.endswith("."):
        line = line[:-1].rstrip()
    line = strip_math_delimiters(line)
    if line.endswith("."):
        line = line[:-1].rstrip()
    return line or None


def last_number(text: str) -> Optional[str]:
    """The last number written in the text (e.g. "-3", "1,000", "2.5")."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def strip_math_delimiters(s: str) -> str:
    """Remove surrounding $...$, $$...$$, \\(...\\), \\[...\\]."""
    s = s.strip()
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            return s[len(a):len(s) - len(b)].strip()
    return s


def extract_answer(
    text: str,
    *,
    answer_tag: Optional[str] = None,
    fallback_last_number: bool = False,
) -> Optional[str]:
    """The final answer of a completion, or None if it states none (see module docstring)."""
    if not isinstance(text, str):
        return None
    candidate = None
    if answer_tag:
        inside = last_tag_content(text, answer_tag)
        if inside is not None:
            candidate = last_boxed(inside) or answer_phrase(inside) or strip_math_delimiters(inside)
    if candidate is None:
        candidate = last_boxed(text)
    if candidate is None:
        candidate = answer_phrase(text)
    if candidate is None and fallback_last_number:
        candidate = last_number(text)
    if candidate is None or len(candidate) > MAX_ANSWER_CHARS:
        return None
    return candidate
