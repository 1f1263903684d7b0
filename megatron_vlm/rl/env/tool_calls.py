"""Tool calls in a model turn: the Qwen2.5 / Qwen3 `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form.

Why a parser of our own: the chat templates of Qwen2.5(-VL) and Qwen3(-VL) tell the model to write each call
as one JSON object between `<tool_call>` and `</tool_call>` (several calls in one turn are several blocks);
transformers renders that markup but does not parse it back. A malformed call (not JSON, no "name",
"arguments" not an object, an unclosed tag, JSON the decoder refuses, a "\\ud800" escape that is no character)
is not an exception: it comes back as a `ToolCallError` in the turn's order, and the environment answers it
with an error message as the tool's reply (counted), so a model learning the syntax gets a signal instead of
a crashed rollout.

Reasoning is not read: in a turn of a thinking model (Qwen3: `<think> ... </think>` before the answer) calls are
parsed from the answer only (`split_reasoning`), as vLLM's Qwen3 reasoning parser hands its tool parser only the
content after `</think>`, so a call the model merely considers while it reasons, or a half-written one, is neither
run nor answered as malformed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Union

__all__ = ["ToolCall", "ToolCallError", "parse_tool_calls", "split_reasoning", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE",
           "THINK_OPEN", "THINK_CLOSE"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A block that is not a valid call: `message` says why (shown to the model as the tool's reply)."""

    text: str
    message: str


def _encodable(obj: Any) -> bool:
    """Every string of the decoded call is text UTF-8 can write (JSON's "\\ud800" escape decodes to a lone
    surrogate, which the tokenizer refuses when a tool's reply shows it)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        return False
    return True


def _one(body: str, closed: bool) -> Union[ToolCall, ToolCallError]:
    text = body.strip()
    if not closed:
        return ToolCallError(text, f"unclosed {TOOL_CALL_OPEN}: end each call with {TOOL_CALL_CLOSE}")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCallError(text, f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    except (ValueError, RecursionError) as e:  # an int of > 4300 digits, brackets nested too deep: the decoder's limits
        return ToolCallError(text, f"the tool call is JSON the decoder refuses ({type(e).__name__})")
    if not isinstance(obj, dict):
        return ToolCallError(text, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(text, 'the tool call has no "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):  # JSONDecodeError, and the decoder's limits
            return ToolCallError(text, f'"arguments" of {name} is a string that is not a JSON object')
    if not isinstance(args, dict):
        return ToolCallError(text, f'"arguments" of {name} must be a JSON object')
    if not _encodable(obj) or not _encodable(args):  # args: decoded a second time when given as a string
        return ToolCallError(text, "the tool call has a \\uXXXX escape that is not a character (a lone surrogate)")
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return ToolCallError(text, f"unexpected keys {extra} in the tool call (only name and arguments)")
    return ToolCall(name, args)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a model turn. With a `</think>`, the answer is what follows its first one (as vLLM's
    Qwen3 reasoning parser splits it) and the reasoning what precedes it (after a `<think>`, when the turn wrote one: a
    template whose generation prompt opens the block leaves only its end in the turn); a turn that opens `<think>`
    and never closes it reasons from there to its end (cut off, or ended while still thinking); a turn with neither
    tag is all answer."""
    before, closed, answer = text.partition(THINK_CLOSE)
    if closed:
        head, opened, reasoning = before.partition(THINK_OPEN)
        return (reasoning if opened else head), answer
    head, opened, reasoning = text.partition(THINK_OPEN)
    return (reasoning, head) if opened else ("", text)


def parse_tool_calls(text: str) -> list[Union[ToolCall, ToolCallError]]:
    """Every `<tool_call>` block of a model turn's answer (its reasoning left out: `split_reasoning`), in order: a
    `ToolCall` or a `ToolCallError` each. A stray `</tool_call>` without an opening tag is an error too; a turn
    without blocks gives []."""
    text = split_reasoning(text)[1]
    out: list[Union[ToolCall, ToolCallError]] = []
    for m in _BLOCK.finditer(text):
        out.append(_one(m.group(1), bool(m.group(2))))
    if not out and TOOL_CALL_CLOSE in text:
        out.append(ToolCallError(text, f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}"))
    return out
