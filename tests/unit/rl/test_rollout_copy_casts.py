"""`rl.rollout.weights = "copy"` under bf16 precision generates what "shared" (the trainer's own parameters) does.

Why: the trainer's mixed precision (FSDP2's units, or `parallel.fsdp = false`'s input casts) casts the floating-point
inputs of the root and of every decoder layer to bf16, the rotary tables made in fp32 among them. The copy (the same
bf16 weights, read from the model folder and refreshed from the trainer) once ran without those casts: its q / k
rotation ran in fp32, its behaviour log-probs were ~1e-3 off the trainer's and some sampled tokens differed, so the
two modes' GRPO rows parted from the second step on. Both engines here sample with the same generator: equal tokens
and bitwise equal log-probs, at the start and after an update of the masters (the copy refreshed by `load_weights`).
The whole-job comparison is tests/integration/test_grpo_copy_rows.py. GRPO's frozen reference, another copy read in
bf16, scores what the policy scores at equal weights; so does DPO's on-the-fly reference.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace as NS

import torch

from megatron_vlm.inference.engine import SamplingParams
from megatron_vlm.models.registry import get_family
from megatron_vlm.parallel.master_weights import MasterWeights
from megatron_vlm.parallel.precision import mixed_param_dtype
from megatron_vlm.rl.trainer import build_rollout_engine
from megatron_vlm.training.lm_loss import TokenLogprobModel
from tests.fixtures import tiny_qwen2_5_vl as F
from tests.fixtures.rl_config import rl_config
from tests.fixtures.rollout_engine import tiny_vl_model_and_prompts

BF16 = torch.bfloat16


class Tok:
    eos_token_id = pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):  # noqa: ARG002
        return ""


def _trainer(model):
    """The policy as training/model_bundle.py builds it for one CPU process in bf16 without FSDP2 (fp32 weights, the
    log-prob root, the family's input casts, bf16 weights with fp32 masters)."""
    wrapper = TokenLogprobModel(model)
    get_family(model.hf_config["model_type"]).parallelize(model, None, NS(compile=False), mesh=None, param_dtype=BF16,
                                                          root=wrapper)
    return NS(model=model, wrapper=wrapper, processor=NS(tokenizer=Tok())), MasterWeights(wrapper, BF16)


def _labelled_batch() -> dict:
    """One image + text sample as a batch, its text tokens labelled."""
    batch = F.batch_samples([F.build_sample([4, ("image", (1, 4, 4)), 7], torch.Generator().manual_seed(5))])
    following = batch["input_ids"][:, 1:]
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, :-1] = torch.where(following < F.IMAGE_TOKEN_ID, following, -100)
    batch["labels"] = labels
    return batch


def _rollout(engine, prompts):
    res = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=2, temperature=1.0),
                          generator=torch.Generator().manual_seed(3))
    return [s.token_ids.tolist() for s in res.samples], [s.logprobs for s in res.samples]


def test_copy_generates_what_the_shared_weights_generate_in_bf16(monkeypatch, tmp_path):
    model, prompts = tiny_vl_model_and_prompts(5)
    folder = copy.deepcopy(model)  # what the model folder holds: the copy reads it in bf16, as load_hf_model does
    monkeypatch.setattr("megatron_vlm.checkpoint.hf.load_hf_model",
                        lambda path, dtype, device: copy.deepcopy(folder).to(dtype=dtype, device=device))
    bundle, masters = _trainer(model)
    # as build_grpo_parts calls it under bf16 precision (param_dtype = mixed_param_dtype("bf16", cpu))
    kw = dict(dtype=BF16, device=torch.device("cpu"), per_batch=0, param_dtype=mixed_param_dtype("bf16", torch.device("cpu")))
    shared = build_rollout_engine(rl_config(rollout_weights="shared"), bundle, str(tmp_path), **kw)
    own = build_rollout_engine(rl_config(rollout_weights="copy"), bundle, str(tmp_path), **kw)
    g = torch.Generator().manual_seed(0)
    for version in (0, 1):
        if version:  # an optimizer step: the masters move, the bf16 weights become their rounding
            with masters.fp32_view(), torch.no_grad():
                for m in masters.params:
                    m.add_(torch.randn(m.shape, generator=g) * 0.02)
        shared.load_weights(None, version=version)
        own.load_weights(None, version=version)
        expect_ids, expect_logps = _rollout(shared, prompts)
        got_ids, got_logps = _rollout(own, prompts)
        assert got_ids == expect_ids, version
        for a, b in zip(got_logps, expect_logps):
            assert torch.equal(a, b), (version, (a - b).abs().max().item())


def test_reference_scores_what_the_policy_scores_at_equal_weights_in_bf16(monkeypatch):
    """GRPO's frozen reference (rl.loss.kl_coef > 0) is a copy too: read in bf16 from the model folder, it computed
    its log-probs without the trainer's casts, ~1e-3 off the policy's at the very same weights, so the KL penalty was
    not 0 at the first step. With the casts: bitwise equal log-probs."""
    from megatron_vlm.rl.reference import ReferencePolicy

    model, _ = tiny_vl_model_and_prompts(1)
    folder = copy.deepcopy(model)
    monkeypatch.setattr("megatron_vlm.checkpoint.hf.load_hf_model",
                        lambda path, dtype, device: copy.deepcopy(folder).to(dtype=dtype, device=device))
    bundle, _ = _trainer(model)
    ref = ReferencePolicy.from_pretrained("folder", dtype=BF16, device=torch.device("cpu"), offload=False,
                                          temperature=1.0, param_dtype=mixed_param_dtype("bf16", torch.device("cpu")))
    batch = _labelled_batch()
    with torch.no_grad():
        policy = bundle.wrapper.eval()(batch, temperature=1.0, **ref.mask_kw)
    reference = ref.token_logprobs(batch)
    assert policy.numel() == 10
    assert torch.equal(reference, policy), (reference - policy).abs().max().item()


def test_dpo_frozen_reference_scores_what_the_policy_scores_in_bf16(monkeypatch):
    """DPO's on-the-fly reference (dpo.reference = "on_the_fly") is the same kind of copy: with the trainer's casts it
    scores what the policy scores at the initial weights (what the "precomputed" pass, made by the policy, holds)."""
    from megatron_vlm.training.dpo.reference import FrozenReference

    model, _ = tiny_vl_model_and_prompts(1)
    folder = copy.deepcopy(model)
    monkeypatch.setattr("megatron_vlm.checkpoint.hf.load_hf_model",
                        lambda path, dtype, device: copy.deepcopy(folder).to(dtype=dtype, device=device))
    bundle, _ = _trainer(model)
    ref = FrozenReference("folder", dtype=BF16, device=torch.device("cpu"),
                          param_dtype=mixed_param_dtype("bf16", torch.device("cpu")))
    batch = _labelled_batch()
    with torch.no_grad():
        policy = bundle.wrapper.eval()(batch)
        reference = ref.scorer(batch)
    assert torch.equal(reference, policy), (reference - policy).abs().max().item()
