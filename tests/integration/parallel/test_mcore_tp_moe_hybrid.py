"""`parallel.backend = "mcore"` with tensor parallelism for MoE decoders and the Nemotron-H hybrid, on 2 gloo
processes (one start).

The reference is the native backend at the same tp = 2 (itself checked against tp = 1 in
test_tp_cp_families.py): SFT of the tiny Qwen3-VL-MoE (attention split, megatron-core MoELayer replicated over
tp) and of the tiny Nemotron-VL (Mamba2 mixers on half of the heads each, attention and relu^2 MLP split, MoE
replicated; with activation checkpointing) gives the native run's losses and grad norms per step (fp32, 1e-5),
its [moe] statistics and its HF export (1e-6). Before the jobs, in the same workers: the tp = 2 hybrid blocks really are split (half
of the attention / MLP weights per rank, the Mamba2 mixer on half of the heads), MoE weights whole, and the
blocks gather back to the native weights exactly.

Heavy: a tp = 2 Nemotron-VL checkpoint resumes with tp = 2 (the uninterrupted run's losses and export) and is
refused, exit 2, with tp = 1; two GRPO steps with tp = 2 of the tiny Nemotron-VL and Qwen3-VL-MoE give the native tp = 2 run's loss,
grad norm and reward, the rollout decoding through the split megatron-core layers (`rl.rollout.weights =
"shared"`: the KV cache of the rank's attention heads, the Mamba2 state of its heads) or through a native copy
refreshed from their gathered weights ("copy"). And on 4 processes, tp = 2 x ep = 2 (x dp = 2): the SFT of the
tiny Nemotron-VL and Qwen3-VL-MoE gives the native tp = 2 x ep = 2 run's losses, grad norms and export (each MoE
layer replicated over tp, its experts split over the 2 ep ranks of one tp coordinate, as native).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.parallel import init_distributed  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from tests.integration.parallel.spawn import spawn  # noqa: E402
from tests.integration.parallel.test_mcore_tp import _assert_same, _resume_at_tp2, _same_moe_stats, _same_sft  # noqa: E402
from tests.integration.parallel.test_tp_cp_families import _column, _grpo, _run  # noqa: E402

pytestmark = [pytest.mark.distributed]


def _check_hybrid_shards(tmp: Path, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from megatron_vlm.models.mcore.hybrid import McoreHybridBlock
    from megatron_vlm.models.mcore.layer import native_state_dict, use_mcore_layers

    folder = tmp / "shards" / "model"
    if rank == 0:
        synthesize_model_folder("tiny_nemotron_vl", folder, seed=0)
    dist.barrier()
    model = load_hf_model(str(folder), dtype=torch.float32)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    use_mcore_layers(model, tp_mesh=mesh["tp"])
    blocks = list(model.language_model.layers)
    assert all(isinstance(b, McoreHybridBlock) for b in blocks)
    split = {"full_attention": ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"),
             "mlp": ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")}
    seen = set()
    for b in blocks:
        seen.add(b.block_type)
        for name, p in b.mcore.named_parameters():
            assert isinstance(p, DTensor), (b.block_type, name)
            halved = name in split.get(b.block_type, ())
            assert p.to_local().numel() * (2 if halved else 1) == p.numel(), (b.block_type, name)
        if b.block_type == "linear_attention":
            assert (b.mixer.tp_size, b.mixer.tp_rank) == (2, rank)
        if b.block_type == "full_attention":
            assert b.local_heads() == tuple(n // 2 for n in b.heads.values())
    assert seen == {"full_attention", "mlp", "linear_attention", "moe"}, seen
    gathered = native_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                                  for k, v in model.state_dict().items()}, model)
    assert gathered.keys() == ref.keys()
    for k in ref:
        assert torch.equal(gathered[k], ref[k]), k


def _sft(tmp: Path, rank: int) -> None:
    _check_hybrid_shards(tmp, rank)
    stats = {"moe.n_step_per_workload_report": 1}
    _same_sft(tmp, rank, "qwen3_vl_moe", "tp", **stats)
    _same_moe_stats(tmp / "qwen3_vl_moe", rank, "tp")
    # activation checkpointing recomputes the blocks (the local-weight swap and the tp collectives)
    _same_sft(tmp, rank, "nemotron_vl", "tp", **{"train.activation_checkpointing": "true"}, **stats)
    _same_moe_stats(tmp / "nemotron_vl", rank, "tp")


@pytest.mark.heavy  # ~25 s; CI keeps test_mcore_tp's dense tp = 2 job
def test_mcore_tp2_moe_and_hybrid_sft_match_native(tmp_path):
    spawn(tmp_path, _sft)


def _grpo_parts(tmp: Path, rank: int) -> None:
    _resume_at_tp2(tmp, rank, "nemotron_vl")  # a tp = 2 Nemotron-VL checkpoint: resumes at tp = 2, refused at tp = 1
    for kind in ("tiny_nemotron_vl", "tiny_qwen3_vl_moe"):
        model = tmp / kind / "model"
        if rank == 0:
            synthesize_model_folder(kind, model, seed=0)
        dist.barrier()
        runs = {}
        for name, backend, weights in (("native", "native", "shared"), ("mcore", "mcore", "shared"),
                                       ("mcore_copy", "mcore", "copy")):
            runs[name] = tmp / kind / name
            _grpo(model, runs[name], init_distributed(), **{"parallel.tp": 2, "parallel.backend": f'"{backend}"',
                                                            "rl.rollout.weights": f'"{weights}"',
                                                            "train.train_layers": '["^language_model\\\\."]'})
        if rank == 0:
            assert _column(runs["native"], "grad_norm")[0] > 0, kind
            for name in ("mcore", "mcore_copy"):
                for key in ("loss", "grad_norm", "reward/mean"):
                    ref, got = _column(runs["native"], key), _column(runs[name], key)
                    scale = max(1.0, max(abs(v) for v in ref))
                    assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, \
                        (kind, name, key, ref, got)
        dist.barrier()


@pytest.mark.heavy
def test_mcore_tp2_hybrid_resume_and_grpo_match_native(tmp_path):
    spawn(tmp_path, _grpo_parts)


def _check_tp_ep_shards(tmp: Path, rank: int) -> None:
    """tp = 2 x ep = 2 on 4 ranks: each MoE layer's megatron-core expert-parallel group is our ep mesh's (the
    ranks of one tp coordinate, not megatron-core's consecutive expert ranks), it holds half of the experts and
    half of the attention weights, and the layers gather back to the native weights exactly."""
    from torch.distributed.tensor import DTensor

    from megatron_vlm.config.sections import ParallelConfig
    from megatron_vlm.models.mcore.layer import native_state_dict, use_mcore_layers
    from megatron_vlm.parallel.mesh import build_ep_mesh, build_mesh

    folder = tmp / "shards" / "model"
    if rank == 0:
        synthesize_model_folder("tiny_qwen3_vl_moe", folder, seed=0)
    dist.barrier()
    model = load_hf_model(str(folder), dtype=torch.float32)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    dims, mesh = build_mesh(ParallelConfig(backend="mcore", tp=2, ep=2), 4, "cpu")
    ep_mesh = build_ep_mesh(dims, "cpu")
    use_mcore_layers(model, tp_mesh=mesh["tp"], ep_mesh=ep_mesh, grad_divide_factor=dims.dp_size)
    layer = model.language_model.layers[0]
    moe = layer.mcore.mlp
    assert dist.get_process_group_ranks(moe.ep_group) == [rank % 2, rank % 2 + 2]  # tp innermost: same tp coordinate
    assert moe.num_local_experts * 2 == moe.config.num_moe_experts
    assert moe.attn_tp_group.size() == 1  # replicated over tp
    qkv = layer.mcore.get_parameter("self_attention.linear_qkv.weight")
    assert isinstance(qkv, DTensor) and qkv.to_local().numel() * 2 == qkv.numel()
    gathered = native_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                                  for k, v in model.state_dict().items()}, model)
    assert gathered.keys() == ref.keys()
    for k in ref:
        assert torch.equal(gathered[k], ref[k]), k


def _tp_ep_parts(tmp: Path, rank: int) -> None:
    _check_tp_ep_shards(tmp, rank)
    for family in ("nemotron_vl", "qwen3_vl_moe"):
        runs = {}
        for backend in ("native", "mcore"):
            runs[backend] = tmp / family / f"tp_ep_{backend}"
            _run(tmp, family, runs[backend], **{"parallel.tp": 2, "parallel.ep": 2, "parallel.backend": f'"{backend}"',
                                                "train.micro_batches_per_step": 2, "train.max_steps": 4})
        if rank == 0:
            _assert_same(f"{family} tp x ep", runs["native"], runs["mcore"])
        dist.barrier()


@pytest.mark.heavy
def test_mcore_tp2_ep2_sft_matches_native(tmp_path):
    spawn(tmp_path, _tp_ep_parts, world=4)
