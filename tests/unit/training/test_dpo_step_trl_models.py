"""The DPO step's losses and metrics on real tiny models equal TRL's `DPOTrainer` on transformers' models.

The per-token tests (test_dpo_losses_trl.py) give both sides the same log-probs; here each side computes its own:
ours from a pack of the preference loader (chosen and rejected of every pair in one varlen forward of the native
model, the reference a `FrozenReference` of another folder, `preference_terms` as the step calls it), TRL's from
right-padded [chosen rows; rejected rows] through transformers' `Qwen2ForCausalLM` policy and reference with TRL's
own fused log-prob head (`add_fused_lm_head`) and `DPOTrainer._compute_loss` (called unbound on a stand-in trainer
holding the attributes it reads). The completion tokens TRL scores are the ones our pack labels (the response
turn); everything after that — forwards, label alignment, sums, the loss and TRL's logged statistics — is
computed independently.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.data.batch import IGNORE_INDEX  # noqa: E402
from megatron_vlm.data.config import DataConfig  # noqa: E402
from megatron_vlm.data.preference_loader import build_preference_dataloader  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.dpo.config import DPOConfig  # noqa: E402
from megatron_vlm.training.dpo.reference import FrozenReference  # noqa: E402
from megatron_vlm.training.dpo.step import preference_terms, reference_logps  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402

pytestmark = pytest.mark.slow  # importing trl (transformers' Trainer, accelerate)

PAIRS = [
    {"prompt": "What is two plus three?", "chosen": "five", "rejected": "six"},
    {"prompt": "Add 4 and 4.", "chosen": "The sum is 8.", "rejected": "9"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}],
     "chosen": "2", "rejected": "It is eleven, I think."},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo_trl")
    policy = synthesize_model_folder("tiny_qwen2", tmp / "policy", seed=0)
    ref = synthesize_model_folder("tiny_qwen2", tmp / "ref", seed=1)  # another model: the log-ratios are not 0
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    cfg = DataConfig(type="messages_jsonl", train_path=str(tmp / "pairs.jsonl"), max_tokens_per_pack=4096,
                     num_workers=0, shuffle=False)
    pack = next(iter(build_preference_dataloader(cfg, load_processor(policy), seed=0, dp_rank=0, dp_size=1)))
    assert int(pack["num_pairs"]) == len(PAIRS)
    return policy, ref, pack


def _trl_inputs(pack: dict, pad_id: int) -> dict:
    """TRL's batch of the pack's sequences: [chosen of each pair; rejected of each pair], right-padded, with the
    completion mask of the tokens the pack labels (label at t is the token at t + 1)."""
    cu, ids, labels = pack["cu_seqlens"].tolist(), pack["input_ids"][0], pack["labels"][0]
    n = int(pack["num_pairs"])
    order = [2 * k for k in range(n)] + [2 * k + 1 for k in range(n)]
    width = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    input_ids = torch.full((2 * n, width), pad_id, dtype=torch.long)
    attention, completion = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for row, s in enumerate(order):
        a, b = cu[s], cu[s + 1]
        input_ids[row, :b - a] = ids[a:b]
        attention[row, :b - a] = 1
        completion[row, 1:b - a] = (labels[a:b - 1] != IGNORE_INDEX).long()
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def _trl(policy_dir, ref_dir, inputs: dict, loss_type: str, beta: float):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float64).eval()
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float64).eval()
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(ref)
    acc = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x,
                          unwrap_model=lambda m: m)
    trainer = SimpleNamespace(model=policy, ref_model=ref, accelerator=acc, aux_loss_enabled=False, ld_alpha=None,
                              precompute_ref_logps=False, f_divergence_type="reverse_kl", loss_types=[loss_type],
                              loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
                              args=SimpleNamespace(gradient_checkpointing_kwargs=None),
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                              _tp_size=1)
    with torch.no_grad():
        loss = DPOTrainer._compute_loss(trainer, policy, inputs, False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["eval"].items()}


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.1), ("ipo", 0.5)])
def test_packed_step_equals_trl_dpo_trainer_on_transformers_models(setup, loss_type, beta):
    policy_dir, ref_dir, pack = setup
    dpo = DPOConfig(beta=beta, loss_type=loss_type)
    model = TokenLogprobModel(load_hf_model(policy_dir, dtype=torch.float64, device="cpu")).eval()
    reference = FrozenReference(str(ref_dir), dtype=torch.float64, device=torch.device("cpu"))
    with torch.no_grad():
        ref = reference_logps(dpo, reference, pack)
        losses, sums = preference_terms(dpo, model(pack), pack, ref)
    n = int(pack["num_pairs"])
    want, metrics = _trl(policy_dir, ref_dir, _trl_inputs(pack, load_processor(policy_dir).pad_token_id), loss_type, beta)
    # both sides sum float32 token log-probs (the step's preference_terms, TRL's fused head), in their own order:
    # responses of ~40 nats agree to a few float32 ulps (4e-6 each)
    assert float(losses.mean()) == pytest.approx(want, rel=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert sums[key] / n == pytest.approx(metrics[key], rel=1e-6, abs=2e-5), key
    assert sums["rewards/accuracies"] / n == pytest.approx(metrics["rewards/accuracies"], rel=1e-6)
    assert 0 < metrics["rewards/accuracies"] < 1 and abs(metrics["rewards/margins"]) > 1e-3  # not a degenerate batch
