"""Placeholder expansion: what one image / video placeholder of the chat template output becomes.

Every family's processor replaces each placeholder the chat template wrote (`<|image_pad|>`,
`<IMG_CONTEXT>`, `<video>`, ...) by a family-specific string: runs of a placeholder token, one per
vision feature, framed by start / end tokens and sometimes labelled with text ("Frame1: ",
"<0.5 seconds>"). An `Expansion` is that string as parts: literal text, and `Run(token, count)`.

Why parts and not the string: packs are planned from exact token counts of every record
(`estimate_length`), and tokenising thousands of repeated placeholder tokens per image for a whole
epoch is wasted work. A run token is an added special token, so the tokenizer splits every copy out
on its own and `count` copies are exactly `count` ids; the planner tokenises the text with every run
written once (`render(parts, compact=True)`) and adds the `count - 1` ids it left out — the same
number as tokenising the full string, including the labels' text, whatever the tokenizer.

`expand` replaces placeholders in one left-to-right pass (as transformers'
`ProcessorMixin.get_text_with_replacements` does), so an expansion that contains the image
placeholder token itself (InternVL's `<IMG_CONTEXT>`) is never expanded twice.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

__all__ = ["Run", "Expansion", "render", "omitted_tokens", "placeholder_order", "expand", "run_counts"]


@dataclass(frozen=True)
class Run:
    """`count` copies of the special token `token` (one per vision feature)."""

    token: str
    count: int


Expansion = tuple[Union[str, Run], ...]


def render(parts: Expansion, *, compact: bool = False) -> str:
    """The expansion as text; with `compact`, each run is written once (see `omitted_tokens`)."""
    return "".join(p if isinstance(p, str) else p.token * (min(p.count, 1) if compact else p.count) for p in parts)


def omitted_tokens(parts: Expansion) -> int:
    """Token ids that `render(parts, compact=True)` leaves out."""
    return sum(p.count - 1 for p in parts if isinstance(p, Run) and p.count > 0)


def run_counts(expansions: Sequence[Expansion]) -> dict[str, int]:
    """Total copies per run token over several expansions."""
    out: dict[str, int] = {}
    for parts in expansions:
        for p in parts:
            if isinstance(p, Run):
                out[p.token] = out.get(p.token, 0) + p.count
    return out


def _pattern(placeholders: dict[str, str]) -> re.Pattern:
    return re.compile("|".join(f"(?P<{kind}>{re.escape(tok)})" for kind, tok in placeholders.items() if tok))


def placeholder_order(text: str, placeholders: dict[str, str]) -> list[str]:
    """Kinds ("image" / "video") of the placeholders in `text`, left to right."""
    pattern = _pattern(placeholders)
    return [m.lastgroup for m in pattern.finditer(text)] if pattern.pattern else []


def expand(text: str, placeholders: dict[str, str], expansions: dict[str, list[Expansion]], *,
           compact: bool = False) -> str:
    """Replace the i-th placeholder of each kind by `expansions[kind][i]` (counts must match)."""
    unknown = {kind for kind, items in expansions.items() if items} - {kind for kind, tok in placeholders.items() if tok}
    if unknown:
        raise ValueError(f"no placeholder token for {sorted(unknown)}")
    order = placeholder_order(text, placeholders)
    for kind, tok in placeholders.items():
        found, given = order.count(kind), len(expansions.get(kind, ()))
        if found != given:
            raise ValueError(f"{found} {tok} placeholders in the text but {given} {kind}s")
    if not order:
        return text
    iters = {kind: iter(items) for kind, items in expansions.items()}
    return _pattern(placeholders).sub(lambda m: render(next(iters[m.lastgroup]), compact=compact), text)
