"""Untrusted text as plain text: literal special-token strings in it become ordinary tokens, the template's stay special.

Why: an environment's or tool's text (a web page, a file, a program's output, text the model made a tool echo), a
policy's completion scored by a reward model (rl/rewards/model_reward.py) and the texts filled into a judge's
template (rl/rewards/judge.py: `marked_format`, the markers placed inside the template's text) are untrusted. Tokenized with
special-token parsing on, as the chat template's output is, a literal "<|image_pad|>" in it would be an image
placeholder with no image (the trajectory then ends as env_error, the completion is not scored) and
"<|im_end|>\\n<|im_start|>" a forged turn boundary inside the turn. The model must see the characters, as any other
text.

How: the observation's turns are rendered a second time with each text replaced by a marker (holding a tag drawn
per process, so that no other text of the rendering is taken for one), which locates the texts in the rendering
(`segments`); the template's pieces keep their special tokens and placeholders, the texts are
tokenized with special-token parsing off (`tokenize`). The rendering is split at the template's special tokens, as
the tokenizer itself splits text at added tokens before its model runs, so text without such literals gets the ids
of tokenizing the whole rendering (the caller takes that path for it anyway, unchanged). A template that changes a
text (strips or escapes it) cannot be located this way; such a turn with a literal in its text is refused
(ValueError: the trajectory ends as env_error) rather than letting the literal become special.
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

__all__ = ["special_strings", "has_special", "marked_messages", "marked_format", "unmarked_messages", "segments",
           "tokenize", "tokenize_with_offsets"]

_TAG = secrets.token_hex(8)
"""Part of every marker: no other text of a rendering holds it (a prompt or an earlier turn holding the private-use
characters alone, or a guessed marker, would otherwise be read as one and the text refused), and no one can write it
on purpose: it is drawn per process and never reaches the tokens."""
_MARK = f"\ue000{_TAG}:{{}}\ue001"
_MARK_RE = re.compile(f"\ue000{_TAG}:(\\d+)\ue001")


def special_strings(proc: Any) -> tuple[str, ...]:
    """Texts the tokenizer reads as one special token (its special added tokens, the processor's placeholders and
    structural tokens), longest first (a regex alternation then prefers the longer of two that share a start)."""
    tok = proc.tokenizer
    found = {str(getattr(t, "content", t)) for t in getattr(tok, "added_tokens_decoder", {}).values()
             if getattr(t, "special", False)}
    found |= set(getattr(tok, "all_special_tokens", ()))
    found |= {t for t in (*proc.placeholders.values(), *getattr(proc, "special_strings", ())) if t}
    added = set(tok.get_added_vocab())  # a string that is no added token is plain text to the tokenizer anyway
    return tuple(sorted((t for t in found if t in added), key=lambda t: (-len(t), t)))


def has_special(texts: list[str], specials: tuple[str, ...]) -> bool:
    return any(s in t for t in texts for s in specials)


def message_texts(messages: list[dict]) -> list[str]:
    """The texts of `messages` (string contents and text items), in order."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            out.append(content)
        else:
            out += [it["text"] for it in content if it.get("type") == "text"]
    return out


def marked_messages(messages: list[dict]) -> list[dict]:
    """`messages` with the k-th text (`message_texts` order) replaced by the k-th marker."""
    k = 0

    def mark() -> str:
        nonlocal k
        k += 1
        return _MARK.format(k - 1)

    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            content = mark()
        else:
            content = [{**it, "text": mark()} if it.get("type") == "text" else it for it in content]
        out.append({**m, "content": content})
    return out


def marked_format(template: str, fields: dict[str, str]) -> tuple[str, list[str]]:
    """(`template.format(**fields)` with each field's value replaced by a marker, the values in marker order): the
    markers are numbered in order of appearance (a field written twice gets two), as `segments` reads them; the
    template's own text stays as it is (it is trusted, its special-token strings stay special)."""
    keys = list(fields)
    tagged = template.format(**{k: _MARK.format(i) for i, k in enumerate(keys)})
    texts: list[str] = []

    def renumber(m: re.Match) -> str:
        texts.append(fields[keys[int(m.group(1))]])
        return _MARK.format(len(texts) - 1)

    return _MARK_RE.sub(renumber, tagged), texts


def unmarked_messages(messages: list[dict], texts: list[str]) -> list[dict]:
    """`messages` (texts holding markers, `marked_format`) with the k-th marker replaced by texts[k]."""
    def fill(t: str) -> str:
        return _MARK_RE.sub(lambda m: texts[int(m.group(1))], t)

    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            content = fill(content)
        else:
            content = [{**it, "text": fill(it["text"])} if it.get("type") == "text" else it for it in content]
        out.append({**m, "content": content})
    return out


def segments(rendered: str, marked: str, texts: list[str]) -> list[tuple[str, bool]]:
    """[(piece, is the untrusted text)] of `rendered` (the turns as the template wrote them), from
    `marked`, the same turns rendered from `marked_messages`. ValueError when the template does not write each text
    unchanged in its marker's place."""
    out: list[tuple[str, bool]] = []
    pos, seen = 0, []
    for m in _MARK_RE.finditer(marked):
        out.append((marked[pos:m.start()], False))
        k = int(m.group(1))
        seen.append(k)
        out.append((texts[k] if k < len(texts) else "", True))
        pos = m.end()
    out.append((marked[pos:], False))
    if seen != list(range(len(texts))) or "".join(p for p, _ in out) != rendered:
        raise ValueError("the chat template changes the untrusted text (it is not written as given), so its "
                         "special-token strings cannot be kept as plain text")
    return [(p, env) for p, env in out if p]


def tokenize(tokenizer: Any, pieces: list[tuple[str, bool]], specials: tuple[str, ...],
             token_id: Callable[[str], int]) -> list[int]:
    """Token ids of the joined pieces: special tokens of the template's pieces as their ids, everything else
    (the untrusted text included) with special-token parsing off."""
    return tokenize_with_offsets(tokenizer, pieces, specials, token_id, offsets=False)[0]


def tokenize_with_offsets(tokenizer: Any, pieces: list[tuple[str, bool]], specials: tuple[str, ...],
                          token_id: Callable[[str], int], *, offsets: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """`tokenize`'s ids and, with `offsets`, each token's [start, end) characters in the joined text (a fast
    tokenizer's offset mapping); ValueError when the untrusted text runs into a special token of the template."""
    text = "".join(p for p, _ in pieces)
    spans, pos = [], 0
    for p, env in pieces:
        if env:
            spans.append((pos, pos + len(p)))
        pos += len(p)
    pattern = re.compile("|".join(map(re.escape, specials)))
    ids: list[int] = []
    where: list[tuple[int, int]] = []
    kept: list[int] = []

    def plain(a: int, b: int) -> None:
        enc = tokenizer(text[a:b], add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=offsets)
        ids.extend(enc["input_ids"])
        if offsets:
            where.extend((a + s, a + e) for s, e in enc["offset_mapping"])

    pos = 0
    for m in pattern.finditer(text):
        if any(a < m.end() and m.start() < b for a, b in spans):
            continue  # inside (or across the edge of) the untrusted text: plain characters
        if m.start() > pos:
            plain(pos, m.start())
        kept.append(token_id(m.group()))
        ids.append(kept[-1])
        where.append((m.start(), m.end()))
        pos = m.end()
    if pos < len(text):
        plain(pos, len(text))
    template = sum(len(pattern.findall(p)) for p, env in pieces if not env)
    protected = {token_id(t) for t in specials}
    if len(kept) != template or sum(i in protected for i in ids) != len(kept):  # e.g. a placeholder that is an
        # added token but not a special one: special-token parsing off does not split it
        raise ValueError(f"the untrusted text runs into a special token of the chat template or tokenizes to one "
                         f"({template} in the template, {len(kept)} kept)")
    return ids, (where if offsets else [])
