"""Tool calls of a model turn (the Qwen2.5 / Qwen3 `<tool_call>` JSON form): valid, several in one turn, and
malformed ones answered with an error message (counted), never an exception; the tool registry's JSON schema
from plain functions; the built-in calculator and the tool-running environment."""
import json

import pytest

from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.builtin import CalculatorEnv, calculate
from megatron_vlm.rl.env.tool_calls import ToolCall, ToolCallError, parse_tool_calls
from megatron_vlm.rl.env.tools import ToolEnvironment, ToolRegistry, function_schema
from megatron_vlm.rl.env.turns import tools_system_text, with_tools


def test_one_valid_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*(3+4)"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculate", {"expression": "2*(3+4)"})]


def test_several_calls_in_one_turn_in_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>'
            '<tool_call>{"name": "c"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]}), ToolCall("c", {})]


def test_no_call():
    assert parse_tool_calls("The answer is 42.") == []


@pytest.mark.parametrize("body, why", [
    ('{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
    ('["a", 1]', "must be a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": "a", "arguments": [1]}', "must be a JSON object"),
    ('{"name": "a", "arguments": "x=1"}', "not a JSON object"),
    ('{"name": "a", "arguments": {}, "id": 3}', "unexpected keys ['id']"),
])
def test_malformed_calls_are_errors(body, why):
    (got,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(got, ToolCallError) and why in got.message


def test_unclosed_and_stray_tags():
    calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b"')
    assert calls[0] == ToolCall("a", {}) and isinstance(calls[1], ToolCallError) and "unclosed" in calls[1].message
    (stray,) = parse_tool_calls('{"name": "a"}</tool_call>')
    assert isinstance(stray, ToolCallError)


def test_function_schema_and_argument_checks():
    def lookup(city: str, days: int, metric: bool = True) -> str:
        """Weather forecast for a city.

        More text."""
        return f"{city}:{days}:{metric}"

    spec = function_schema(lookup)
    assert spec == {"type": "function", "function": {
        "name": "lookup", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "metric": {"type": "boolean"}},
                       "required": ["city", "days"]}}}
    reg = ToolRegistry([lookup])
    assert reg.call(ToolCall("lookup", {"city": "Oslo", "days": 2})) == ("Oslo:2:True", [], True)
    for call, why in ((ToolCall("lookup", {"city": "Oslo"}), "missing required arguments ['days']"),
                      (ToolCall("lookup", {"city": "Oslo", "days": "2"}), "days must be of type integer"),
                      (ToolCall("lookup", {"city": "Oslo", "days": True}), "days must be of type integer"),
                      (ToolCall("lookup", {"city": "Oslo", "days": 1, "x": 0}), "unknown arguments ['x']"),
                      (ToolCall("nope", {}), "unknown tool 'nope'")):
        text, images, ok = reg.call(call)
        assert not ok and why in text

    def odd(x: set) -> str:
        return ""

    with pytest.raises(ValueError, match="annotated"):
        function_schema(odd)


def test_tool_exception_is_a_reply():
    def boom(x: int) -> str:
        """Fails."""
        raise ZeroDivisionError("x / 0")

    text, _, ok = ToolRegistry([boom]).call(ToolCall("boom", {"x": 1}))
    assert not ok and text == "Error: boom raised ZeroDivisionError: x / 0"


def test_calculator():
    assert calculate("2*(3+4) - 10/4") == "11.5"
    assert calculate("12 // 5 + 2**3") == "10"
    for bad in ("__import__('os')", "2**1000", "a + 1", "[1, 2]"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)


def test_calculator_refuses_nested_powers_before_computing_them():
    """Each exponent is <= 64 but the result is not bounded by it: "(((10**64)**64)**64)**64" took 65 s of CPU (past
    the 30 s turn deadline: the worker was killed, the trajectory an env_error) before failing to print its 1.7e7
    digits. Refused as too large before it is computed, as the tool's error reply."""
    for bad in ("((10**64)**64)**64", "(((10**64)**64)**64)**64", "(-(99**64))**64", "99.5**64**64"):
        with pytest.raises(ValueError, match="too large"):
            calculate(bad)
    assert calculate("(10**64)**60") == "1" + "0" * 3840  # 3841 digits: within the bound
    assert calculate("0.5**64") == str(0.5**64) and calculate("(-10)**63") == "-1" + "0" * 63
    assert calculate("10**-64") == str(10**-64)


def test_calculator_refuses_a_result_that_is_not_a_real_number():
    """A negative base to a fractional power: Python's `**` gives a complex number, which the calculator showed the
    model as "(1.0000000000000002+1.7320508075688772j)" for the cube root of -8; refused like `math.pow`'s domain
    error (the tool's error reply), and the real results around it unchanged."""
    for bad in ("(-8) ** (1/3)", "(-2) ** 0.5", "(0 - 1) ** 0.25"):
        with pytest.raises(ValueError, match="not a real number"):
            calculate(bad)
    assert calculate("(-8) ** 2") == "64" and calculate("-8 ** 0.5") == str(-(8 ** 0.5))
    assert calculate("8 ** (1/3)") == "2" and calculate("2 ** -1") == "0.5"


def test_tool_environment_turns():
    env = CalculatorEnv()
    env.reset(EnvSample(problem="3+4?", answer="7"))
    res = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "3+4"}}</tool_call>'
                   '<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call><tool_call>oops</tool_call>')
    assert not res.done and res.observation.role == "tool"
    assert [p["text"] for p in res.observation.parts][0] == "7"
    assert "missing required arguments ['expression']" in res.observation.parts[1]["text"]
    assert res.observation.parts[2]["text"].startswith("Error: malformed tool call: the tool call is not valid JSON")
    assert res.info == {"tool_calls": 3, "tool_errors": 2, "tool_images": 0, "tool_timeouts": 0}
    final = env.step("The answer is 7.")
    assert final.done


def test_reward_fn_scores_the_final_turn():
    env = ToolEnvironment([calculate], reward_fn=lambda text, sample: float(sample.answer in text))
    env.reset(EnvSample(problem="", answer="7"))
    assert env.step("It is 7").reward == 1.0


def test_tools_in_the_system_turn():
    tools = CalculatorEnv().tools()
    text = tools_system_text(tools)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text and "<tool_call>" in text
    msgs = with_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools)
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and msgs[1] == {"role": "user", "content": "hi"}
    assert with_tools([{"role": "user", "content": "hi"}], tools)[0]["role"] == "system"


def test_a_system_turn_of_text_parts_takes_the_tools():
    """A system turn in the OpenAI list form ([{"type": "text", ...}], as the messages schema allows) gets the tool
    specs as a string system turn does: it used to stay as it was behind a second, default system turn with the
    tools (two system turns; "You are a helpful assistant." before the dataset's own instructions)."""
    tools = CalculatorEnv().tools()
    parts = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Use digits."}]
    msgs = with_tools([{"role": "system", "content": parts}, {"role": "user", "content": "hi"}], tools)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"] == tools_system_text(tools, "Be brief. Use digits.")


def test_a_tool_returning_garbage_is_an_error_reply():
    """A return value that is neither text, JSON-serialisable data nor (text, [images]) is the tool's error reply (the
    model's feedback), not an exception out of the environment that would end the trajectory as "env_error"."""
    import numpy as np

    def odd_set() -> str:
        """Returns a set."""
        return {1, 2}  # type: ignore[return-value]

    def odd_image() -> str:
        """Returns an image that is not one."""
        return "look:", ["not an image"]  # type: ignore[return-value]

    def grey() -> str:
        """Returns a 2-D array as an image."""
        return "look:", [np.zeros((4, 4), dtype=np.uint8)]  # type: ignore[return-value]

    reg = ToolRegistry([odd_set, odd_image, grey])
    for name in ("odd_set", "odd_image", "grey"):
        text, images, ok = reg.call(ToolCall(name, {}))
        assert not ok and images == [] and text.startswith(f"Error: {name} returned "), text
    env = ToolEnvironment(registry=reg)
    env.reset(EnvSample(problem=""))
    res = env.step('<tool_call>{"name": "odd_set", "arguments": {}}</tool_call>')
    assert not res.done and res.info["tool_errors"] == 1 and res.observation.images == []
    ok_image = np.zeros((4, 4, 3), dtype=np.uint8)

    def good() -> str:
        """Returns an HxWx3 uint8 image."""
        return "look:", [ok_image]  # type: ignore[return-value]

    assert ToolRegistry([good]).call(ToolCall("good", {}))[1:] == ([ok_image], True)


@pytest.mark.parametrize("body", [
    '{"name": "a", "arguments": {"x": ' + "[" * 100_000 + "}}",  # RecursionError in json.loads
    '{"name": "a", "arguments": {"x": ' + "1" * 5000 + "}}",  # ValueError: an int of more than 4300 digits
    '{"name": "a", "arguments": "{\\"x\\": ' + "9" * 5000 + '}"}',  # the same in arguments written as a string
], ids=["deep", "huge_int", "huge_int_in_string"])
def test_json_the_decoder_refuses_is_a_malformed_call(body):
    """Deeply nested brackets or a huge number in the model's call raise RecursionError / ValueError (not
    JSONDecodeError) from json.loads: the turn's error reply, not an exception ending the trajectory."""
    (got,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(got, ToolCallError) and "JSON" in got.message


def test_a_tool_whose_failure_cannot_be_described_or_serialised_is_an_error_reply():
    """An exception whose str() raises, and a return value too deeply nested for json.dumps (RecursionError), are
    the tool's error reply as the docs promise, not an exception out of the environment."""

    class Odd(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    def raises_odd() -> str:
        """Raises an exception that cannot be printed."""
        raise Odd()

    def deep() -> str:
        """Returns deeply nested data."""
        out: list = []
        for _ in range(100_000):
            out = [out]
        return out  # type: ignore[return-value]

    reg = ToolRegistry([raises_odd, deep])
    text, _, ok = reg.call(ToolCall("raises_odd", {}))
    assert not ok and text.startswith("Error: raises_odd raised Odd"), text
    text, _, ok = reg.call(ToolCall("deep", {}))
    assert not ok and text.startswith("Error: deep returned list"), text


def test_a_lone_surrogate_escape_is_a_malformed_call():
    """`"\\ud800"` is valid JSON but not a character: the string it decodes to cannot be encoded as UTF-8, so the
    tokenizer refuses a tool reply that shows it (TypeError: the trajectory ended as env_error). The call is
    refused as malformed, the model's feedback."""
    (got,) = parse_tool_calls('<tool_call>{"name": "echo", "arguments": {"q": "a\\ud800b"}}</tool_call>')
    assert isinstance(got, ToolCallError) and "surrogate" in got.message
    (ok,) = parse_tool_calls('<tool_call>{"name": "echo", "arguments": {"q": "\\ud83d\\ude00 \\u00e9"}}</tool_call>')
    assert ok == ToolCall("echo", {"q": "\U0001F600 \u00e9"})  # a surrogate pair is one character
    # arguments written as a JSON string (decoded a second time): the same escape inside it is refused too
    (got,) = parse_tool_calls('<tool_call>{"name": "echo", "arguments": "{\\"q\\": \\"a\\\\ud800b\\"}"}</tool_call>')
    assert isinstance(got, ToolCallError) and "surrogate" in got.message, got


def test_tool_reply_text_is_always_encodable():
    """A tool's text with a lone surrogate (e.g. bytes decoded with errors="surrogateescape") is shown escaped, so
    the turn encoder's tokenizer can take every reply."""

    def raw() -> str:
        """Returns undecodable bytes as text."""
        return b"ok \xff".decode("utf-8", "surrogateescape")

    env = ToolEnvironment([raw])
    env.reset(EnvSample(problem=""))
    res = env.step('<tool_call>{"name": "raw", "arguments": {}}</tool_call>')
    (part,) = res.observation.parts
    part["text"].encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate
    assert part["text"] == "ok \\udcff"


def test_an_empty_image_is_the_tools_error_reply():
    """A crop tool given a degenerate box returns a 0-pixel image: the processor cannot take it (ZeroDivisionError
    in its resize, the trajectory ended as env_error), so it is the tool's error reply like any image it cannot
    show."""
    import numpy as np
    from PIL import Image

    def crop_pil() -> str:
        """An empty PIL crop."""
        return "crop:", [Image.new("RGB", (4, 4)).crop((2, 0, 2, 4))]  # type: ignore[return-value]

    def crop_array() -> str:
        """An empty array crop."""
        return "crop:", [np.zeros((0, 4, 3), dtype=np.uint8)]  # type: ignore[return-value]

    reg = ToolRegistry([crop_pil, crop_array])
    for name in ("crop_pil", "crop_array"):
        text, images, ok = reg.call(ToolCall(name, {}))
        assert not ok and images == [] and text.startswith(f"Error: {name} returned an empty image"), text


def test_a_schema_with_a_union_type_checks_each_type():
    """JSON schema writes an optional argument as "type": ["integer", "null"] (the OpenAI function specs do): the
    check took the list as a dict key (TypeError out of the environment: the trajectory ended as env_error)."""

    def page(n=None) -> str:
        """A page."""
        return f"page {n}"

    spec = {"type": "function", "function": {"name": "page", "description": "A page.", "parameters": {
        "type": "object", "properties": {"n": {"type": ["integer", "null"]}}, "required": []}}}
    reg = ToolRegistry([page], schemas={"page": spec})
    assert reg.call(ToolCall("page", {"n": 3})) == ("page 3", [], True)
    assert reg.call(ToolCall("page", {"n": None})) == ("page None", [], True)
    text, _, ok = reg.call(ToolCall("page", {"n": "3"}))
    assert not ok and "n must be of type integer or null, got str" in text
    text, _, ok = reg.call(ToolCall("page", {"n": True}))
    assert not ok and "got bool" in text


def test_a_tool_calling_exit_is_an_error_reply():
    """sys.exit() in a tool (a script's habit) raises SystemExit, which `except Exception` let through: in the worker
    the trajectory ended as env_error, in the trainer process (sandbox = false) the job exited."""
    import sys

    def quits(code: int) -> str:
        """Exits."""
        sys.exit(code)

    text, _, ok = ToolRegistry([quits]).call(ToolCall("quits", {"code": 3}))
    assert not ok and text == "Error: quits raised SystemExit: 3"


def test_a_schema_override_is_called_by_the_name_it_shows():
    """`schemas=` gives a tool the spec the model sees; the model calls the name in that spec, which the registry
    must run. A spec whose name differs from the Python function's used to be shown but every call of it answered
    "unknown tool" (counted as tool errors, nothing else said); a spec keyed by a name that is no function's was
    dropped without a word (the model saw the generated spec); a spec without its function / parameters failed
    every call of the tool inside the environment's step."""
    def _add(a: int, b: int) -> str:
        return str(a + b)

    spec = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    env = ToolEnvironment(registry=ToolRegistry([_add], schemas={"_add": spec}))
    assert env.tools() == [spec]
    env.reset(EnvSample(problem=""))
    res = env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert res.observation.parts[0]["text"] == "3" and res.info["tool_errors"] == 0
    with pytest.raises(ValueError, match="schemas: 'add' names no function"):
        ToolRegistry([_add], schemas={"add": spec})
    with pytest.raises(ValueError, match="tool _add: its schema"):
        ToolRegistry([_add], schemas={"_add": {"type": "function", "name": "add"}})


def test_a_trl_style_tool_gets_the_schema_transformers_writes():
    """A tool written for TRL (type hints incl. Optional / list[str] / Literal, a Google-style docstring with Args)
    gets the spec transformers' `get_json_schema` writes for it, what TRL's `apply_chat_template(tools=[fn])` shows
    the model (argument descriptions, nullable, items, enum), and calls are checked against it: None for the
    optional argument and a list pass, a value outside the enum is the tool's error reply. Such a function used to be
    refused ("parameter limit is annotated typing.Optional[int]")."""
    from typing import Literal, Optional

    from transformers.utils import get_json_schema

    def search(query: str, limit: Optional[int] = None, tags: Optional[list[str]] = None,
               mode: Literal["fast", "deep"] = "fast") -> str:
        """Search the corpus.

        Args:
            query: What to look for.
            limit: At most this many results.
            tags: Only results with these tags.
            mode: fast or deep.
        """
        return f"{query}|{limit}|{tags}|{mode}"

    reg = ToolRegistry([search])
    assert reg.specs() == [get_json_schema(search)]
    assert reg.call(ToolCall("search", {"query": "q", "limit": None, "tags": ["a"]})) == ("q|None|['a']|fast", [], True)
    text, _, ok = reg.call(ToolCall("search", {"query": "q", "mode": "slow"}))
    assert not ok and "mode must be one of ['fast', 'deep']" in text
    text, _, ok = reg.call(ToolCall("search", {"query": None}))
    assert not ok and "query must be of type string" in text
    assert function_schema(calculate)["function"]["parameters"]["properties"] == {"expression": {"type": "string"}}
