"""`parallel.backend = "mcore"` with tensor and context parallelism, on 2 gloo processes (one start per test).

SFT with tp (in CI, ~30 s): for Qwen2.5-VL (q/k/v biases, M-RoPE, a vision tower) and the text-only Qwen3
(per-head QK-norm; with activation checkpointing), the job with megatron-core decoder layers split over tp = 2
(megatron-core's column / row parallel linears on its own tp group, which must be our mesh's) gives the
losses, grad norms and HF export of the native decoder with tp = 2 (fp32: 1e-5 losses and relative grad norms,
1e-6 export). Before the jobs, in the same workers: a tp = 2 megatron-core layer holds half of every split
weight (so the comparison is not of two replicated runs) and gathers back to the native weights exactly.

Heavy: Qwen2.5-VL's SFT with cp = 2 (our context parallelism inside the megatron-core layers' attention)
gives the native cp = 2 run's losses, grad norms and export; a tp = 2 megatron-core checkpoint resumes with
tp = 2 (the uninterrupted run's losses and export) and is refused, exit 2, with tp = 1; two GRPO steps with
tp = 2 give the native tp = 2 run's loss, grad norm and reward, the rollout decoding through the split
megatron-core layers (`rl.rollout.weights = "shared"`) or through a native copy refreshed from their
gathered weights ("copy").
"""
from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.parallel import init_distributed  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from tests.integration.parallel.spawn import spawn  # noqa: E402
from tests.integration.parallel.test_tp_cp_families import _column, _export, _grpo, _run  # noqa: E402

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
    # loading native weights into the distributed layer writes this rank's blocks
    other = {k.removeprefix("language_model.layers.1."): v for k, v in ref.items() if k.startswith("language_model.layers.1.")}
    layer.load_native(other)
    assert all(torch.equal(v, other[k]) for k, v in layer.native_state().items())


def _assert_same(tag: str, a: Path, b: Path) -> None:
    for key in ("loss", "grad_norm"):
        x, y = _column(a, key), _column(b, key)
        assert len(x) == len(y) == STEPS and len(set(x)) > 1, (tag, key, x, y)
        assert max(abs(p - q) / max(1.0, abs(p)) for p, q in zip(x, y)) <= 1e-5, (tag, key, x, y)
    e_a, e_b = _export(a), _export(b)
    assert e_a.keys() == e_b.keys() and e_a, tag
    diff = max(((e_a[k] - e_b[k]).abs().max().item(), k) for k in e_a)
    assert diff[0] <= 1e-6, (tag, diff)


def _arith(tmp: Path, rank: int) -> None:
    from megatron_vlm.data.synthetic_arith import write_synthetic_arith

    if rank == 0:
        write_synthetic_arith(tmp / "arith", max_operand=9, eval_size=8)
    dist.barrier()


def _sft(tmp: Path, rank: int) -> None:
    _check_layer_shards(tmp, rank)
    _arith(tmp, rank)
    _same_sft(tmp, rank, "qwen2_5_vl", "tp")
    # activation checkpointing recomputes the layer (its local-weight swap and megatron-core's collectives)
    _same_sft(tmp, rank, "qwen_text", "tp", **{"train.activation_checkpointing": "true"})


def _same_sft(tmp: Path, rank: int, family: str, layout: str, **extra) -> None:
    runs = {}
    for backend in ("native", "mcore"):
        out = runs[backend] = tmp / family / f"{layout}_{backend}"
        _run(tmp, family, out, **{f"parallel.{layout}": 2, "parallel.backend": f'"{backend}"',
                                  "train.micro_batches_per_step": 2, "train.max_steps": STEPS, **extra})
    if rank == 0:
        _assert_same(f"{family} {layout}", runs["native"], runs["mcore"])
    dist.barrier()


def _same_moe_stats(family_dir: Path, rank: int, layout: str) -> None:
    """The [moe] statistics of the `layout` (tp / cp) runs equal native's: under tp each token is counted once although
    every tp rank routes it (the balancer divides the tp copies out); under cp each rank routes its part of the
    tokens, summed over the ranks."""
    if rank == 0:
        a, b = family_dir / f"{layout}_native", family_dir / f"{layout}_mcore"
        for key in ("moe/tokens_per_layer_mean", "moe/max_fraction_max", "moe/entropy_mean"):
            x, y = _column(a, key), _column(b, key)
            assert len(x) == STEPS and max(abs(p - q) for p, q in zip(x, y)) <= 1e-6, (key, x, y)
        table = (b / "moe_layer_expert_table.csv").read_text()
        assert table == (a / "moe_layer_expert_table.csv").read_text() and len(table.splitlines()) > STEPS
    dist.barrier()


def _resume_at_tp2(tmp: Path, rank: int, family: str) -> None:
    """A tp = 2 megatron-core checkpoint of step 2 resumes with tp = 2 (the uninterrupted run's last losses and
    export); resuming it with tp = 1 (2 data-parallel ranks) is refused: exit 2 naming parallel.tp."""
    full, resumed, other = (tmp / "resume" / n for n in ("full", "resumed", "tp1"))
    ck = {"parallel.backend": '"mcore"', "train.max_steps": STEPS, "checkpoint.enable": "true",
          "checkpoint.every_steps": 2}
    _run(tmp, family, full, **{**ck, "parallel.tp": 2, "train.micro_batches_per_step": 2})
    if rank == 0:
        for out in (resumed, other):
            shutil.copytree(full / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    dist.barrier()
    _run(tmp, family, resumed, **{**ck, "parallel.tp": 2, "train.micro_batches_per_step": 2,
                                  "checkpoint.resume": '"auto"'})
    if rank == 0:
        a, b = _column(full, "loss"), _column(resumed, "loss")
        assert len(b) == STEPS - 2 and max(abs(x - y) for x, y in zip(a[2:], b)) <= 1e-6, (a, b)
        e_a, e_b = _export(full), _export(resumed)
        assert e_a.keys() == e_b.keys() and max((e_a[k] - e_b[k]).abs().max().item() for k in e_a) <= 1e-6
    dist.barrier()
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        _run(tmp, family, other, **{**ck, "train.micro_batches_per_step": 1, "checkpoint.resume": '"auto"'})
    assert e.value.code == 2 and "saved with parallel.tp = 2" in err.getvalue(), err.getvalue()
    dist.barrier()


def _resume(tmp: Path, rank: int) -> None:
    _arith(tmp, rank)
    _resume_at_tp2(tmp, rank, "qwen_text")


def _cp_and_grpo(tmp: Path, rank: int) -> None:
    _same_sft(tmp, rank, "qwen2_5_vl", "cp")
    _resume(tmp, rank)
    # GRPO, two steps: the rollout engine decodes through the tp-split megatron-core layers ("shared") or
    # a native copy refreshed from their gathered weights ("copy")
    grpo_model = tmp / "grpo" / "model"
    if rank == 0:
        synthesize_model_folder("tiny_qwen2_5_vl", grpo_model, seed=0)
    dist.barrier()
    grpo = {}
    for name, backend, weights in (("native", "native", "shared"), ("mcore", "mcore", "shared"),
                                   ("mcore_copy", "mcore", "copy")):
        grpo[name] = tmp / "grpo" / name
        _grpo(grpo_model, grpo[name], init_distributed(), **{"parallel.tp": 2, "parallel.backend": f'"{backend}"',
                                                             "rl.rollout.weights": f'"{weights}"'})
    if rank == 0:
        for name in ("mcore", "mcore_copy"):
            for key in ("loss", "grad_norm", "reward/mean"):
                ref, got = _column(grpo["native"], key), _column(grpo[name], key)
                scale = max(1.0, max(abs(v) for v in ref))
                assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, \
                    (name, key, ref, got)
        assert _column(grpo["native"], "grad_norm")[0] > 0
    dist.barrier()


def test_mcore_tp2_sft_matches_native(tmp_path):
    spawn(tmp_path, _sft)


@pytest.mark.heavy
def test_mcore_cp2_sft_and_tp2_grpo_match_native(tmp_path):
    spawn(tmp_path, _cp_and_grpo)
