"""Host reads of device values in the SFT step (`SFTStep` run by `run_loop`, one process).

On CUDA each read of a device tensor's value, and each upload through `torch.tensor(..., device=...)`, is a
stream sync: the host waits for every kernel queued and cannot launch ahead (benchmarks/RESULTS.md, "Host
overhead of the SFT step"). The step needs one read, for the non-finite guard before the optimizer step (the loss
sum and the gradient norm together); the counters, the loss sum, the stop flag of one process need none. Counted on
the CPU with `megatron_vlm.testing.host_reads.HostReads`: the pack's own tensors are host tensors in a GPU job too
(the loader's), the model sees copies (what `to_device` makes), whose reads count. The logged loss and gradient
norm, and the weights after the steps, are those of plain torch (its AdamW and clip_grad_norm_).
"""
from __future__ import annotations

import copy
from types import SimpleNamespace as NS

import torch

from megatron_vlm.host_copies import moved_to
from megatron_vlm.parallel.collectives import all_reduce_max, all_reduce_sum, any_rank
from megatron_vlm.testing.host_reads import HostReads
from megatron_vlm.training.loop import run_loop
from megatron_vlm.training.optim import OptimState
from megatron_vlm.training.sft import SFTStep
from megatron_vlm.training.signals import StopFlag
from tests.unit.training.test_review_sft_step import ListLoader, NoCheckpoints, Recorder, TinyLM, _pack


class MaskFreeLM(TinyLM):
    """TinyLM's log-probs at every position, 0 where nothing is trained: no bool-mask indexing (a read of the
    mask's count), so that the reads counted are the step's own."""

    def forward(self, batch: dict) -> torch.Tensor:
        labels = batch["labels"].reshape(-1)
        logp = torch.log_softmax(self.head(self.embed(batch["input_ids"].reshape(-1))), -1)
        trained = labels != -100
        return logp.gather(-1, labels.clamp_min(0)[:, None]).squeeze(-1) * trained


def _device_copy(batch: dict) -> dict:
    """What `RunContext.to_device` gives the model on a GPU: new tensors (the pack's stay on the host, reachable
    as the small ones' host copies)."""
    return moved_to(batch, torch.device("cpu"), copy=True)


def _run(tmp_path, model, packs, *, micro: int, steps: int, log_every: int, max_grad_norm: float, hook=None):
    cfg = NS(train=NS(micro_batches_per_step=micro, max_grad_norm=max_grad_norm, max_consecutive_skipped_steps=5))
    cpu = torch.device("cpu")
    ctx = NS(cfg=cfg, env=NS(device=cpu, world_size=1, rank=0, is_main=True), run_dir=tmp_path, stop=StopFlag(),
             device=cpu, to_device=_device_copy)
    bundle = NS(model=model, wrapper=model, dims=NS(dp_size=1), trainable_params=list(model.parameters()),
                moe_balancer=None, pipeline=None)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    metrics = Recorder()
    step = SFTStep(ctx, bundle, OptimState(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)), metrics,
                   ListLoader(packs), total_steps=steps)
    assert run_loop(ctx, step, total_steps=steps, checkpointer=NoCheckpoints(), metrics=metrics, log_every=log_every,
                    before_step=hook) == 0
    return [m for split, _, m in metrics.rows if split == "train"]


def test_one_process_collectives_and_stop_flag_touch_no_device_value():
    """all_reduce_sum / all_reduce_max / any_rank / should_stop of a single process: the values themselves (as
    floats / ints, as the float64 / int64 tensor round trip gave them), no upload, no read."""
    flag = StopFlag()
    with HostReads() as reads:
        sums = all_reduce_sum([3, 0.25, 2**40 + 1], torch.device("cpu"))
        maxes = all_reduce_max([7, -2], torch.device("cpu"))
        anyone = any_rank(True, torch.device("cpu")), any_rank(False, torch.device("cpu"))
        stops = [flag.should_stop(torch.device("cpu"))]
        flag.signum = 15
        stops.append(flag.should_stop(torch.device("cpu")))
    assert reads.total == 0, reads.report()
    assert sums == [3.0, 0.25, float(2**40 + 1)] and all(type(v) is float for v in sums)
    assert maxes == [7, -2] and all(type(v) is int for v in maxes)
    assert anyone == (True, False) and stops == [False, True]


def test_counter_sees_copies_to_the_host_and_not_host_computations():
    """`.to("cpu")` of a device tensor waits for the device as `.cpu()` does (the M-RoPE positions' C++ twin read its
    inputs so, uncounted); a blocking copy of a host tensor to the device is an upload; what is computed from host
    tensors alone (a count on the loader's `input_ids`, a `torch.arange(n)`) is host work, not a read."""
    host = torch.tensor([3, 1, 3, 2])
    dev = moved_to({"input_ids": host}, torch.device("cpu"), copy=True)["input_ids"]
    with HostReads(host=[host]) as reads:
        int(dev.sum())
        host.to(dev.device, copy=True)
        host.to(dev.device, non_blocking=True, copy=True)
        n = int((host == 3).sum()) + int(torch.arange(4).max())
        on_cpu = dev.to("cpu")  # (on the CPU, `dev` itself: a host tensor from here on)
        int(on_cpu.sum())  # a host tensor: free
    assert n == 5
    assert sorted(kind for kind, _ in reads.sites) == ["cpu", "int", "upload"], reads.report()


def test_one_sft_step_reads_the_device_once(tmp_path):
    g = torch.Generator().manual_seed(0)
    packs = [_pack(g, 9, 7) for _ in range(6)]
    reads = HostReads(host=[v for p in packs for v in p.values() if torch.is_tensor(v)])
    per_step: dict = {}

    def hook(k):
        reads.sites = per_step.setdefault(k, type(reads.sites)())

    with reads:  # step 1 logs nothing, step 2 logs its row (step 3, the last, is followed by the run's end)
        _run(tmp_path, MaskFreeLM(), packs, micro=2, steps=3, log_every=2, max_grad_norm=1.0, hook=hook)
    for k in (1, 2):
        reads.sites = per_step[k]
        assert reads.total <= 1, f"step {k}: {reads.total} host reads of device values:\n{reads.report()}"


def test_logged_loss_grad_norm_and_weights_are_plain_torchs(tmp_path):
    g = torch.Generator().manual_seed(3)
    packs = [_pack(g, 9, 7), _pack(g, 6, 2), _pack(g, 8, 5), _pack(g, 7, 3)]
    model = MaskFreeLM()
    ref = copy.deepcopy(model)
    rows = _run(tmp_path, model, packs, micro=2, steps=2, log_every=1, max_grad_norm=0.5)

    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, fused=True)
    for i, row in enumerate(rows):
        micro = packs[2 * i:2 * i + 2]
        count = sum(int(p["num_label_tokens"]) for p in micro)
        loss_sum = 0.0
        for p in micro:
            logp = ref(p)
            (-logp.sum(dtype=torch.float32) / count).backward()
            loss_sum += float(-logp.detach().sum(dtype=torch.float64))
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert row["loss"] == loss_sum / count
        assert row["grad_norm"] == float(norm)
        assert row["grad_norm"] > 0.5  # clipping took part
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
