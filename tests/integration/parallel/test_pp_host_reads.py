"""Host reads of device values in the pipeline-parallel SFT step (`parallel.pp = 2`: two ranks, one stage each).

On CUDA each read of a device tensor's value is a stream sync (tests/unit/training/test_step_host_reads.py says how
they are counted on the CPU). The last stage used to read each micro-batch's loss, the runner the stages' summed loss
and the norm's clip whether the norm is finite: a step of M micro-batches read the device M + 3 times on the last
stage. The step needs one read, the loss sum with the gradient norm (`global_loss_and_norm`), on every stage. The
logged losses and gradient norms, step after step, are those of transformers' Qwen2ForCausalLM of the same folder
under plain torch (its clip_grad_norm_ and SGD).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.config.sections import ParallelConfig
from megatron_vlm.parallel import build_mesh
from megatron_vlm.parallel.pipeline import PipelineRunner, split_model_for_stage
from megatron_vlm.testing.host_reads import HostReads
from megatron_vlm.testing.tiny_text_model import build_tiny_qwen_text_folder
from megatron_vlm.training.lm_loss import TokenLogprobModel
from megatron_vlm.training.loop import run_loop
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.sft import SFTStep
from megatron_vlm.training.signals import StopFlag
from tests.integration.parallel.spawn import spawn
from tests.unit.training.test_review_sft_step import ListLoader, NoCheckpoints, Recorder
from tests.unit.training.test_step_host_reads import _device_copy

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]  # ~35 s: two ranks load a model and transformers

MICRO, STEPS, MAX_TOKENS, LR, MAX_NORM = 3, 4, 16, 0.5, 0.05


def _packs(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(MICRO * STEPS):
        n, trained = 9 + i % 5, 4 + i % 3
        ids = torch.randint(0, vocab, (1, n), generator=g)
        labels = torch.full((1, n), -100)
        labels[0, n - trained:] = torch.randint(0, vocab, (trained,), generator=g)  # pre-shifted targets
        out.append({"input_ids": ids, "labels": labels, "num_label_tokens": torch.tensor(trained),
                    "num_samples": torch.tensor(1)})
    return out


def _reference(folder: Path, packs: list[dict]) -> list[tuple[float, float]]:
    """(loss, gradient norm) of each step: transformers' model, -sum log p of the trained labels over the step's
    trained tokens, clip_grad_norm_, SGD."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for s in range(STEPS):
        micro = packs[s * MICRO:(s + 1) * MICRO]
        count = sum(int(p["num_label_tokens"]) for p in micro)
        total = 0.0
        for p in micro:
            logits = model(input_ids=p["input_ids"]).logits[0].float()
            keep = p["labels"][0] != -100
            logp = torch.log_softmax(logits[keep], -1).gather(-1, p["labels"][0][keep][:, None]).squeeze(-1)
            (-logp.sum() / count).backward()
            total += float(-logp.detach().double().sum())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((total / count, norm))
    return out


_NOT_THE_PIPELINES = ("kernels/reference/", "collectives.py", "should_stop")
"""Reads every multi-rank step makes, the pipeline's or not, left out of the count: the CPU reference kernel of the
token log-probs (never run on a GPU: tests/unit/models/test_forward_host_reads.py), the step's all-reduce of its
token and sample counts, the stop flag's all-reduce (training/signals.py)."""


def _pipeline_reads(reads: HostReads) -> int:
    return sum(n for (_, site), n in reads.sites.items() if not any(k in site for k in _NOT_THE_PIPELINES))


def _stage(tmp: Path, rank: int) -> None:
    folder = build_tiny_qwen_text_folder(tmp / f"model{rank}", hidden=32, layers=2, seed=3)
    cpu = torch.device("cpu")
    dims, mesh = build_mesh(ParallelConfig(pp=2), 2, "cpu")
    model = load_hf_model(str(folder), dtype=torch.float32, device="cpu")
    vocab = model.lm_head.weight.shape[0]
    packs = _packs(min(vocab, 200))
    wrapper = split_model_for_stage(model, TokenLogprobModel, stage=mesh.get_local_rank("pp"), pp=2,
                                    max_tokens=MAX_TOKENS, act_dtype=torch.float32)
    runner = PipelineRunner(wrapper, mesh, cpu, MICRO)
    cfg = NS(train=NS(micro_batches_per_step=MICRO, max_grad_norm=MAX_NORM, max_consecutive_skipped_steps=5))
    ctx = NS(cfg=cfg, env=NS(device=cpu, world_size=2, rank=rank, is_main=rank == 0), run_dir=tmp, stop=StopFlag(),
             device=cpu, to_device=_device_copy)
    params = [p for p in wrapper.parameters() if p.requires_grad]
    bundle = NS(model=model, wrapper=wrapper, dims=dims, trainable_params=params, moe_balancer=None, pipeline=runner,
                num_params=1)
    opt = torch.optim.SGD(params, lr=LR)
    metrics = Recorder()
    step = SFTStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), metrics,
                   ListLoader(packs), total_steps=STEPS)
    reads = HostReads(host=[v for p in packs for v in p.values()])
    per_step: dict = {}

    def hook(k):
        reads.sites = per_step.setdefault(k, type(reads.sites)())

    with reads:
        assert run_loop(ctx, step, total_steps=STEPS, checkpointer=NoCheckpoints(), metrics=metrics, log_every=1,
                        before_step=hook) == 0
    for k in range(2, STEPS):  # steady steps (the first also runs the schedule's shape warm-up; the last is followed
        reads.sites = per_step[k]  # by the run's end)
        assert _pipeline_reads(reads) <= 1, f"stage {rank}, step {k}: host reads of device values:\n{reads.report()}"
    rows = [m for split, _, m in metrics.rows if split == "train"]
    expected = _reference(folder, packs)
    assert len(rows) == STEPS
    for s, (row, (loss, norm)) in enumerate(zip(rows, expected)):
        assert row["loss"] == pytest.approx(loss, rel=1e-5), (rank, s)
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-4), (rank, s)
        assert row["grad_norm"] > MAX_NORM  # clipping took part
        assert row["skipped_steps"] == 0.0


def test_pipeline_step_reads_the_device_once(tmp_path):
    spawn(tmp_path, _stage)
