"""Each preference loss equals TRL's on the same batch and reference log-probs, values and gradients.

TRL (`trl` in the dev extra) is the reference nobody here wrote: `DPOTrainer._compute_loss` for sigmoid and
ipo (its loss is computed inline there, so it is called unbound on a stand-in trainer that holds only the
attributes it reads, with `precompute_ref_logps` so the reference log-probs come from the batch), and the
SimPO loss of TRL's `CPOTrainer` (`loss_type = "simpo"`; DPOTrainer has no SimPO) through its own
length-normalised `get_batch_logps`. Our side gets what the packed step gives it: per-response sums of
the token log-probs and the response token counts.
"""
from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # CPOTrainer lives in trl.experimental
from trl.experimental.cpo.cpo_trainer import CPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer

from megatron_vlm.training.dpo.losses import PREFERENCE_LOSSES, implicit_rewards

pytestmark = pytest.mark.slow  # importing trl (transformers' Trainer, accelerate) takes ~40 s on 2 cores

PAIRS, T = 5, 14


def _batch(seed: int):
    """Padded [chosen; rejected] rows (TRL's layout): prompt, then a completion of varying length, then padding."""
    g = torch.Generator().manual_seed(seed)
    completion = torch.zeros(2 * PAIRS, T, dtype=torch.long)
    for row in range(2 * PAIRS):
        start = int(torch.randint(2, 6, (1,), generator=g))
        n = int(torch.randint(1, T - start, (1,), generator=g))
        completion[row, start:start + n] = 1
    tok = (-3.0 * torch.rand(2 * PAIRS, T - 1, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = -3.0 * torch.rand(2 * PAIRS, generator=g, dtype=torch.float64) * completion.sum(1)
    return completion, tok, ref


class _Model:
    """What TRL's fused-head forward returns: per-token log-probs of the labels (0 where the label is -100)."""

    training = True

    def __init__(self, tok, shift_mask):
        self.tok, self.mask = tok, shift_mask

    def __call__(self, **kwargs):
        z = torch.zeros_like(self.tok)
        return SimpleNamespace(log_probs=self.tok * self.mask, entropy=z.detach(), mean_logits=z.detach(),
                               is_top1=torch.zeros_like(self.mask, dtype=torch.bool))


def _trl_dpo_loss(loss_type: str, beta: float, completion, tok, ref):
    acc = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=acc, aux_loss_enabled=False, ld_alpha=None,
                              precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                              loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
                              _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    ids = torch.arange(2 * PAIRS * T).reshape(2 * PAIRS, T) % 50
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion,
              "ref_chosen_logps": ref[:PAIRS], "ref_rejected_logps": ref[PAIRS:]}
    loss = DPOTrainer._compute_loss(trainer, _Model(tok, completion[:, 1:].to(tok.dtype)), inputs, False)
    return loss, trainer._metrics["train"]


def _ours(loss_type: str, beta: float, completion, tok, ref, gamma: float = 0.0):
    sums = (tok * completion[:, 1:]).sum(1)
    counts = completion.sum(1)
    fn = PREFERENCE_LOSSES[loss_type]
    args = (sums[:PAIRS], sums[PAIRS:], ref[:PAIRS], ref[PAIRS:], counts[:PAIRS], counts[PAIRS:])
    return fn(*args, beta=beta, simpo_gamma=gamma).mean(), args


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_trainer_losses(loss_type, beta):
    completion, tok, ref = _batch(seed=int(beta * 10) + len(loss_type))
    want, trl_metrics = _trl_dpo_loss(loss_type, beta, completion, tok, ref)
    (g_want,) = torch.autograd.grad(want, tok)
    got, args = _ours(loss_type, beta, completion, tok, ref)
    (g_got,) = torch.autograd.grad(got, tok)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)
    assert want.item() > 0 and g_want.abs().sum() > 0
    # the metrics TRL logs from the same batch (rewards/*, logps/*)
    r_c, r_r = implicit_rewards(loss_type, *args, beta=beta)
    assert trl_metrics["rewards/chosen"][0] == pytest.approx(r_c.mean().item(), rel=1e-9)
    assert trl_metrics["rewards/rejected"][0] == pytest.approx(r_r.mean().item(), rel=1e-9)
    assert trl_metrics["rewards/margins"][0] == pytest.approx((r_c - r_r).mean().item(), rel=1e-9, abs=1e-12)
    assert trl_metrics["rewards/accuracies"][0] == pytest.approx((r_c > r_r).double().mean().item())
    assert trl_metrics["logps/chosen"][0] == pytest.approx(args[0].mean().item(), rel=1e-9)


@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (2.5, 1.4)])
def test_simpo_equals_trl_cpo_simpo(beta, gamma):
    g = torch.Generator().manual_seed(3)
    vocab = 11
    completion, _, _ = _batch(seed=7)
    logits = torch.randn(2 * PAIRS, T, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, vocab, (2 * PAIRS, T), generator=g)
    labels = ids.masked_fill(completion == 0, -100)
    trainer = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
    avg = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    losses, trl_chosen, trl_rejected = CPOTrainer.cpo_loss(trainer, avg[:PAIRS], avg[PAIRS:])
    want = losses.mean()
    (g_want,) = torch.autograd.grad(want, logits)
    # ours: summed token log-probs (token t predicted at t - 1) and the response token counts
    tok = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    got, args = _ours("simpo", beta, completion, tok, torch.zeros(2 * PAIRS, dtype=torch.float64), gamma)
    (g_got,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)
    r_c, r_r = implicit_rewards("simpo", args[0], args[1], None, None, args[4], args[5], beta=beta)
    torch.testing.assert_close(r_c, trl_chosen.detach())
    torch.testing.assert_close(r_r, trl_rejected.detach())


def test_simpo_ignores_the_reference_and_sigmoid_does_not():
    completion, tok, ref = _batch(seed=11)
    a, _ = _ours("simpo", 2.0, completion, tok, ref, 0.5)
    b, _ = _ours("simpo", 2.0, completion, tok, ref + 5.0, 0.5)
    assert a.item() == b.item()
    c, _ = _ours("sigmoid", 0.1, completion, tok, ref)
    d, _ = _ours("sigmoid", 0.1, completion, tok, ref.clone().index_add_(0, torch.tensor([0]), torch.tensor([5.0],
                                                                                                           dtype=ref.dtype)))
    assert c.item() != d.item()
