"""A tool conversation rolled out turn by turn is the conversation the chat template renders whole.

The reference is the template's rendering of the full message list (the processor's `render`, i.e. transformers'
`apply_chat_template`, placeholders expanded as for a prompt) tokenized as one text: the prompt's ids followed by
the trajectory's (the model's turns, the tool's reply turn and the headers between them) must equal it, up to the
template's newline after the last turn, which no model turn writes. The loss mask covers exactly the model's
tokens (each turn's text and its `<|im_end|>`), with one behaviour log-prob each, and the reward's text is the
last model turn. The model's turns are scripted through the sampler (a call of the built-in `calculator`, then
the answer), the loop, engine, environment and turn encoder are the real ones; two templates: the tiny ChatML one
(a `tool` turn) and one written after Qwen's tool template (replies in a user turn, `<tool_response>` markup)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from multiturn_helpers import vqa_file

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.expansion import expand
from megatron_vlm.data.processor import load_processor
from megatron_vlm.inference import multiturn as multiturn_module
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.rl.env.builtin import CalculatorEnv
from megatron_vlm.rl.env.config import RLEnvConfig
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.rollout import MultiTurnRounds
from megatron_vlm.rl.env.turns import tools_system_text
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.rl.prompts.shard import EncodedShard
from megatron_vlm.testing.synthesize import synthesize_model_folder
from tests.unit.data.test_tool_call_messages import TOOL_TEMPLATE

# Written here after the behaviour of Qwen3's chat template: an assistant turn after the last user message is written
# with its reasoning (`<think>...</think>` split out of the content and written back normalised); the LAST message,
# when it is an assistant turn, always gets a think block, an empty one when it has no reasoning, which the same turn
# loses once a tool reply follows it. Newlines after block tags are expressions (transformers' trim_blocks).
QWEN3_THINK_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|im_start|>system{{ '\\n' }}{{ m['content'] }}<|im_end|>{{ '\\n' }}"
    "{% elif m['role'] == 'user' %}<|im_start|>user{{ '\\n' }}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for it in m['content'] %}{% if it['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif it['type'] == 'text' %}{{ it['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}"
    "{% elif m['role'] == 'assistant' %}{% set content = m['content'] %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant{{ '\\n' }}"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}<think>{{ '\\n' }}{{ reasoning }}{{ '\\n' }}</think>{{ '\\n\\n' }}{% endif %}"
    "{{ content }}<|im_end|>{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m['content'] }}{{ '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

TURNS = ['<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>', "It is 42"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("render")
    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp / "model", seed=0)
    return load_hf_model(str(folder)).eval(), load_processor(str(folder)), vqa_file(tmp / "vqa")


def _rollout(model, proc, vqa, turns, monkeypatch):
    """The conversation of scripted model turns `turns` (each closed with `<|im_end|>`) through the real loop."""
    tok = proc.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    script = [t for text in turns for t in tok(text, add_special_tokens=False)["input_ids"] + [im_end]]
    drawn = iter(script)
    real = multiturn_module.sample_tokens

    def scripted(logits, **kw):  # the model's turns: the script's tokens, log-probs of the real logits
        real(logits, **kw)
        ids = torch.tensor([next(drawn) for _ in range(logits.shape[0])])
        return ids, torch.log_softmax(logits.float(), -1).gather(1, ids[:, None])[:, 0]

    monkeypatch.setattr(multiturn_module, "sample_tokens", scripted)
    engine = PolicyRolloutEngine(model, tok, EngineOptions(max_num_seqs=1))
    rounds = MultiTurnRounds(RLEnvConfig(name="calculator", max_turns=3), engine, proc, max_total_tokens=2048,
                             runner=InlineEnvRunner())
    encoder = rounds.prompt_encoder(PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=160, max_tokens=2048))
    sample = load_prompt_dataset(vqa, schema="messages").samples[0]
    prompt = encoder.encode(sample)
    _, (t,) = rounds.generate(EncodedShard([sample], [prompt]), SamplingParams(max_new_tokens=160, n=1), seed=0)
    return rounds.prompt_encoder_messages(sample), prompt, t, script


def _ids(proc, prompt, messages, **kw):
    """The template's rendering of `messages`, placeholders expanded for the prompt's images, tokenized at once."""
    items = proc.process_images(list(prompt.images))
    text = expand(proc.render(messages, **kw), proc.placeholders, {"image": [it.expansion for it in items], "video": []})
    return proc.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("template", ["chatml", "qwen_tools"])
def test_turn_by_turn_equals_the_whole_rendering(tiny, template, monkeypatch):
    model, proc, vqa = tiny
    if template == "qwen_tools":
        proc = copy.copy(proc)
        proc.chat_template = TOOL_TEMPLATE
    messages, prompt, t, script = _rollout(model, proc, vqa, TURNS, monkeypatch)
    assert t.finish_reason == "done" and t.turn_texts == TURNS and t.text == TURNS[-1]
    whole = messages + [{"role": "assistant", "content": TURNS[0]}, {"role": "tool", "content": "42"},
                        {"role": "assistant", "content": TURNS[1]}]
    reference = _ids(proc, prompt, whole)
    got = prompt.input_ids.tolist() + t.token_ids.tolist()
    assert reference[:len(got)] == got and proc.tokenizer.decode(reference[len(got):]) == "\n"
    assert t.token_ids[t.model_mask].tolist() == script and t.logprobs.numel() == len(script)


@pytest.mark.parametrize("think", [False, True], ids=["plain", "reasoning"])
def test_a_template_that_writes_the_last_turn_apart(tiny, think, monkeypatch):
    """Qwen3's template writes the last assistant message with a think block (empty without reasoning) that the same
    turn loses once the tool's reply follows: rendered as the last message, a model turn is not what the model wrote.
    The turn encoder used to require that rendering to be a prefix of the next one and ended every such trajectory
    as env_error ("the chat template does not render the conversation turn by turn"), so a non-thinking Qwen3 trained
    on nothing. The appended turn is now the rendering with the tool reply after the model's text: prompt +
    trajectory up to the answer equal the template's rendering of the conversation before the answer (generation
    prompt included), then the answer's own tokens."""
    model, proc, vqa = tiny
    proc = copy.copy(proc)
    proc.chat_template = QWEN3_THINK_TEMPLATE
    turns = [("<think>\nI should call the tool.\n</think>\n\n" if think else "") + TURNS[0], TURNS[1]]
    messages, prompt, t, script = _rollout(model, proc, vqa, turns, monkeypatch)
    assert t.finish_reason == "done" and t.turn_texts == turns and not t.error, t.error
    before_answer = _ids(proc, prompt, messages + [{"role": "assistant", "content": turns[0]},
                                                   {"role": "tool", "content": "42"}], add_generation_prompt=True)
    got = prompt.input_ids.tolist() + t.token_ids.tolist()
    answer = proc.tokenizer(turns[1], add_special_tokens=False)["input_ids"] + [script[-1]]
    assert got == before_answer + answer
    assert t.token_ids[t.model_mask].tolist() == script


def test_tool_specs_as_the_models_template_writes_them(tiny):
    """A model whose chat template renders `tools=` (Qwen3's, Qwen3-VL's, ...) gets its prompts' tool specs in that
    template's own text, what transformers' `apply_chat_template(messages, tools=...)` writes (the reference), not
    the Qwen2.5 text with a default system line written for templates that render no tools (the tiny ChatML one
    keeps it). The rollout used to write the latter for every template."""
    model, proc, vqa = tiny
    tools = CalculatorEnv().tools()
    sample = load_prompt_dataset(vqa, schema="messages").samples[0]
    engine = PolicyRolloutEngine(model, proc.tokenizer, EngineOptions(max_num_seqs=1))

    def rounds(p):
        return MultiTurnRounds(RLEnvConfig(name="calculator"), engine, p, max_total_tokens=2048, runner=InlineEnvRunner())

    assert rounds(proc).prompt_encoder_messages(sample)[0]["content"] == tools_system_text(tools)  # no tools of its own
    proc = copy.copy(proc)
    proc.chat_template = TOOL_TEMPLATE
    for messages in (sample.messages, [{"role": "system", "content": "Be brief."}, *sample.messages]):
        ours = rounds(proc).prompt_encoder_messages(dataclasses.replace(sample, messages=messages))
        reference = proc.tokenizer.apply_chat_template(messages, tools=tools, chat_template=TOOL_TEMPLATE,
                                                       tokenize=False, add_generation_prompt=True)
        assert proc.render(ours, add_generation_prompt=True) == reference
