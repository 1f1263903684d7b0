"""Find the final answer inside a model completion.

Completions are untrusted text: everything here is plain string scanning in linear time (one pass
for boxes, no regex with nested quantifiers over the whole text, no evaluation). The order of
preference follows math-verify's documented LaTeX extraction (boxed first), with our options:

1. the content of an `<answer_tag>...</answer_tag>` block, when configured (its own box / phrase
   / math inside it win);
2. the last `\\boxed{...}` / `\\fbox{...}` that closes (also the brace-less `\\boxed 5`), together
   with the boxes just before it when only connectors separate them ("$x = \\boxed{3}$ or
   $x = \\boxed{5}$", "\\boxed{a = 12} and \\boxed{b = 3}"): several boxes that are one answer;
3. the last final-answer phrase: "final answer is", "the answer is", "correct answer is",
   "Answer:" (also bold "**Answer:**"), a "Final Answer" heading line, taking the math after it on
   its line (or on the next non-empty line): one math environment, several joined by "or" / "and" /
   "," (kept as a list), or the plain text up to the end of the sentence (without a reason after a
   comma, ", since ...", or a spelled-out value in parentheses, "7 (seven)");
4. with `fallback_last_math`: the last math environment (`$...$`, `$$...$$`, `\\(...\\)`, `\\[...\\]`);
5. with `fallback_last_number`: the last number.
"""
from __future__ import annotations

import bisect
import re
from typing import Optional

from megatron_vlm.rl.rewards.latex_normalize import QUALIFIERS

__all__ = [
    "MAX_ANSWER_CHARS",
    "last_boxed",
    "boxed_answer",
    "last_boxes",
    "last_tag_content",
    "answer_phrase",
    "last_math_env",
    "last_number",
    "extract_answer",
    "strip_math_delimiters",
]

MAX_ANSWER_CHARS = 512
"""Longer extracted answers are treated as "no answer": real final answers are short, and this bounds
the work any downstream parser does on adversarial text."""

_BOXED = ("\\boxed", "\\fbox")
_PHRASE = re.compile(
    r"(?:final\s+answer\s*(?:is|:|=)|the\s+answer\s+is|answer\s+is|correct\s+(?:answer|option|choice)\s+is"
    r"|answer(?:\*\*)?[ \t]*:|(?m:^)[ \t#*>]*final\s+answer(?:\*\*)?[ \t]*(?=\n))[ \t]*:?[ \t]*\**[ \t]*",
    re.IGNORECASE,
)
# a whole number token: not the tail of a word, exponent or fraction ("a_1", "1.5e3", "3/4" -> "3/4", not "4");
# U+2212 is a minus sign
_NUMBER = re.compile(r"(?<![\w./])[-\u2212]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:/\d+(?![\d.]))?")
_CONNECTOR = re.compile(r"\s*(?:,|;|\bor\b|\band\b)?\s*", re.IGNORECASE)


_BLANK = re.compile(r"\s*")  # stops at the first other character: no copy of nested contents
_BOX_SCAN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z]) *|\\.|[{}]", re.DOTALL)


_BOX_GAP = re.compile(
    r"(?:\s|\$|\\[()\[\]]|,|;|&|\\\\|\\q?quad|\\[,;: ]|\\text\s*\{\s*(?:and|or|,)?\s*\}|\band\b|\bor\b)*"
    r"(?P<name>(?:[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?|\\[a-z]+)\s*=)?\s*",
    re.IGNORECASE,
)
_NAME_BEFORE = re.compile(r"(?:^|[\s$(,;])((?:[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?|\\[a-z]+)\s*=)\s*\$?\s*$")
MAX_JOINED_BOXES = 8
MAX_BOX_GAP = 80


def _scan_boxes(text: str) -> list[tuple[int, int, int, int, bool]]:
    """One left-to-right pass (regex-driven, so the scan itself runs in C): every closed box as
    (command start, content start, content end, end, inside another box). Brace depth is a stack of
    open positions; escaped braces (\\{ \\}) and other escapes do not count; an unclosed or empty box
    is never returned."""
    stack: list[tuple[int, int]] = []  # (content start, box command start or -1)
    boxes: list[tuple[int, int, int, int, bool]] = []
    open_boxes = 0
    pending_box, pending_cmd = -1, -1  # end of a "\boxed " token just read: a '{' right there opens the box
    for m in _BOX_SCAN.finditer(text):
        tok = m.group(0)
        if tok[0] == "\\":
            if tok.startswith(("\\boxed", "\\fbox")):
                end = m.end()
                if end < len(text) and text[end] != "{" and end > m.start() + len(tok.rstrip()):
                    word = re.match(r"[^\s$]+", text[end:end + MAX_ANSWER_CHARS + 1])  # "\boxed 5"
                    if word:
                        boxes.append((m.start(), end, end + word.end(), end + word.end(), open_boxes > 0))
                pending_box, pending_cmd = end, m.start()
            continue
        if tok == "{":
            stack.append((m.end(), pending_cmd if m.start() == pending_box else -1))
            open_boxes += stack[-1][1] >= 0
        elif stack:
            start, cmd = stack.pop()
            if cmd >= 0:
                open_boxes -= 1
                if _BLANK.fullmatch(text, start, m.start()) is None:  # an empty "\boxed{}" states no answer
                    boxes.append((cmd, start, m.start(), m.end(), open_boxes > 0))
    return boxes


def _joined_boxes(text: str, boxes: list[tuple[int, int, int, int, bool]]) -> Optional[str]:
    """The content of the box that opens last; when boxes before it are separated from it only by
    connectors (",", ";", "and", "or", "\\quad", math delimiters), all of them as one list:
    "$x = \\boxed{3}$ or $x = \\boxed{5}$" -> "x = 3, x = 5", "\\boxed{3}, \\boxed{5}" -> "3, 5"."""
    if not boxes:
        return None
    last = max(boxes, key=lambda b: b[1])
    chain = [last]
    names = [""]
    by_end = sorted(boxes, key=lambda b: b[3])
    ends = [b[3] for b in by_end]
    while len(chain) < MAX_JOINED_BOXES:
        k = bisect.bisect_right(ends, chain[0][0])  # the box that closes last before this one opens
        if k == 0:
            break
        prev = by_end[k - 1]
        if prev[4] != last[4] or chain[0][0] - prev[3] > MAX_BOX_GAP:  # another nesting level, or too far
            break
        gap = _BOX_GAP.fullmatch(text, prev[3], chain[0][0])
        if gap is None:
            break
        names[0] = gap.group("name") or ""
        chain.insert(0, prev)
        names.insert(0, "")
    items = [text[b[1]:b[2]].strip() for b in chain]
    if len(chain) == 1:
        return items[0]
    before = _NAME_BEFORE.search(text, max(0, chain[0][0] - 40), chain[0][0])
    names[0] = before.group(1) if before else ""
    return ", ".join(f"{n} {i}".strip() for n, i in zip(names, items))


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} that is closed (also the brace-less `\\boxed 5`).
    An unclosed box is skipped; an earlier closed one (or one nested inside it) is used instead."""
    if not isinstance(text, str) or ("\\boxed" not in text and "\\fbox" not in text):
        return None
    boxes = _scan_boxes(text)
    if not boxes:
        return None
    last = max(boxes, key=lambda b: b[1])
    return text[last[1]:last[2]].strip()


def boxed_answer(text: str) -> Optional[str]:
    """The boxed answer of a completion: the last closed box, joined with the boxes just before it
    when only connectors separate them (several boxes that together are the answer)."""
    if not isinstance(text, str) or ("\\boxed" not in text and "\\fbox" not in text):
        return None
    return _joined_boxes(text, _scan_boxes(text))


_PART_MARK = re.compile(
    r"(?:^|\n)[ \t#*>]*(?:\*\*)?[ \t]*(?:\(\s*(?:\d|[IV]{1,3}|[ivx]{1,3})\s*\)|(?:\d|[IV]{1,3})[.)](?!\d)|Part\s+\(?\w\)?)"
)


def last_boxes(text: str, k: int) -> Optional[str]:
    """The last k boxes that are not inside another box, joined as one list ("3, 5"), when each
    follows a new part of the solution: a line starting with "(2)", "2.", "(II)", "Part 2", ...
    ("(1) ... \\boxed{a_n = 2n - 1} ... (2) ... \\boxed{T_n = n^2}"). None when there are fewer boxes
    or a box is not in a part of its own: "First \\boxed{4}. Wait, ... \\boxed{5}" is one answer, 5.
    The caller decides when k parts are wanted."""
    if not isinstance(text, str) or k < 2 or k > MAX_JOINED_BOXES or "\\boxed" not in text and "\\fbox" not in text:
        return None
    top = sorted((b for b in _scan_boxes(text) if not b[4]), key=lambda b: b[0])
    if len(top) < k:
        return None
    chosen = top[-k:]
    if any(_PART_MARK.search(text, a[3], b[0]) is None for a, b in zip(chosen, chosen[1:])):
        return None
    return ", ".join(text[b[1]:b[2]].strip() for b in chosen)


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


_ENV_OPEN = re.compile(r"\$\$|\\\[|\\\(|(?<!\\)\$")
_ENV_CLOSE = {"$$": "$$", "\\[": "\\]", "\\(": "\\)", "$": "$"}


def _math_envs(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of the math environments in text, left to right: openers are found by a
    regex scan, closers with str.find, and the scan resumes after each environment (linear time)."""
    out: list[tuple[int, int, str]] = []
    pos = 0
    while True:
        m = _ENV_OPEN.search(text, pos)
        if m is None:
            return out
        a = m.group(0)
        b = _ENV_CLOSE[a]
        j = text.find(b, m.end())
        while b == "$" and j > 0 and text[j - 1] == "\\":  # \$ is a dollar sign
            j = text.find(b, j + 1)
        if j < 0:
            return out
        out.append((m.start(), j + len(b), text[m.end():j].strip()))
        pos = j + len(b)


def last_math_env(text: str) -> Optional[str]:
    """Content of the last non-empty math environment ($...$, $$...$$, \\(...\\), \\[...\\]), with the
    environments just before it that only connectors separate from it, as one list ("so $x = 2$ or
    $x = 3$" -> "x = 2, x = 3"; "the area is $6$ and the side is $3$" -> "3")."""
    envs = [e for e in _math_envs(text) if e[2]]
    if not envs:
        return None
    k = len(envs) - 1
    while k > 0 and len(envs) - k < MAX_JOINED_BOXES and envs[k][0] - envs[k - 1][1] <= MAX_BOX_GAP and \
            _CONNECTOR.fullmatch(text, envs[k - 1][1], envs[k][0]):
        k -= 1
    return ", ".join(e[2] for e in envs[k:])


def _after_phrase(rest: str) -> Optional[str]:
    lines = rest.split("\n")
    line = lines[0].strip()
    k = 1
    while not line and k < len(lines) and k < 4:  # "Answer:\n\n42"
        line = lines[k].strip()
        k += 1
    if not line:
        return None
    if line.startswith(("$$", "\\[")) and len(lines) > k:  # display math spanning lines
        line = " ".join([line] + [ln.strip() for ln in lines[k:k + 4]])
    boxed = boxed_answer(line)
    if boxed is not None:
        return boxed
    envs = [e for e in _math_envs(line) if e[2]]
    if envs:
        # several environments joined only by connectors ("$x=2$ or $x=3$") form a list
        joined = [envs[0][2]]
        for prev, cur in zip(envs, envs[1:]):
            if _CONNECTOR.fullmatch(line[prev[1]:cur[0]]):
                joined.append(cur[2])
            else:
                break
        return ", ".join(joined)
    # bold: "the answer is **5**." (the phrase took the opening "**"), "Answer: **x = 3**"
    line = re.sub(r"\*\*([^*\n]+?)\*\*", r"\1", line)
    line = re.sub(r"\*\*(?=[.!]?$)", "", line)
    line = line.strip("*").strip()
    # plain text: up to the end of the sentence (a final "." or ". " before a capitalised word; not a
    # decimal point, and not "B. 7 cm" in a choice)
    m = re.search(r"\.(?:\s+(?=[A-Z][a-z])|\s*$)", line)
    if m:
        line = line[:m.start()]
    # the reason or a spelled-out value after it: "3, since 3 > 2", "7 (seven)"
    m = re.search(r",\s+(?:since|because|as|so|for|given|where)\b|\s+\(([A-Za-z][A-Za-z ]+)\)\s*$", line)
    if m and m.start() > 0 and not (m.group(1) and QUALIFIERS.intersection(m.group(1).lower().split())):
        line = line[:m.start()]
    return line.strip() or None


def answer_phrase(text: str) -> Optional[str]:
    """The answer after the last "final answer is" / "the answer is" / "Answer:" phrase (see the
    module docstring)."""
    last = None
    for m in _PHRASE.finditer(text):
        last = m
    if last is None:
        return None
    return _after_phrase(text[last.end():])


def last_number(text: str) -> Optional[str]:
    """The last number written in the text (e.g. "-3", "1,000", "2.5", "3/4")."""
    found = _NUMBER.findall(text)
    return found[-1].replace("\u2212", "-") if found else None


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
    fallback_last_math: bool = False,
    fallback_last_number: bool = False,
) -> Optional[str]:
    """The final answer of a completion, or None if it states none (order: module docstring)."""
    if not isinstance(text, str):
        return None
    candidate = None
    if answer_tag:
        inside = last_tag_content(text, answer_tag)
        if inside is not None:
            candidate = boxed_answer(inside) or answer_phrase(inside) or strip_math_delimiters(inside)
    if candidate is None:
        candidate = boxed_answer(text)
    if candidate is None:
        candidate = answer_phrase(text)
    if candidate is None and fallback_last_math:
        candidate = last_math_env(text)
    if candidate is None and fallback_last_number:
        candidate = last_number(text)
    if candidate is None or len(candidate) > MAX_ANSWER_CHARS:
        return None
    return candidate
