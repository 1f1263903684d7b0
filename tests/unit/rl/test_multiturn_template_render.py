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

import pytest
import torch
from multiturn_helpers import vqa_file

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.data.expansion import expand
from megatron_vlm.data.processor import load_processor
from megatron_vlm.inference import multiturn as multiturn_module
from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.rl.env.config import RLEnvConfig
from megatron_vlm.rl.env.pool import InlineEnvRunner
from megatron_vlm.rl.env.rollout import MultiTurnRounds
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
from megatron_vlm.rl.prompts.encoder import PromptEncoder
from megatron_vlm.rl.prompts.shard import EncodedShard
from megatron_vlm.testing.synthesize import synthesize_model_folder
from tests.unit.data.test_tool_call_messages import TOOL_TEMPLATE

TURNS = ['<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>', "It is 42"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("render")
    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp / "model", seed=0)
    return load_hf_model(str(folder)).eval(), load_processor(str(folder)), vqa_file(tmp / "vqa")


@pytest.mark.parametrize("template", ["chatml", "qwen_tools"])
def test_turn_by_turn_equals_the_whole_rendering(tiny, template, monkeypatch):
    model, proc, vqa = tiny
    if template == "qwen_tools":
        proc = copy.copy(proc)
        proc.chat_template = TOOL_TEMPLATE
    tok = proc.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    script = [t for text in TURNS for t in tok(text, add_special_tokens=False)["input_ids"] + [im_end]]
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
    encoder = rounds.prompt_encoder(PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=128, max_tokens=2048))
    sample = load_prompt_dataset(vqa, schema="messages").samples[0]
    prompt = encoder.encode(sample)
    _, (t,) = rounds.generate(EncodedShard([sample], [prompt]), SamplingParams(max_new_tokens=128, n=1), seed=0)
    assert t.finish_reason == "done" and t.turn_texts == TURNS and t.text == TURNS[-1]

    whole = rounds.prompt_encoder_messages(sample) + [
        {"role": "assistant", "content": TURNS[0]}, {"role": "tool", "content": "42"},
        {"role": "assistant", "content": TURNS[1]}]
    items = proc.process_images(list(prompt.images))
    text = expand(proc.render(whole), proc.placeholders, {"image": [it.expansion for it in items], "video": []})
    reference = tok(text)["input_ids"]
    got = prompt.input_ids.tolist() + t.token_ids.tolist()
    assert reference[:len(got)] == got and tok.decode(reference[len(got):]) == "\n"
    assert t.token_ids[t.model_mask].tolist() == script and t.logprobs.numel() == len(script)
