"""Host reads of device values in the pair trainers' step (`DPOStep`, `RewardStep` run by `run_loop`, one process),
and their logged values against plain torch.

On CUDA each read of a device tensor's value is a stream sync (tests/unit/training/test_step_host_reads.py says
how they are counted on the CPU). A pair step needs one read, before its optimizer step: the metric sums (the loss
among them, for the non-finite guard) and the gradient norm together; a pack's pair count, the label positions and
the sequence ends come from the loader's host copies (megatron_vlm/host_copies.py). The stand-in models read nothing
themselves: what is counted is the step's (with the real `ScoreRoot` for the reward model). The logged metrics,
gradient norm and weights are those of the same losses written out in plain torch.
"""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace as NS

import torch
import torch.nn.functional as F
from torch import nn

from megatron_vlm.host_copies import on_host
from megatron_vlm.testing.host_reads import HostReads
from megatron_vlm.training.dpo.config import DPOConfig
from megatron_vlm.training.dpo.reference import PrecomputedReference
from megatron_vlm.training.dpo.step import DPOStep
from megatron_vlm.training.loop import run_loop
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.reward.config import RewardTrainConfig
from megatron_vlm.training.reward.model import ScoreRoot
from megatron_vlm.training.reward.step import RewardStep
from megatron_vlm.training.signals import StopFlag
from tests.unit.training.test_review_sft_step import ListLoader, NoCheckpoints, Recorder
from tests.unit.training.test_step_host_reads import _device_copy

VOCAB, DIM = 11, 6


def _pair_pack(g: torch.Generator, pairs: int, first: int) -> dict:
    """`pairs` pairs (chosen at sequence 2k, rejected at 2k + 1) of 3-6 tokens, the last 1-3 of each trained."""
    ids, labels, cu = [], [], [0]
    for _ in range(2 * pairs):
        n = int(torch.randint(3, 7, (), generator=g))
        trained = int(torch.randint(1, n - 1, (), generator=g))
        ids.append(torch.randint(0, VOCAB, (n,), generator=g))
        lab = torch.full((n,), -100)
        lab[n - 1 - trained:n - 1] = torch.randint(0, VOCAB, (trained,), generator=g)
        labels.append(lab)
        cu.append(cu[-1] + n)
    return {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32), "num_pairs": torch.tensor(pairs),
            "pair_index": torch.arange(first, first + pairs), "num_samples": torch.tensor(2 * pairs)}


class PairLM(nn.Module):
    """Log-probs of the labelled tokens in order (the `TokenLogprobModel` contract), selected at the positions read
    from the labels' host copy (what the real one does), so that it reads no device value."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, batch: dict) -> torch.Tensor:
        pos = torch.nonzero(on_host(batch["labels"]).reshape(-1) != -100).flatten()
        logp = torch.log_softmax(self.head(self.embed(batch["input_ids"].reshape(-1))), -1)
        labels = batch["labels"].reshape(-1).index_select(0, pos)
        return logp.index_select(0, pos).gather(-1, labels[:, None]).squeeze(-1)


class TinyBackbone(nn.Module):
    """A family model's surface as `ScoreRoot` uses it: `lm_head`, and the hidden states of `return_hidden`."""

    def __init__(self):
        super().__init__()
        self.language_model = nn.Embedding(VOCAB, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, cu_seqlens=None, return_hidden=False, **_):
        return torch.tanh(self.language_model(input_ids))


def _ctx(tmp_path, micro: int):
    cfg = NS(train=NS(micro_batches_per_step=micro, max_grad_norm=0.1, max_consecutive_skipped_steps=5))
    cpu = torch.device("cpu")
    return NS(cfg=cfg, env=NS(device=cpu, world_size=1, rank=0, is_main=True), run_dir=tmp_path, stop=StopFlag(),
              device=cpu, to_device=_device_copy)


def _bundle(model):
    return NS(model=model, wrapper=model, dims=NS(dp_size=1), trainable_params=list(model.parameters()),
              moe_balancer=None, pipeline=None)


def _optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    return OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


def _table(pairs: int) -> PrecomputedReference:
    g = torch.Generator().manual_seed(7)
    return PrecomputedReference({"train": -4.0 * torch.rand(pairs, 2, generator=g, dtype=torch.float64)},
                                {"train": torch.ones(pairs, dtype=torch.bool)})


def _packs(seed: int, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out, first = [], 0
    for _ in range(n):
        pairs = int(torch.randint(1, 4, (), generator=g))
        out.append(_pair_pack(g, pairs, first))
        first += pairs
    return out


def _dpo(tmp_path, model, packs, micro):
    return DPOStep(_ctx(tmp_path, micro), _bundle(model), _optim(model), Recorder(), ListLoader(packs),
                   dpo=DPOConfig(beta=0.1, loss_type="sigmoid"), reference=_table(40))


def _reward(tmp_path, model, packs, micro):
    return RewardStep(_ctx(tmp_path, micro), _bundle(model), _optim(model), Recorder(), ListLoader(packs),
                      reward=RewardTrainConfig(margin=0.2, center_rewards_coefficient=0.01))


def _run(step, steps: int, hook=None) -> list[dict]:
    assert run_loop(step.ctx, step, total_steps=steps, checkpointer=NoCheckpoints(), metrics=step.metrics, log_every=1,
                    before_step=hook) == 0
    return [m for split, _, m in step.metrics.rows if split == "train"]


def _reads_per_step(step, packs, steps: int) -> dict:
    reads = HostReads(host=[v for p in packs for v in p.values() if torch.is_tensor(v)])
    per_step: dict = {}

    def hook(k):
        reads.sites = per_step.setdefault(k, type(reads.sites)())

    with reads:
        _run(step, steps, hook)
    return {k: (sum(c.values()), "\n".join(f"{n:4d} {kd:7s} {st}" for (kd, st), n in c.most_common()))
            for k, c in per_step.items()}


def test_one_dpo_step_reads_the_device_once(tmp_path):
    packs = _packs(0, 6)
    for k, (n, report) in _reads_per_step(_dpo(tmp_path, PairLM(), packs, micro=2), packs, 3).items():
        assert n <= 1, f"DPO step {k}: {n} host reads of device values:\n{report}"


def test_one_reward_model_step_reads_the_device_once(tmp_path):
    packs = _packs(1, 6)
    model = ScoreRoot(TinyBackbone(), std=0.5, seed=0)
    for k, (n, report) in _reads_per_step(_reward(tmp_path, model, packs, micro=2), packs, 3).items():
        assert n <= 1, f"reward-model step {k}: {n} host reads of device values:\n{report}"


def _sequence_sums(values: torch.Tensor, pack: dict) -> torch.Tensor:
    """Per sequence: the sum of `values` (one per labelled token, in order), written out with Python loops."""
    labels, cu = pack["labels"].reshape(-1), pack["cu_seqlens"].tolist()
    out, j = [], 0
    for a, b in zip(cu[:-1], cu[1:]):
        n = int((labels[a:b] != -100).sum())
        out.append(values[j:j + n].sum())
        j += n
    return torch.stack(out)


def _check(rows, model, ref, packs, micro, pack_loss_and_metrics):
    """Each row's loss, metrics and grad_norm, and the weights after the steps, against plain torch: per step the
    mean of the per-pair losses over the step's pairs, clipped at 0.1, AdamW."""
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, fused=True)
    for i, row in enumerate(rows):
        step_packs = packs[micro * i:micro * i + micro]
        pairs = sum(int(p["num_pairs"]) for p in step_packs)
        losses, metrics = zip(*(pack_loss_and_metrics(ref, p) for p in step_packs))
        (torch.cat(losses).sum() / pairs).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert math.isclose(row["grad_norm"], float(norm), rel_tol=1e-5) and row["grad_norm"] > 0.1, (row, norm)
        assert math.isclose(row["loss"], float(torch.cat(losses).detach().double().sum()) / pairs, rel_tol=1e-6)
        for key in metrics[0]:
            want = sum(m[key] for m in metrics) / pairs
            assert math.isclose(row[key], want, rel_tol=1e-6, abs_tol=1e-6), (key, row[key], want)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_dpo_rows_and_weights_are_plain_torchs(tmp_path):
    packs = _packs(2, 4)
    model = PairLM()
    ref = copy.deepcopy(model)
    rows = _run(_dpo(tmp_path, model, packs, micro=2), 2)
    table = _table(40).tables["train"].float()

    def terms(lm, pack):
        s = _sequence_sums(lm(pack).float(), pack)
        c, r = s[0::2], s[1::2]
        ref_c, ref_r = table[pack["pair_index"], 0], table[pack["pair_index"], 1]
        r_c, r_r = 0.1 * (c.detach() - ref_c), 0.1 * (r.detach() - ref_r)
        loss = -F.logsigmoid(0.1 * ((c - ref_c) - (r - ref_r)))
        return loss, {"rewards/chosen": float(r_c.sum()), "rewards/rejected": float(r_r.sum()),
                      "rewards/margins": float((r_c - r_r).sum()), "rewards/accuracies": float((r_c > r_r).sum()),
                      "logps/chosen": float(c.detach().sum()), "logps/rejected": float(r.detach().sum()),
                      "preference_accuracy": float((c > r).sum())}

    _check(rows, model, ref, packs, 2, terms)


def test_reward_model_rows_and_weights_are_plain_torchs(tmp_path):
    packs = _packs(3, 4)
    model = ScoreRoot(TinyBackbone(), std=0.5, seed=0)
    ref = copy.deepcopy(model)
    rows = _run(_reward(tmp_path, model, packs, micro=2), 2)

    def terms(root, pack):
        hidden = root.model.language_model(pack["input_ids"].reshape(-1)).tanh()
        last = pack["cu_seqlens"][1:].long() - 1
        rewards = (hidden[last] @ root.score.weight.T)[:, 0]
        c, r = rewards[0::2], rewards[1::2]
        loss = -F.logsigmoid(c - r - 0.2) + 0.01 * (c + r) ** 2
        c, r = c.detach().double(), r.detach().double()
        return loss, {"accuracy": float((c > r).sum()), "margin": float((c - r).sum()),
                      "rewards/chosen": float(c.sum()), "rewards/rejected": float(r.sum())}

    _check(rows, model, ref, packs, 2, terms)
