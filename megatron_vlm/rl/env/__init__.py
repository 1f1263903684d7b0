"""Multi-turn environments for GRPO rollouts: the `Environment` interface, tool calls, the sandboxed runner.

`base.py` the interface a user subclasses; `tool_calls.py` the Qwen `<tool_call>` parser; `tools.py` the
tool registry and the tool-running environment; `builtin.py` the built-in environments; `pool.py` their
sandboxed workers; `config.py` the `[rl.env]` table; `turns.py` observations into chat-template tokens
(their text as plain text: `data/plain_text.py`);
`session.py` the bridge the multi-turn engine (inference/multiturn.py) calls. Like the rewards package, this
file imports nothing, so environment workers start without torch.
"""
