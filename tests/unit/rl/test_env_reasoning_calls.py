"""Tool calls are read from a model turn's answer, never from its `<think>` reasoning (Qwen3 thinking models): a call
the model only considers, or a half-written one, while it reasons is neither run nor answered as malformed."""
from megatron_vlm.rl.env.base import EnvSample
from megatron_vlm.rl.env.builtin import CalculatorEnv
from megatron_vlm.rl.env.tool_calls import ToolCall, ToolCallError, parse_tool_calls, split_reasoning

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n</tool_call>'


def test_calls_inside_reasoning_are_not_parsed():
    thought = '<think>\nI could write <tool_call>{"name": "calculate", "arguments": {"expression": "6*7"\n' \
              "but I know it: 42. A stray </tool_call> too.\n</think>\n\nThe answer is 42."
    assert parse_tool_calls(thought) == []
    env = CalculatorEnv()
    env.reset(EnvSample(problem="6*7?", answer="42"))
    res = env.step(thought)
    assert res.done and res.info == {}  # the final answer: no "malformed call" reply


def test_the_call_after_the_reasoning_is_parsed():
    turn = '<think>\nMaybe <tool_call>{"name": "calc</tool_call>? No: use the real tool.\n</think>\n\n' + CALL
    assert parse_tool_calls(turn) == [ToolCall("calculate", {"expression": "6*7"})]
    # the generation prompt opened the block (Qwen3 thinking templates): only its end is in the turn
    opened = 'Think about <tool_call>{"name": 1}</tool_call> first.\n</think>\n\n' + CALL
    assert parse_tool_calls(opened) == [ToolCall("calculate", {"expression": "6*7"})]
    assert split_reasoning(opened)[1] == "\n\n" + CALL


def test_unclosed_reasoning_is_all_reasoning():
    """A turn that opened `<think>` and never closed it (its end is the turn's end) has no answer to read calls from."""
    assert parse_tool_calls("<think>\nlet me call " + CALL) == []
    assert split_reasoning("<think>\nlet me call " + CALL) == ("\nlet me call " + CALL, "")


def test_turns_without_reasoning_are_unchanged():
    assert parse_tool_calls(CALL) == [ToolCall("calculate", {"expression": "6*7"})]
    (bad,) = parse_tool_calls('<tool_call>{"name": "a"')
    assert isinstance(bad, ToolCallError) and "unclosed" in bad.message
    assert split_reasoning("no reasoning here") == ("", "no reasoning here")
