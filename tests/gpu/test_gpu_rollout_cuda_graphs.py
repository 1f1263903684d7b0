"""CUDA-graph decode steps of the rollout engine (`cuda_graphs = "on"` on a CUDA device) against eager steps.

Skipped without CUDA. Greedy rollouts in fp32 with early finishes and refills (several batch-size
buckets): the tokens of the replayed graphs equal the eager engine's and the log-probs agree within
1e-4 (attention over the whole slot capacity vs the longest sequence: a different summation order);
a capture happened for every bucket used and never twice; weights copied in place between calls
(what `load_weights` does) are what the kept graphs of the next call read. The CPU tests
(tests/unit/rl/test_rollout_decode_graphs.py) check the same static step run eagerly.
"""
from __future__ import annotations

import pytest
import torch

from megatron_vlm.inference.decode_graphs import DecodeStepRunner
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
from megatron_vlm.models import build_model
from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_vl_tokenizer, tiny_nemotron_vl_hf_config
from tests.fixtures import tiny_qwen2_5_vl as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Tok:
    pad_token_id = 0
    eos_token_id = -1

    def decode(self, ids, skip_special_tokens=False):
        return ""


def _model(family: str):
    torch.manual_seed(0)
    if family == "qwen2_5_vl":
        cfg = F.tiny_qwen2_5_vl_config_dict()
    else:
        cfg = tiny_nemotron_vl_hf_config(build_tiny_nemotron_vl_tokenizer())
        cfg["text_config"]["layers_block_type"] = ["linear_attention", "full_attention", "mlp", "linear_attention"]
    return build_model(cfg).eval().cuda()


def _engine(model, eos, mode):
    return PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=eos, max_num_seqs=5, cuda_graphs=mode))


PARAMS = SamplingParams(max_new_tokens=12, n=2, temperature=0.0)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "nemotron_hybrid"])
def test_replayed_graphs_equal_eager_steps(family, monkeypatch):
    model = _model(family)
    g = torch.Generator().manual_seed(0)
    prompts = [RolloutPrompt(torch.randint(10, 200, (k,), generator=g)) for k in (5, 9, 3, 7, 4)]
    free = _engine(model, [-1], "off").generate(prompts, SamplingParams(max_new_tokens=12, n=1, temperature=0.0)).samples
    eos = sorted({int(s.token_ids[k]) for s, k in zip(free, (2, 5, 3, 8, 1))})
    eager, graphs = _engine(model, eos, "off"), _engine(model, eos, "on")
    captured = []
    capture = DecodeStepRunner._capture

    def spy(self, bucket, *args):
        captured.append(bucket.size)
        return capture(self, bucket, *args)

    monkeypatch.setattr(DecodeStepRunner, "_capture", spy)
    ref, got = eager.generate(prompts, PARAMS).samples, graphs.generate(prompts, PARAMS).samples
    assert len(captured) >= 2 and len(captured) == len(set(captured)), captured
    for a, b in zip(ref, got):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)

    # weights written in place (load_weights / the asynchronous push): the kept graphs replay them
    n_captured = len(captured)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    graphs.load_weights(None, version=1)
    ref, got = eager.generate(prompts, PARAMS).samples, graphs.generate(prompts, PARAMS).samples
    assert [s.token_ids.tolist() for s in got] == [s.token_ids.tolist() for s in ref]
    assert len(captured) >= n_captured  # new buckets only (no bucket captured twice)
    assert len(captured) == len(set(captured)), captured
