"""Built-in reward verifiers: math, multiple choice, format and exact match.

Every verifier has the signature `fn(completion, answer, *, prompt="", metadata=None, **options)
-> float` (the options are the fields of its `[[rl.rewards]]` table) and returns a score in
[0, 1]. They are pure functions of their text arguments, run inside reward worker processes
(rl/rewards/pool.py) and never evaluate the completion: extraction is string scanning and math goes
through our own LaTeX parser. Two answers with nothing left once normalised (an empty completion and a
reference "." or "$$": `math_equiv.is_empty_answer`) never match: a reference like that has no answer to give.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from megatron_vlm.rl.rewards.extract import (
    MAX_ANSWER_CHARS,
    extract_answer,
    last_boxed,
    last_boxes,
    strip_math_delimiters,
)
from megatron_vlm.rl.rewards.math_equiv import answer_parts, is_empty_answer, math_equal, normalize_text, rounded_equal

__all__ = ["math_reward", "choice_reward", "format_reward", "exact_match_reward", "parse_choices", "answer_precision",
           "BUILTIN_VERIFIERS"]

MAX_PRECISION = 15
"""The most decimal places a `precision` may ask for (a double holds about 15 significant digits)."""


def answer_precision(value: Any) -> Optional[int]:
    """A `precision` (decimal places of a float answer, MathVista's column) as an int; None when unset (None, NaN).
    ValueError for anything else: negative, fractional, infinite, above MAX_PRECISION or not a number."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_PRECISION \
            or value != int(value):
        raise ValueError(f"precision {value!r} is not a number of decimal places in [0, {MAX_PRECISION}]")
    return int(value)


def math_reward(
    completion: str,
    answer: str,
    *,
    prompt: str = "",
    metadata: Optional[Mapping[str, Any]] = None,
    fallback_last_number: bool = False,
    fallback_last_math: bool = True,
    rel_tol: float = 1e-6,
    answer_tag: Optional[str] = None,
) -> float:
    """1.0 if the completion's final answer is mathematically equal to the reference, else 0.0.

    The answer is extracted as in `extract.extract_answer` (boxed first, then a final-answer phrase,
    then the last math environment when `fallback_last_math`, then the last number when
    `fallback_last_number`); equivalence is `math_equiv.math_equal`. When the reference lists k >= 2
    parts and the completion boxed each part where it solved it, the last k boxes are the answer
    too. Supported answer forms: megatron_vlm/rl/rewards/README.md.

    `metadata["precision"]` (MathVista's column: the decimal places of a float answer; read only when
    `metadata["answer_type"]` is absent or "float", an unreadable one is ignored here and refused by the
    benchmark loader): when the answer and the reference each state one real number, the answer rounded to
    that many places must equal the reference (MathVista's official rule: 1.46 is 1.5 at one place), and
    nothing else decides."""
    gold = str(answer)
    pred = extract_answer(
        completion, answer_tag=answer_tag, fallback_last_math=fallback_last_math, fallback_last_number=fallback_last_number
    )
    if pred is None:
        return 0.0
    places = _metadata_precision(metadata)
    if places is not None:
        rounded = rounded_equal(pred, gold, places)
        if rounded is not None:
            return float(rounded)
    if math_equal(pred, gold, rel_tol=rel_tol):
        return 1.0
    parts = answer_parts(gold) if answer_tag is None else 1
    boxes = last_boxes(completion, parts) if parts > 1 else None
    return 1.0 if boxes is not None and boxes != pred and math_equal(boxes, gold, rel_tol=rel_tol) else 0.0


def _metadata_precision(metadata: Optional[Mapping[str, Any]]) -> Optional[int]:
    if not metadata or metadata.get("answer_type", "float") != "float":
        return None
    try:
        return answer_precision(metadata.get("precision"))
    except ValueError:
        return None


# --- multiple choice --------------------------------------------------------------------------------

_OPTION_LINE = re.compile(r"^\s*\(?([A-Za-z])\s*[).:：]\s*(.+?)\s*$")
_LETTER_FORMS = (
    re.compile(r"^\(([A-Za-z])\)\s*[.:;,]?\s*(.*)$", re.DOTALL),  # "(B)", "(b) 5 cm", "(B), because ..."
    re.compile(r"^(?:option|choice)\s*\(?([A-Za-z])\)?\s*[.:;,)]?\s*(.*)$", re.IGNORECASE | re.DOTALL),  # "Option B"
    re.compile(r"^([A-Z])(?:\s*[.:;,)]\s*(.*))?$", re.DOTALL),  # "B", "B.", "B) 5 cm", "B: 5 cm", "B, 5 cm", "B; 5 cm"
    re.compile(r"^([a-z])$"),  # a lone lower-case letter
)
# a reason after the chosen letter ("B, because ...", "B. Since ...", "B, 5 cm, as ..."): not part of the option's text
_IMAGE_OPTION = re.compile(r"\s*<image\s*\d*>\s*", re.IGNORECASE)
"""An option that is a picture (MMMU's options "<image 2>", shown to the model at that place): its text is no
words a completion could repeat, so what follows the letter describes the picture and is not compared."""
_REASON = re.compile(r"(?:^|[,;]\s*)(?:because|since|as(?!\s+well\b)|given|due\s+to|so|hence|thus|therefore)\b.*$",
                     re.IGNORECASE | re.DOTALL)


def _without_list_joins(text: str) -> str:
    """An inline option's text without what joins the options into a list ("red, or" of "A: red, B: blue, or C:
    green."): trailing commas, semicolons, periods and a final "or" / "and" (string scanning from the end, linear)."""
    t = text.strip()
    while True:
        cut = t.rstrip(" \t\r\n,;.")
        low = cut.lower()
        for word in ("or", "and"):
            if low.endswith(word) and (len(cut) == len(word) or not cut[-len(word) - 1].isalnum()):
                cut = cut[:-len(word)]
                break
        if cut == t:
            return t
        t = cut


def parse_choices(prompt: str, letters: str) -> dict[str, str]:
    """Options written one per line in the prompt ("A. 3", "(B) 5 cm", "C: 7") -> {letter: text}; or, with fewer
    than two such lines, inline ("A. 3 B. 5 C. 7", "A: red, B: blue, or C: green"), each text without the commas,
    semicolons, final period and "or" / "and" that join the list."""
    out: dict[str, str] = {}
    for line in prompt.splitlines():
        m = _OPTION_LINE.match(line)
        if m and m.group(1).upper() in letters and m.group(1).upper() not in out:
            out[m.group(1).upper()] = m.group(2)
    # inline "A. 3 B. 5 C. 7" on one line
    if len(out) < 2:
        parts = re.split(r"(?:^|\s)\(?([A-J])[).:]\s+", prompt)
        if len(parts) >= 5:
            inline = {}
            for letter, text in zip(parts[1::2], parts[2::2]):
                if letter in letters and letter not in inline:
                    inline[letter] = _without_list_joins(text) or text.strip()
            if len(inline) >= 2:
                out = inline
    return out


def _choice_letter(text: str, letters: str, options: Mapping[str, str]) -> Optional[str]:
    t = strip_math_delimiters(text.strip())
    t = re.sub(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", t).strip().strip("*").strip()
    if not t:
        return None
    for form in _LETTER_FORMS:
        m = form.match(t)
        if m and m.group(1).upper() in letters.upper():
            letter = m.group(1).upper()
            tail = m.group(2) if m.lastindex and m.lastindex >= 2 else None
            if tail:  # "B, because ...": the letter is the answer; "B, 5 cm, since ...": the option's text is left
                tail = _REASON.sub("", tail.strip()).strip()
            # "B. 5 cm": when the option text is also given it must be that option's text (or value: "B. 5"); any
            # other text after the letter ("B, C and D are wrong") is prose about the options, not a choice. An
            # option that is a picture has no text to repeat: "B. The second shape" chooses B
            if tail and letter in options and not _IMAGE_OPTION.fullmatch(options[letter]) \
                    and normalize_text(tail) != normalize_text(options[letter]) and not math_equal(tail, options[letter]):
                return None
            return letter
    norm = normalize_text(t)
    if is_empty_answer(t):  # "." is no option's text, even an option that is itself empty
        return None
    for letter, opt in options.items():
        if normalize_text(opt) == norm:
            return letter
    # the option's value in another form ("\\frac{1}{2}" for the option "1/2"); only one option may match
    same = [letter for letter, opt in options.items() if math_equal(t, opt)]
    return same[0] if len(same) == 1 else None


def choice_reward(
    completion: str,
    answer: str,
    *,
    prompt: str = "",
    metadata: Optional[Mapping[str, Any]] = None,
    letters: str = "ABCDEFGHIJ",
    answer_tag: Optional[str] = None,
) -> float:
    """1.0 if the chosen option (letter, option text, or the value of exactly one option in another
    form: "\\frac{1}{2}" for "1/2") is the reference option, else 0.0. `answer_tag`: the last
    <answer_tag>...</answer_tag> block is the choice when there is one.

    Options come from `metadata["choices"]` (a list, lettered in order) or from the prompt's lines."""
    letters = letters.upper()
    choices: Sequence[str] | None = (metadata or {}).get("choices") if metadata else None
    if choices:
        options = {letters[i]: str(c) for i, c in enumerate(choices) if i < len(letters)}
    else:
        options = parse_choices(prompt or "", letters)
    gold_text = str(answer)
    gold = _choice_letter(last_boxed(gold_text) or gold_text, letters, options)
    pred_text = extract_answer(completion, answer_tag=answer_tag)
    if pred_text is None:
        # a bare final line such as "B" or "(B) 5 cm"
        lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
        pred_text = lines[-1] if lines and len(lines[-1]) <= MAX_ANSWER_CHARS else None
    if pred_text is None:
        return 0.0
    pred = _choice_letter(pred_text, letters, options)
    if gold is None:  # the reference is not an option: compare texts (never two empty ones)
        if is_empty_answer(pred_text) or is_empty_answer(gold_text):
            return 0.0
        return 1.0 if normalize_text(pred_text) == normalize_text(gold_text) else 0.0
    return 1.0 if pred == gold else 0.0


# --- format -------------------------------------------------------------------------------------------


def format_reward(
    completion: str,
    answer: str = "",
    *,
    prompt: str = "",
    metadata: Optional[Mapping[str, Any]] = None,
    think_start: str = "<think>",
    think_end: str = "</think>",
    answer_start: Optional[str] = None,
    answer_end: Optional[str] = None,
    require_boxed: bool = False,
) -> float:
    """1.0 if the completion is a non-empty reasoning block followed by a non-empty answer."""
    text = completion.strip()
    if think_start:
        if not text.startswith(think_start) or text.count(think_start) != 1:
            return 0.0
        text = text[len(think_start):]
    if text.count(think_end) != 1:
        return 0.0
    reasoning, rest = text.split(think_end, 1)
    if not reasoning.strip():
        return 0.0
    rest = rest.strip()
    if answer_start is not None and answer_end is not None:
        if not (rest.startswith(answer_start) and rest.endswith(answer_end)) or rest.count(answer_start) != 1:
            return 0.0
        rest = rest[len(answer_start):len(rest) - len(answer_end)].strip()
    if not rest:
        return 0.0
    if require_boxed and last_boxed(rest) is None:
        return 0.0
    return 1.0


# --- exact match ---------------------------------------------------------------------------------------


def _norm_exact(s: str, case_sensitive: bool) -> str:
    s = strip_math_delimiters(" ".join(s.split()))
    s = s.rstrip(".").strip()
    return s if case_sensitive else s.casefold()


def exact_match_reward(
    completion: str,
    answer: str,
    *,
    prompt: str = "",
    metadata: Optional[Mapping[str, Any]] = None,
    case_sensitive: bool = False,
    extract: bool = True,
    answer_tag: Optional[str] = None,
) -> float:
    """1.0 if the (extracted) answer equals the reference after whitespace / case normalisation. `answer_tag`: the
    last <answer_tag>...</answer_tag> block is the answer when there is one."""
    if extract:
        pred = extract_answer(completion, answer_tag=answer_tag)
        if pred is None:
            lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
            pred = lines[-1] if lines else ""
    else:
        pred = completion
    boxed = last_boxed(str(answer))
    gold = str(answer) if boxed is None else boxed
    if is_empty_answer(pred) or is_empty_answer(gold):  # "" and "." both normalise to ""; neither is an answer
        return 0.0
    return 1.0 if _norm_exact(pred, case_sensitive) == _norm_exact(gold, case_sensitive) else 0.0


BUILTIN_VERIFIERS: dict[str, Callable[..., Any]] = {
    "math": math_reward,
    "choice": choice_reward,
    "format": format_reward,
    "exact_match": exact_match_reward,
}
