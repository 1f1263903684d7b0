"""A tool registry built from plain Python functions, and the environment that runs a model's tool calls.

`ToolRegistry([fn, ...])` reads each function's signature: parameters annotated `str`, `int`, `float`,
`bool`, `list` or `dict` become a JSON-schema object (required = parameters without a default), the first
docstring line the description; a function documented for TRL (Google-style Args) gets transformers' spec
(`function_schema`); `schema=` overrides it. `specs()` is the list the chat template renders
into the system prompt (`tools=` of `apply_chat_template`, in the OpenAI function form every Qwen template
reads). `call(ToolCall)` checks the arguments against the schema and runs the function; an unknown tool,
a bad argument, an exception in the tool or a return value the conversation cannot show (not text, JSON data or
(text, [PIL images / HxWx3 uint8 arrays])) becomes an error text (the tool's reply), never a crash.

`ToolEnvironment(tools)`: after each model turn, every `<tool_call>` block (rl/env/tool_calls.py) is run
and answered with one tool turn per call; a turn without a call is the final answer (done). A tool may
return text, or (text, images): a crop / zoom tool shows the model a new image in the next turn.

A call's deadline (`[rl.env] tool_timeout_s`, set for a step by `tool_deadline`): a tool still running then is
stopped and answered "timed out" (counted in `tool_timeouts` and `tool_errors`), and the conversation goes on. Why a
signal and not a thread or a process per call: the tool runs in the environment's worker, on that worker's main
thread, on the environment object the step sends back; SIGALRM raises `ToolTimeout` inside the tool's own frame, so
the call unwinds (its `finally` blocks and context managers run) and the worker stays usable, where an abandoned
thread would keep running beside the next calls (and mutating the environment) and a child process would lose
what the tool changed in the environment. What a signal cannot stop is left to the whole-turn deadline
(`turn_timeout_s`: the worker is killed and replaced, the trajectory ends as env_error): a tool blocked in C code
that does not return to Python (the handler runs when it does), one that catches `BaseException` and keeps going
(a late return is still answered as timed out). The calls of one turn share its time: each is also stopped when
what is left of the turn (less a reserve for the reply) runs out.
A stopped tool may leave its environment's state half changed, as a tool that raises does. Outside the main thread
(or with an interval timer already set) no deadline is applied.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Optional

from megatron_vlm.rl.env.base import Environment, Observation, StepResult
from megatron_vlm.rl.env.tool_calls import ToolCall, ToolCallError, parse_tool_calls

__all__ = ["ToolRegistry", "ToolEnvironment", "ToolReply", "ToolTimeout", "function_schema", "tool_deadline"]

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_CHECK = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
          "object": (dict,), "null": (type(None),)}


def function_schema(fn: Callable) -> dict:
    """The OpenAI-style function spec of `fn`. A function whose docstring documents every argument (Google style,
    an `Args:` section) gets transformers' `get_json_schema`, the spec TRL's tools and `apply_chat_template(tools=
    [fn])` write (argument descriptions; Optional, list[...], Literal hints), so a tool written for them shows the
    model the same text; any other gets the spec of its signature (str / int / float / bool / list / dict
    parameters) and the first docstring line."""
    try:
        from transformers.utils import get_json_schema

        return get_json_schema(fn)
    except Exception:  # noqa: BLE001 - no Args section, a hint it does not read, no transformers: the signature's spec
        pass
    props: dict[str, dict] = {}
    required = []
    hints = inspect.get_annotations(fn, eval_str=True)
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {fn.__name__}: *args / **kwargs cannot be described as JSON-schema arguments")
        tp = hints.get(p.name, str)
        if tp not in _JSON_TYPES:
            raise ValueError(f"tool {fn.__name__}: parameter {p.name} is annotated {tp!r}; use str, int, float, bool, "
                             "list or dict (or pass schema=)")
        props[p.name] = {"type": _JSON_TYPES[tp]}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    doc = (inspect.getdoc(fn) or fn.__name__).strip().splitlines()[0]
    return {"type": "function", "function": {"name": fn.__name__, "description": doc,
                                             "parameters": {"type": "object", "properties": props, "required": required}}}


class ToolTimeout(BaseException):
    """Raised inside a tool's call at its deadline: a BaseException, so the tool's own `except Exception` lets it
    through."""


_deadline_s = 0.0
"""The current step's deadline of one tool call, in seconds (0: none): `tool_deadline`."""
_turn_end = 0.0
"""time.monotonic() by which the current step's tool calls must be done (0: no bound): `tool_deadline`."""
TURN_RESERVE = 0.2
"""The share of a step's deadline kept for what follows its tool calls (building and pickling the reply)."""


@contextlib.contextmanager
def tool_deadline(seconds: float, turn_s: float = 0.0) -> Iterator[None]:
    """Within this block every tool call of a `ToolRegistry` is stopped after `seconds` (0: never; module docstring),
    and, with `turn_s` (the step's own deadline, `turn_timeout_s`), by the time (1 - TURN_RESERVE) x `turn_s` from
    now: the calls of one turn share its time, so several hanging calls are each answered "timed out" before the
    turn's deadline kills the worker. The environment worker wraps each step in it (rl/env/pool.py `run_call`)."""
    global _deadline_s, _turn_end
    before = _deadline_s, _turn_end
    _deadline_s = max(0.0, float(seconds or 0.0))
    _turn_end = time.monotonic() + (1.0 - TURN_RESERVE) * turn_s if _deadline_s and turn_s > 0 else 0.0
    try:
        yield
    finally:
        _deadline_s, _turn_end = before


def _call_deadline() -> float:
    """The deadline of the next tool call in seconds: the step's, cut to what is left of its turn (0: none; a call
    with no time left gets a moment, so it is answered "timed out" rather than not at all)."""
    if not _deadline_s or not _turn_end:
        return _deadline_s
    return max(1e-3, min(_deadline_s, _turn_end - time.monotonic()))


def _can_interrupt() -> bool:
    """Whether a call here can get a SIGALRM deadline: the main thread, no interval timer running, and a SIGALRM
    handler Python can put back afterwards (one installed from C reads as None and could not be restored: such a
    process keeps only the turn's timeout)."""
    return (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0 and signal.getsignal(signal.SIGALRM) is not None)


def _run_with_deadline(fn: Callable, kwargs: dict, seconds: float) -> tuple[Any, bool]:
    """(fn(**kwargs), whether it ran past `seconds`): at the deadline SIGALRM raises `ToolTimeout` in the call (module
    docstring); a call that swallowed it (returned late, or raised something else) counts as timed out too. The
    previous SIGALRM handler is restored. Any other exception of the tool propagates."""
    if seconds <= 0 or not _can_interrupt():
        return fn(**kwargs), False
    fired = False

    def stop(signum: int, frame: Any) -> None:  # noqa: ARG001
        nonlocal fired
        fired = True
        raise ToolTimeout

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            out = fn(**kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
    except ToolTimeout:
        return None, True
    except BaseException:  # noqa: BLE001 - the tool turned the stop into another exception: still its deadline
        if fired:
            return None, True
        raise
    finally:
        signal.signal(signal.SIGALRM, previous)
    return out, fired


class ToolReply(NamedTuple):
    """A tool call's reply: the text and images the model is shown, whether the call worked, whether it timed out."""

    text: str
    images: list
    ok: bool
    timed_out: bool = False


def _check_args(spec: dict, args: dict) -> Optional[str]:
    params = spec["function"].get("parameters", {})
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"missing required arguments {missing}"
    unknown = sorted(set(args) - set(props))
    if unknown:
        return f"unknown arguments {unknown}; the tool takes {sorted(props)}"
    for k, v in args.items():
        prop = props[k] if isinstance(props[k], dict) else {}
        if v is None and prop.get("nullable"):  # transformers' spec of an Optional argument
            continue
        enum = prop.get("enum")
        if isinstance(enum, list) and v not in enum:
            return f"argument {k} must be one of {enum}, got {v!r}"
        want = prop.get("type")
        listed = want if isinstance(want, list) else [want]  # JSON schema's union: "type": ["integer", "null"]
        wants = [w for w in listed if isinstance(w, str) and w in _CHECK]
        if not wants or len(wants) < len(listed):
            continue  # no type, or one this check does not know: the tool checks it
        if not any(_is_type(v, w) for w in wants):
            return f"argument {k} must be of type {' or '.join(wants)}, got {type(v).__name__}"
    return None


def _is_type(value: Any, want: str) -> bool:
    """`value` (decoded JSON) is of JSON-schema type `want` (a bool is no integer / number, as in JSON)."""
    return isinstance(value, _CHECK[want]) and not (want in ("integer", "number") and isinstance(value, bool))


def _not_an_image(image: Any) -> str:
    """Why `image` is not what an observation may show (a PIL image or an HxWx3 uint8 array, not empty: the
    processor's resize divides by its sides), or ""."""
    if type(image).__module__.startswith("PIL."):
        w, h = image.size
        return "" if w > 0 and h > 0 else f"an empty image ({w}x{h} pixels)"
    shape, dtype = getattr(image, "shape", None), getattr(image, "dtype", None)
    if shape is not None and len(shape) == 3 and shape[2] == 3 and str(dtype) == "uint8":
        return "" if shape[0] > 0 and shape[1] > 0 else f"an empty image (array of shape {tuple(shape)})"
    return (f"an image that is not a PIL image or an HxWx3 uint8 array ({type(image).__name__}"
            f"{f' {dtype} {tuple(shape)}' if shape is not None else ''})")


def _text_of(e: BaseException) -> str:
    """str(e), or a stand-in when the exception's own __str__ raises (user code: its failure must stay a reply)."""
    try:
        return str(e)
    except Exception:  # noqa: BLE001
        return "(its message could not be printed)"


def _shown(text: str) -> str:
    """`text` with any lone surrogate (bytes decoded with errors="surrogateescape", say) written as its \\uXXXX
    escape: the tokenizer refuses text UTF-8 cannot encode, which would end the trajectory as env_error."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _schema_name(fn: Callable, schema: dict) -> str:
    """The tool name a given spec shows the model (the one its calls use); ValueError for a spec that is not an
    OpenAI function spec with a name and a parameters object (every call of the tool reads them)."""
    f = schema.get("function") if isinstance(schema, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    params = f.get("parameters", {"type": "object"}) if isinstance(f, dict) else None
    if not isinstance(name, str) or not name or not isinstance(params, dict) or \
            not isinstance(params.get("properties", {}), dict) or not isinstance(params.get("required", []), list):
        raise ValueError(f"tool {getattr(fn, '__name__', fn)}: its schema must be an OpenAI function spec "
                         '{"type": "function", "function": {"name": str, "parameters": {"type": "object", '
                         '"properties": {...}, "required": [...]}}}')
    return name


class ToolRegistry:
    """Tools by name: `functions` (their specs from `function_schema`) plus `schemas` {function name: spec} overrides.
    A tool is called by the name its spec shows the model (an override may rename the function)."""

    def __init__(self, functions: Sequence[Callable] = (), *, schemas: Optional[dict[str, dict]] = None):
        self.functions: dict[str, Callable] = {}
        self._specs: dict[str, dict] = {}
        unknown = sorted(set(schemas or {}) - {fn.__name__ for fn in functions})
        if unknown:
            raise ValueError(f"schemas: {unknown[0]!r} names no function of the registry (keys are the Python "
                             f"functions' names: {sorted(fn.__name__ for fn in functions)})")
        for fn in functions:
            self.add(fn, schema=(schemas or {}).get(fn.__name__))

    def add(self, fn: Callable, *, schema: Optional[dict] = None) -> None:
        if schema is None:
            schema = function_schema(fn)
        name = _schema_name(fn, schema)
        if name in self.functions:
            raise ValueError(f"tool {name}: registered twice")
        self.functions[name] = fn
        self._specs[name] = schema

    def specs(self) -> list[dict]:
        return [self._specs[n] for n in self.functions]

    def call(self, call: ToolCall) -> tuple[str, list, bool]:
        """(reply text, images, ok) of one call."""
        text, images, ok, _ = self.reply(call)
        return text, images, ok

    def reply(self, call: ToolCall) -> ToolReply:
        """The reply to one call, `timed_out` when it ran past the step's `tool_deadline` (an error reply)."""
        fn = self.functions.get(call.name)
        if fn is None:
            return ToolReply(f"Error: unknown tool {call.name!r}; available: {sorted(self.functions)}", [], False)
        why = _check_args(self._specs[call.name], call.arguments)
        if why is not None:
            return ToolReply(f"Error: {call.name}: {why}", [], False)
        seconds = _call_deadline()
        try:
            out, late = _run_with_deadline(fn, call.arguments, seconds)
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- a tool's failure (sys.exit too) is the model's feedback
            return ToolReply(f"Error: {call.name} raised {type(e).__name__}: {_text_of(e)}"[:500], [], False)
        if late:
            return ToolReply(f"Error: {call.name} timed out after {seconds:.3g} s and was stopped", [], False, True)
        return ToolReply(*self._shown_result(call.name, out))

    @staticmethod
    def _shown_result(name: str, out: Any) -> tuple[str, list, bool]:
        """(text, images, ok) of a tool's return value."""
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
            bad = next((why for why in map(_not_an_image, out[1]) if why), None)
            if bad:
                return f"Error: {name} returned {bad}", [], False
            return str(out[0]), list(out[1]), True
        if isinstance(out, str):
            return out, [], True
        try:
            return json.dumps(out), [], True
        except (TypeError, ValueError, RecursionError) as e:  # a set, an object, nesting too deep: the model's feedback
            return f"Error: {name} returned {type(out).__name__}, not text or JSON data: {_text_of(e)}"[:500], [], False


class ToolEnvironment(Environment):
    """Runs the tool calls of each turn (module docstring); `reward_fn(final_text, sample) -> float` (optional)
    scores the final answer as this environment's reward (the `[[rl.rewards]]` verifiers score it too)."""

    def __init__(self, tools: Sequence[Callable] = (), *, registry: Optional[ToolRegistry] = None,
                 reward_fn: Optional[Callable] = None):
        self.registry = registry if registry is not None else ToolRegistry(tools)
        self.reward_fn = reward_fn

    @property
    def gives_rewards(self) -> bool:  # type: ignore[override]
        """With a `reward_fn`, or in a subclass with its own `step` (which may return rewards of its own)."""
        return self.reward_fn is not None or type(self).step is not ToolEnvironment.step

    def tools(self) -> list[dict]:
        return self.registry.specs()

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action)
        if not calls:
            reward = float(self.reward_fn(action, self.sample)) if self.reward_fn is not None else 0.0
            return StepResult(Observation(), reward=reward, done=True)
        parts: list[dict] = []
        images: list = []
        errors = timeouts = 0
        for c in calls:
            if isinstance(c, ToolCallError):
                parts.append({"role": "tool", "text": f"Error: malformed tool call: {c.message}"})
                errors += 1
                continue
            text, imgs, ok, late = self.registry.reply(c)
            errors += not ok
            timeouts += late
            parts.append({"role": "tool", "text": _shown(text), "images": len(imgs)})
            images.extend(imgs)
        return StepResult(Observation(images=images, role="tool", parts=parts), done=False,
                          info={"tool_calls": len(calls), "tool_errors": errors, "tool_images": len(images),
                                "tool_timeouts": timeouts})
