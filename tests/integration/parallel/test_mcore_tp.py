"""`parallel.backend = "mcore"` with tensor and context parallelism, on 2 gloo processes started once.

For Qwen2.5-VL (q/k/v biases, M-RoPE, a vision tower) and the text-only Qwen3 (per-head QK-norm): the SFT job
with megatron-core decoder layers split over tp = 2 (megatron-core's column / row parallel linears on its own
tp group, which must be our mesh's) gives the losses, grad norms and HF export of the native decoder with
tp = 2 (fp32: 1e-5 losses and relative grad norms, 1e-6 export); with cp = 2 those of the native cp = 2 run.
Before the jobs, in the same workers: a tp = 2 megatron-core layer holds half of every split weight (so the
comparison is not of two replicated runs) and gathers back to the native layer's weights exactly.
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.parallel import init_distributed  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from tests.integration.parallel.test_tp_cp_families import _column, _export, _free_port, _run  # noqa: E402

pytestmark = [pytest.mark.distributed]

STEPS = 4


def _check_layer_shards(tmp: Path, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from megatron_vlm.models.mcore.layer import McoreDecoderLayer, native_state_dict, use_mcore_layers

    folder = tmp / "shards" / "model"
    if rank == 0:
        synthesize_model_folder("tiny_qwen3", folder, seed=0)
    dist.barrier()
    model = load_hf_model(str(folder), dtype=torch.float32)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    use_mcore_layers(model, tp_mesh=mesh["tp"])
    layer = model.language_model.layers[0]
    assert isinstance(layer, McoreDecoderLayer) and layer.local_heads() == tuple(
        n // 2 for n in (layer.heads["num_attention_heads"], layer.heads["num_key_value_heads"]))
    for name in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
                 "mlp.linear_fc2.weight"):
        p = layer.mcore.get_parameter(name)
        assert isinstance(p, DTensor)
        assert p.to_local().numel() * 2 == p.numel(), name
    gathered = native_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                                  for k, v in model.state_dict().items()}, model)
    assert gathered.keys() == ref.keys()
    for k in ref:
        assert torch.equal(gathered[k], ref[k]), k
    own = layer.native_state()  # the layer gathers its own blocks (collective)
    for k, v in own.items():
        assert torch.equal(v, ref[f"language_model.layers.0.{k}"]), k


def _assert_same(tag: str, a: Path, b: Path) -> None:
    for key in ("loss", "grad_norm"):
        x, y = _column(a, key), _column(b, key)
        assert len(x) == len(y) == STEPS and len(set(x)) > 1, (tag, key, x, y)
        assert max(abs(p - q) / max(1.0, abs(p)) for p, q in zip(x, y)) <= 1e-5, (tag, key, x, y)
    e_a, e_b = _export(a), _export(b)
    assert e_a.keys() == e_b.keys() and e_a, tag
    diff = max(((e_a[k] - e_b[k]).abs().max().item(), k) for k in e_a)
    assert diff[0] <= 1e-6, (tag, diff)


def _worker(rank: int, world: int, port: int, tmp: str, errors) -> None:
    from megatron_vlm.data.synthetic_arith import write_synthetic_arith

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    tmp = Path(tmp)
    try:
        init_distributed()
        _check_layer_shards(tmp, rank)
        if rank == 0:
            write_synthetic_arith(tmp / "arith", max_operand=9, eval_size=8)
        dist.barrier()
        for family, layout in (("qwen2_5_vl", "tp"), ("qwen_text", "tp"), ("qwen2_5_vl", "cp")):
            runs = {}
            for backend in ("native", "mcore"):
                out = runs[backend] = tmp / family / f"{layout}_{backend}"
                _run(tmp, family, out, **{f"parallel.{layout}": 2, "parallel.backend": f'"{backend}"',
                                          "train.micro_batches_per_step": 2, "train.max_steps": STEPS})
            if rank == 0:
                _assert_same(f"{family} {layout}", runs["native"], runs["mcore"])
            dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_mcore_tp2_and_cp2_match_native(tmp_path):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path), errors), nprocs=2, start_method="spawn")
    except Exception:
        msgs = []
        while not errors.empty():
            msgs.append("rank %d:\n%s" % errors.get())
        raise AssertionError("\n".join(msgs) or "a worker failed")
