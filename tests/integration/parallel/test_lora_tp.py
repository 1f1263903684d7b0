"""`[lora]` with tensor parallelism (native backend), on 2 gloo processes started once.

First the layer: a `LoRALinear` under `LoRAColwiseParallel` / `LoRARowwiseParallel` holds half of the split
factors (B's rows / A's columns, Megatron's layout) and gives the unsharded layer's output and gradients (the
replicated factor's gradient summed over tp by the redistribution FSDP2 does), and, with dropout, the
column-parallel layer's replicated input gets the tp = 1 mask on both ranks (CPU: ranks seeded alike).

Then the job (tiny Qwen2.5-VL, adapters on q / k / v (with biases), o, gate / up, down, base frozen): an SFT
run with `parallel.tp = 2` equals the same run with tp = 1 (2 data-parallel ranks, the same packs per step):
losses and grad norms (1e-5), the PEFT adapter file (full factors, 1e-5) and the merged HF export (1e-5). The
tp = 2 run resumed from its step-2 checkpoint (DCP of the sharded factors) writes the straight run's adapter;
a tp = 2 run with adapter dropout trains, and with activation checkpointing (masks recomputed) gives the same
losses and adapter; two GRPO steps with [lora], a KL term (reference = adapters off)
and tp = 2 equal the one-process run (loss, grad norm, reward). In CI ~30 s.

Heavy: the tiny Qwen3-VL-MoE (MoE layers replicated over tp with adapted attention and per-head QK-norm, a
dense layer with an adapted MLP) at tp = 2 equals tp = 1, its step-2 checkpoint resumes with tp = 1 (the tp = 2
run's adapter), and so does a second stage started from the first's
adapter (`lora.init_from`, init_from_mode = "merge").
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_vlm.models.common.lora import LoRALinear
from megatron_vlm.parallel import DistEnv, init_distributed
from megatron_vlm.parallel.lora_tp import LoRAColwiseParallel, LoRARowwiseParallel
from megatron_vlm.testing.synthesize import synthesize_model_folder
from tests.integration.parallel.spawn import spawn
from tests.integration.parallel.test_tp_cp_families import _column, _export, _grpo, _run

pytestmark = [pytest.mark.distributed]

STEPS = 4
LORA = {"train.train_layers": "[]", "lora.r": 4, "lora.alpha": 8, "optimizer.lr": 3e-3, "train.max_steps": STEPS,
        "lora.target_modules": '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]'}


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys() and a, sorted(set(a) ^ set(b))[:5]
    return max(((a[k].float() - b[k].float()).abs().max().item(), k) for k in a)


def _layer_checks(rank: int) -> None:
    """The styles on one layer against the unsharded layer (same weights, same input)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for style, col in ((LoRAColwiseParallel, True), (LoRARowwiseParallel, False)):
        torch.manual_seed(0)
        ref = LoRALinear(nn.Linear(8, 6, bias=True), r=4, alpha=8)
        with torch.no_grad():
            ref.lora_B.weight.normal_()  # B = 0 at init would hide a wrongly placed B
        tp = LoRALinear(nn.Linear(8, 6, bias=True), r=4, alpha=8)
        tp.load_state_dict(ref.state_dict())
        kwargs = {} if col else {"output_layouts": Partial(), "use_local_output": False}
        parallelize_module(tp, mesh, style(**kwargs))
        a, b = tp.lora_A.weight, tp.lora_B.weight
        assert a.placements == ((Replicate(),) if col else (Shard(1),)), a.placements
        assert b.placements == ((Shard(0),) if col else (Replicate(),)), b.placements
        assert (b if col else a).to_local().numel() * 2 == (b if col else a).numel()  # really split
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y_ref = ref(x)
        y_ref.square().sum().backward()
        xi = x if col else x.detach()[:, rank * 4:(rank + 1) * 4].requires_grad_(True)
        y = tp(xi)
        y = DTensor.from_local(y, mesh, [Shard(-1)]) if col else y
        y = y.full_tensor()
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
        y.square().sum().backward()
        for name, p in tp.named_parameters():
            g = p.grad
            if isinstance(g, DTensor):
                g = g.redistribute(placements=[Replicate()] if isinstance(p.placements[0], Replicate) else p.placements)
                g = g.full_tensor()
            torch.testing.assert_close(g, ref.get_parameter(name).grad, rtol=1e-5, atol=1e-5, msg=f"{style.__name__} {name}")
    # dropout: the column-parallel layer's replicated input gets one mask on both ranks, the tp = 1 mask
    torch.manual_seed(0)
    ref = LoRALinear(nn.Linear(8, 6), r=4, alpha=8, dropout=0.5)
    with torch.no_grad():
        ref.lora_B.weight.normal_()
    tp = LoRALinear(nn.Linear(8, 6), r=4, alpha=8, dropout=0.5)
    tp.load_state_dict(ref.state_dict())
    parallelize_module(tp, mesh, LoRAColwiseParallel())
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    y_ref = ref(x)
    torch.manual_seed(7)
    y = DTensor.from_local(tp(x), mesh, [Shard(-1)]).full_tensor()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    with torch.no_grad():
        ref.lora_dropout.eval()
        assert (ref(x) - y_ref).abs().max() > 1e-3  # the dropout did drop something


def _jobs(tmp: Path, rank: int) -> None:
    family = "qwen2_5_vl"
    tp1, tp2, resumed = tmp / family / "tp1", tmp / family / "tp2", tmp / family / "resumed"
    ck = {"checkpoint.enable": "true", "checkpoint.every_steps": STEPS // 2}
    _run(tmp, family, tp1, **{**LORA, "train.micro_batches_per_step": 1})
    _run(tmp, family, tp2, **{**LORA, **ck, "parallel.tp": 2, "train.micro_batches_per_step": 2})
    if rank == 0:
        assert len(_column(tp1, "loss")) == STEPS
        a1 = _adapter(tp1)
        assert len(a1) == 2 * 7 * 2 and any(v.abs().max() > 1e-3 for k, v in a1.items() if "lora_B" in k)
        _same_runs(f"{family} tp=2 vs tp=1", tp1, tp2)
        shutil.copytree(tp2 / "checkpoints" / f"step_{STEPS // 2}", resumed / "checkpoints" / f"step_{STEPS // 2}")
    dist.barrier()
    _run(tmp, family, resumed, **{**LORA, **ck, "parallel.tp": 2, "train.micro_batches_per_step": 2,
                                  "checkpoint.resume": '"auto"'})
    if rank == 0:
        assert len(_column(resumed, "loss")) == STEPS - STEPS // 2
        diff = _max_diff(_adapter(tp2), _adapter(resumed))
        assert diff[0] <= 1e-7, diff
    dist.barrier()
    # adapter dropout at tp = 2 trains (CPU: see parallel/lora_tp.py for the masks), and activation checkpointing
    # recomputes the same masks inside the sequence-parallel layers (the same run without it)
    drop, drop_ac = tmp / family / "dropout", tmp / family / "dropout_ac"
    sets = {**LORA, "lora.dropout": 0.1, "parallel.tp": 2, "train.micro_batches_per_step": 2}
    _run(tmp, family, drop, **sets)
    _run(tmp, family, drop_ac, **sets, **{"train.activation_checkpointing": "true"})
    if rank == 0:
        losses = _column(drop, "loss")
        assert len(losses) == STEPS and all(v == v for v in losses), losses
        diff = _max_diff(_adapter(tp2), _adapter(drop))
        assert diff[0] > 1e-4, diff  # the dropout changed the training
        assert _column(drop_ac, "loss") == losses
        diff = _max_diff(_adapter(drop), _adapter(drop_ac))
        assert diff[0] <= 1e-6, diff
    dist.barrier()


def _grpo_lora(tmp: Path, rank: int) -> None:
    model = tmp / "grpo" / "model"
    sets = {k: v for k, v in LORA.items() if k != "train.max_steps"} | {"rl.loss.kl_coef": 0.1}
    _grpo(model, tmp / "grpo" / "tp2", init_distributed(), **{**sets, "parallel.tp": 2})
    if rank == 0:
        for key in ("loss", "grad_norm", "reward/mean"):
            ref, got = _column(tmp / "grpo" / "dp1", key), _column(tmp / "grpo" / "tp2", key)
            scale = max(1.0, max(abs(v) for v in ref))
            assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, (key, ref, got)
        assert _column(tmp / "grpo" / "dp1", "grad_norm")[0] > 0
    dist.barrier()


def _qwen2_5_vl(tmp: Path, rank: int) -> None:
    if rank == 0:  # the one-process GRPO reference, before the 2-rank group exists
        synthesize_model_folder("tiny_qwen2_5_vl", tmp / "grpo" / "model", seed=0)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        sets = {k: v for k, v in LORA.items() if k != "train.max_steps"} | {"rl.loss.kl_coef": 0.1}
        _grpo(tmp / "grpo" / "model", tmp / "grpo" / "dp1", DistEnv(0, 1, 0, torch.device("cpu"), "gloo"), **sets)
        dist.destroy_process_group()
    init_distributed()
    _layer_checks(rank)
    _jobs(tmp, rank)
    _grpo_lora(tmp, rank)


def _same_runs(tag: str, a: Path, b: Path) -> None:
    for key in ("loss", "grad_norm"):
        x, y = _column(a, key), _column(b, key)
        assert len(x) == len(y) and len(set(x)) > 1, (tag, key, x, y)
        assert max(abs(p - q) / max(1.0, abs(p)) for p, q in zip(x, y)) <= 1e-5, (tag, key, x, y)
    diff = _max_diff(_adapter(a), _adapter(b))
    assert diff[0] <= 1e-5, (tag, diff)
    diff = _max_diff(_export(a), _export(b))
    assert diff[0] <= 1e-5, (tag, diff)


def _qwen3_vl_moe(tmp: Path, rank: int) -> None:
    """MoE layers (replicated over tp) with adapted attention (per-head QK-norm after the q / k updates), a dense
    layer with an adapted MLP; then a second stage from the first's adapter (`lora.init_from`, merged into the
    base, a new adapter trained) at tp = 1 and tp = 2."""
    init_distributed()
    family = "qwen3_vl_moe"
    runs = {}
    ck = {"checkpoint.enable": "true", "checkpoint.every_steps": STEPS // 2}
    for tp in (1, 2):
        runs[tp] = tmp / family / f"tp{tp}"
        _run(tmp, family, runs[tp], **{**LORA, **ck, "parallel.tp": tp, "train.micro_batches_per_step": tp})
    resumed = tmp / family / "resumed_tp1"
    if rank == 0:
        _same_runs(f"{family} tp=2 vs tp=1", runs[1], runs[2])
        shutil.copytree(runs[2] / "checkpoints" / f"step_{STEPS // 2}", resumed / "checkpoints" / f"step_{STEPS // 2}")
    dist.barrier()
    # layout change: the tp = 2 checkpoint (global factors) resumes with tp = 1
    _run(tmp, family, resumed, **{**LORA, **ck, "train.micro_batches_per_step": 1, "checkpoint.resume": '"auto"'})
    if rank == 0:
        assert len(_column(resumed, "loss")) == STEPS - STEPS // 2
        diff = _max_diff(_adapter(runs[2]), _adapter(resumed))
        assert diff[0] <= 1e-5, diff
    dist.barrier()
    stage2 = {**LORA, "train.max_steps": 2, "lora.init_from": f'"{runs[1] / "adapter"}"', "lora.init_from_mode": '"merge"'}
    for tp in (1, 2):
        runs[tp] = tmp / family / f"stage2_tp{tp}"
        _run(tmp, family, runs[tp], **{**stage2, "parallel.tp": tp, "train.micro_batches_per_step": tp})
    if rank == 0:
        _same_runs(f"{family} init_from merge, tp=2 vs tp=1", runs[1], runs[2])
    dist.barrier()


def test_lora_tp2_matches_tp1(tmp_path):
    spawn(tmp_path, _qwen2_5_vl, init_group=False)  # rank 0 runs the one-process GRPO reference first


@pytest.mark.heavy
def test_lora_tp2_moe_and_init_from_match_tp1(tmp_path):
    spawn(tmp_path, _qwen3_vl_moe, init_group=False)
