"""TRL's prompt-completion layout as one conversation: the prompt's turns, then the completion as the reply.

TRL's conversational prompt-completion rows ({"prompt": [messages], "completion": [one assistant message] or a
string}) are read both as table columns (hf_source.py, `columns = {prompt = ..., answer = ...}`) and as lines of a
messages JSONL file (messages.py); the two readers share these checks so that a row trains the same either way.
SFT trains every assistant turn while TRL trains only the completion, so a prompt with an assistant turn is
refused rather than trained differently from what its author meant.
"""
from __future__ import annotations

import math
from typing import Any

from megatron_vlm.data.bad_records import BadRecordError

__all__ = ["answer_text", "prompt_turns", "completion_turns"]


def answer_text(answer: Any, column: str) -> str:
    """The text of an answer cell: a string, or a number / bool (a choice index) as its text. Anything else (a list
    of reference answers, a struct, the NaN pandas writes for a missing number) is a bad record rather than its
    Python repr trained as the reply."""
    if answer is None:
        raise BadRecordError("invalid_record", f"column {column!r} is empty")
    if isinstance(answer, str):
        return answer
    if isinstance(answer, float) and not math.isfinite(answer):
        raise BadRecordError("invalid_record", f"column {column!r} is {answer} (a missing number), not an answer")
    if isinstance(answer, (bool, int, float)):
        return str(answer)
    raise BadRecordError("invalid_record", f"column {column!r}: expected one answer text, got "
                                           f"{type(answer).__name__} {answer!r:.60} (map a column of single answers)")


def prompt_turns(prompt: Any, column: str) -> list:
    """The turns of a conversational prompt (a list of messages): no assistant turn, since SFT trains every assistant
    turn and TRL's prompt-completion trains the completion only (such a conversation belongs in a messages column)."""
    turns = list(prompt)
    for i, m in enumerate(turns):
        if isinstance(m, dict) and m.get("role") == "assistant":
            raise BadRecordError("invalid_record", f"column {column!r}[{i}]: an assistant turn in a conversational "
                                                   "prompt would be trained (only the completion is); map such "
                                                   "conversations as a messages column")
    return turns


def completion_turns(completion: Any, column: str) -> list[dict]:
    """A completion cell as its assistant turn: a string (or number), or one assistant message (TRL's conversational
    completion: [{"role": "assistant", "content": ...}])."""
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        if len(completion) != 1 or not isinstance(completion[0], dict) or completion[0].get("role") != "assistant":
            raise BadRecordError("invalid_record", f"column {column!r}: a conversational completion must be one "
                                                   f"assistant message, got {completion!r:.80}")
        return [dict(completion[0])]
    return [{"role": "assistant", "content": answer_text(completion, column)}]
