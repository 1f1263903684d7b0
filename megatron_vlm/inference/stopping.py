"""When a completion ends: EOS tokens, stop strings, the token budget; and its final text.

Stop strings are matched on decoded text, not on token ids (a string such as "</answer>" can be
split over tokens in many ways). After each new token only the tail of the completion is decoded —
enough tokens to hold the longest stop string even when every token decodes to a single character
or a byte-fallback fragment — so the check costs O(tail) per step, not O(length). A stop string that
appeared earlier would already have ended the completion, so any occurrence in the tail is new.

The completion keeps every generated token (the EOS token too: the policy is trained to emit it);
its text drops special tokens and, for a stop string, ends right after the first occurrence.

One text is searched for stop strings, by every engine: the completion decoded with its special tokens
(as transformers' `stop_strings` match the vocabulary's token strings, special ones included). So a stop
string equal to a special token's text (e.g. "<|im_start|>") ends the completion at that token, and one
that only appears once special tokens are dropped (e.g. "is 4" in "is<|im_start|> 4") does not. The
final text is cut at that same occurrence: what the completion holds after it (the rest of the last
token) goes, and a stop string found only in the text without special tokens never cuts the text
short of the tokens that are trained. The vLLM back end matches on the same text
(`VLLM_STOP_OPTIONS`) and takes its text from `final_text` too.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

__all__ = ["StopChecker", "eos_token_ids_of", "VLLM_STOP_OPTIONS"]

VLLM_STOP_OPTIONS = {"skip_special_tokens": False, "include_stop_str_in_output": True}
"""vLLM sampling options under which its stop strings match the text `StopChecker.check` searches (special
tokens kept) and its completions end on the token that completes one (their text: `final_text`)."""

# a UTF-8 character is at most 4 bytes, so a byte-level tokenizer may need 4 tokens per character
_TOKENS_PER_CHAR = 4


def eos_token_ids_of(tokenizer, generation_config: Optional[dict] = None, extra: Iterable[int] = ()) -> set[int]:
    """EOS ids of a chat model: the tokenizer's eos, `<|im_end|>` / `<|endoftext|>` when the vocabulary
    has them, and generation_config.json's `eos_token_id` (an int or a list)."""
    ids: set[int] = set(int(i) for i in extra)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for tok in ("<|im_end|>", "<|endoftext|>"):
        if tok in vocab:
            ids.add(int(vocab[tok]))
    gen_eos = (generation_config or {}).get("eos_token_id")
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(int(i) for i in gen_eos)
    if not ids:
        raise ValueError("eos_token_ids: the tokenizer has no eos token; pass eos ids explicitly")
    return ids


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: Iterable[int], stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        if any(not s for s in stop):
            raise ValueError("stop: stop strings must not be empty")
        self.stop = tuple(stop)
        self._tail = _TOKENS_PER_CHAR * max((len(s) for s in self.stop), default=0) + 2

    def check(self, token_ids: Sequence[int]) -> Optional[str]:
        """"eos" if the last token is an EOS token, "stop" if the text now contains a stop string,
        else None."""
        if not token_ids:
            return None
        if int(token_ids[-1]) in self.eos_token_ids:
            return "eos"
        if self.stop:
            tail = self.tokenizer.decode(list(token_ids[-self._tail:]), skip_special_tokens=False)
            if any(s in tail for s in self.stop):
                return "stop"
        return None

    def final_text(self, token_ids: Sequence[int], finish_reason: str) -> str:
        """The completion's text without special tokens; for "stop", cut right after the stop string where
        `check` found it (module docstring)."""
        ids = list(token_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if finish_reason != "stop" or not self.stop:
            return text
        raw = self.tokenizer.decode(ids, skip_special_tokens=False)
        ends = [raw.find(s) + len(s) for s in self.stop if s in raw]
        if not ends:  # an engine that matched where this decoding does not: cut at the text's own occurrence
            ends = [text.find(s) + len(s) for s in self.stop if s in text]
            return text[: min(ends)] if ends else text
        after = raw[min(ends):]  # the rest of the token that completed the stop string
        special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        if after and ids and int(ids[-1]) not in special and text.endswith(after):
            text = text[: len(text) - len(after)]
        return text
