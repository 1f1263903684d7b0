"""Stop strings mean the same in every engine: matched on the completion's text with its special tokens (where
transformers' `StopStringCriteria` ends a generation: the reference), the text cut at that same occurrence.

Found by review: the built-in check searched the text with special tokens, the final text was cut at the first
occurrence in the text without them, so "is 4" in "it is<|im_start|> 4 and is 4" ended the completion at the second
occurrence and cut its text at the first (the reward scored "it is 4", the update trained " and is 4" too); the vLLM
back end matched stop strings on its text without special tokens, so a stop string equal to a special token's text
(e.g. "<|im_start|>") never ended a vLLM completion, which ran on to EOS where the built-in engine stopped.
"""
from __future__ import annotations

import sys
import threading
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import StopStringCriteria

from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.stopping import StopChecker
from megatron_vlm.testing.tiny_processor import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _reference_end(tok, ids: list[int], stop: str):
    """transformers' answer: the first prefix length after which the generation stops."""
    crit = StopStringCriteria(tok, [stop])
    return next((k for k in range(1, len(ids) + 1) if bool(crit(torch.tensor([ids[:k]]), None)[0])), None)


# (completion, stop string): each stop string ends at a token boundary, so the reference text is the decoding of the
# tokens up to where transformers stops, without special tokens
CASES = [("the answer<|im_start|>user more", "<|im_start|>"),   # a special token's text
         ("it is<|im_start|> 4 and is 4 end", "is 4"),          # only the text without special tokens has it first
         ("x <|im_start|>assistant\nmore", "<|im_start|>assistant"),
         ("4</answer>\n\nmore", "</answer>")]


@pytest.mark.parametrize("text, stop", CASES)
def test_the_builtin_check_stops_where_transformers_does_and_cuts_the_text_there(tok, text, stop):
    ids = tok.encode(text)
    end = _reference_end(tok, ids, stop)
    assert end is not None
    checker = StopChecker(tok, {tok.eos_token_id}, stop=[stop])
    fired = next(k for k in range(1, len(ids) + 1) if checker.check(ids[:k]))
    assert fired == end and checker.check(ids[:end]) == "stop"
    assert checker.final_text(ids[:end], "stop") == tok.decode(ids[:end], skip_special_tokens=True)


def test_the_rest_of_the_completing_token_is_cut_also_after_a_special_token(tok):
    """"<|im_start|>us" ends inside the token "use": the text ends right after the stop string, special token dropped."""
    ids = tok.encode("x<|im_start|>user more")
    end = _reference_end(tok, ids, "<|im_start|>us")
    assert tok.convert_ids_to_tokens(ids[end - 1]) == "se"
    assert StopChecker(tok, {tok.eos_token_id}, stop=["<|im_start|>us"]).final_text(ids[:end], "stop") == "xus"


class _FakeVSP(dict):
    """vllm.SamplingParams as a record of its arguments (vLLM is not installed here)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.output_kind = None


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.SamplingParams = _FakeVSP
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


def _vllm_engine(tok, outputs):
    """A VLLMRolloutEngine around a fake in-process engine that streams `outputs` (one step) for any request."""
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    class Engine:
        def __init__(self):
            self.pending = []

        def has_unfinished_requests(self):
            return bool(self.pending)

        def step(self):
            done, self.pending = self.pending, []
            return [SimpleNamespace(request_id=rid, prompt_token_ids=None, outputs=outputs) for rid in done]

    e = object.__new__(VLLMRolloutEngine)
    e.eos_token_ids, e.logit_bias, e.policy_version, e.weight_push_s = [tok.eos_token_id], None, 0, 0.0
    e._interrupt, e._pause, e._lock, e.asleep = threading.Event(), threading.Event(), threading.RLock(), False
    e.llm = SimpleNamespace(llm_engine=Engine(), get_tokenizer=lambda: tok)
    e.add_request = lambda engine, rid, p, params, seed: engine.pending.append(rid)
    return e


def test_vllm_matches_stop_strings_on_the_text_with_special_tokens(fake_vllm):
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    e = object.__new__(VLLMRolloutEngine)
    e.eos_token_ids, e.logit_bias = [7], None
    sp = e._sampling(SamplingParams(max_new_tokens=8, stop=("<|im_start|>",)), seed=1)
    assert sp["stop"] == ["<|im_start|>"] and sp["skip_special_tokens"] is False and sp["include_stop_str_in_output"]


def test_vllm_completion_text_is_the_builtin_engines(tok, fake_vllm):
    """vLLM ended the completion on the special-token stop string (what it reports under the options above: its
    text with the special token); the sample's text is the built-in engine's text of the same tokens."""
    ids = tok.encode("the answer<|im_start|>")
    out = SimpleNamespace(index=0, token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in ids],
                          text=tok.decode(ids, skip_special_tokens=False), finish_reason="stop",
                          stop_reason="<|im_start|>")
    e = _vllm_engine(tok, [out])
    prompt = RolloutPrompt(input_ids=torch.tensor(tok.encode("hi")))
    result = e.generate([prompt], SamplingParams(max_new_tokens=8, stop=("<|im_start|>",)))
    s = result.samples[0]
    builtin = StopChecker(tok, [tok.eos_token_id], stop=["<|im_start|>"])
    assert s.finish_reason == "stop" == builtin.check(ids)
    assert s.text == builtin.final_text(ids, "stop") == "the answer"
