"""`parallel.backend = "mcore"` with context parallelism for MoE decoders and the Nemotron-H hybrid, on 2 gloo
processes (one start).

The reference is the native backend at the same cp = 2 (itself checked against one data-parallel rank in
test_tp_cp_families.py): SFT of the tiny Qwen3-VL-MoE (megatron-core attention + MoELayer, both split over the
cp ranks) and of the tiny Nemotron-VL (attention, relu^2 MLP and MoE blocks split, Mamba2 blocks whole on every
cp rank; with activation checkpointing), both with the [moe] auxiliary loss on, gives the native run's losses and
grad norms per step (fp32, 1e-5), its [moe] statistics (each cp rank routes its own tokens, summed over the ranks)
and its HF export (1e-6).

Since context parallelism is exact, an mcore run whose layers were not split at all would match native too:
before the jobs, in the same workers, the layers are checked to be split as native's (the same layers wrapped,
Mamba2 blocks not), an MoE layer is checked to route only this rank's half of a pack, and a split attention /
MoE layer's output is checked equal to the same layer run whole (the attention only is right if it attends over
the all-gathered keys / values of the group).

Heavy: two GRPO steps with cp = 2 of both tiny models give the native cp = 2 run's loss, grad norm and reward
(~40 s); and on 4 processes, tp = 2 x cp = 2 SFT of both gives the native tp = 2 x cp = 2 run's losses, grad
norms and export (~85 s). cp with ep > 1 is refused for both backends (tests/unit/mcore/test_mcore_moe_hybrid.py).
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
from tests.integration.parallel.test_mcore_tp import STEPS, _assert_same, _same_moe_stats, _same_sft  # noqa: E402
from tests.integration.parallel.test_tp_cp_families import _column, _grpo, _run  # noqa: E402

pytestmark = [pytest.mark.distributed]

CU = [0, 13, 30]  # two packed samples; 30 tokens -> chunks of 7 / 8 tokens, rank r holds chunks r and 3 - r


def _split_model(tmp: Path, rank: int, kind: str):
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_vlm.models.common.parallel_plan import _apply_context_parallel
    from megatron_vlm.models.mcore.layer import use_mcore_layers

    folder = tmp / "split" / kind
    if rank == 0:
        synthesize_model_folder(kind, folder, seed=0)
    dist.barrier()
    native = load_hf_model(str(folder), dtype=torch.float32)
    model, whole = (load_hf_model(str(folder), dtype=torch.float32) for _ in range(2))
    use_mcore_layers(model)
    use_mcore_layers(whole)  # the same megatron-core layers, not split
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    _apply_context_parallel(native, 2, mesh)
    _apply_context_parallel(model, 2, mesh)
    split = [getattr(layer, "_mvlm_cp", False) for layer in model.language_model.layers]
    assert split == [getattr(layer, "_mvlm_cp", False) for layer in native.language_model.layers]
    return model, whole, split


def _check_split(tmp: Path, rank: int) -> None:
    from megatron_vlm.models.mcore.hybrid import McoreHybridBlock
    from megatron_vlm.models.mcore.layer import McoreDecoderLayer

    torch.manual_seed(0)
    cu = torch.tensor(CU, dtype=torch.int32)
    total, seen_kinds = CU[-1], set()
    local_tokens = 15  # 7 + 8 for either rank
    for kind in ("tiny_qwen3_vl_moe", "tiny_nemotron_vl"):
        model, whole, split = _split_model(tmp, rank, kind)
        for i, (layer, ref) in enumerate(zip(model.language_model.layers, whole.language_model.layers)):
            if isinstance(layer, McoreHybridBlock):
                assert split[i] == (layer.block_type != "linear_attention"), (kind, i, layer.block_type)
                if layer.block_type not in ("full_attention", "moe"):
                    continue
                x = torch.randn(1, total, layer.mcore.config.hidden_size)
                args, kwargs = (x,), dict(cu_seqlens=cu, max_seqlen=17)
                seen_kinds.add(layer.block_type)
            else:
                assert isinstance(layer, McoreDecoderLayer) and split[i], (kind, i)
                x = torch.randn(total, layer.mcore.config.hidden_size)
                angles = torch.randn(total, layer.head_dim)
                args, kwargs = (x, angles.cos(), angles.sin()), dict(cu_seqlens=cu, max_seqlen=17)
                seen_kinds.add("moe_decoder" if layer.is_moe else "decoder")
            routed = []
            moe = layer.mcore.mlp if getattr(layer, "is_moe", False) or getattr(layer, "block_type", "") == "moe" else None
            hook = moe.register_forward_hook(lambda m, a, o: routed.append(a[0].shape[-2])) if moe is not None else None
            layer.train()
            got = layer(*args, **kwargs)
            if hook is not None:
                hook.remove()
                assert routed == [local_tokens], (kind, i, routed)  # this rank's tokens only
                layer.mcore.mlp.reset_expert_load()
            with torch.no_grad():
                want = ref(*args, **kwargs)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5), (kind, i)
    assert seen_kinds >= {"moe_decoder", "full_attention", "moe"}, seen_kinds


def _sft(tmp: Path, rank: int) -> None:
    _check_split(tmp, rank)
    # the auxiliary loss on: its router statistics are over the rank's tokens, its gradient enters the split layers
    stats = {"moe.n_step_per_workload_report": 1, "moe.aux_loss_coef": 0.1}
    _same_sft(tmp, rank, "qwen3_vl_moe", "cp", **stats)
    _same_moe_stats(tmp / "qwen3_vl_moe", rank, "cp")
    # activation checkpointing recomputes the split layers (their cp slices and gathers)
    _same_sft(tmp, rank, "nemotron_vl", "cp", **{"train.activation_checkpointing": "true"}, **stats)
    _same_moe_stats(tmp / "nemotron_vl", rank, "cp")


def test_mcore_cp2_moe_and_hybrid_sft_match_native(tmp_path):
    spawn(tmp_path, _sft)


def _grpo_parts(tmp: Path, rank: int) -> None:
    for kind in ("tiny_nemotron_vl", "tiny_qwen3_vl_moe"):
        model = tmp / kind / "model"
        if rank == 0:
            synthesize_model_folder(kind, model, seed=0)
        dist.barrier()
        runs = {}
        for backend in ("native", "mcore"):
            runs[backend] = tmp / kind / backend
            _grpo(model, runs[backend], init_distributed(), **{"parallel.cp": 2, "parallel.backend": f'"{backend}"',
                                                               "train.train_layers": '["^language_model\\\\."]'})
        if rank == 0:
            assert _column(runs["native"], "grad_norm")[0] > 0, kind
            for key in ("loss", "grad_norm", "reward/mean"):
                ref, got = _column(runs["native"], key), _column(runs["mcore"], key)
                scale = max(1.0, max(abs(v) for v in ref))
                assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, \
                    (kind, key, ref, got)
        dist.barrier()


@pytest.mark.heavy
def test_mcore_cp2_moe_and_hybrid_grpo_match_native(tmp_path):
    spawn(tmp_path, _grpo_parts)


def _tp_cp_parts(tmp: Path, rank: int) -> None:
    """tp = 2 x cp = 2 on 4 ranks (one data-parallel rank reading 4 micro-batches per step): the cp ranks keep their
    chunks of each pack, inside which the megatron-core layers split heads / MLP columns / Mamba2 heads over tp and
    the MoE layers run replicated over tp, as the native layers do."""
    for family in ("nemotron_vl", "qwen3_vl_moe"):
        runs = {}
        for backend in ("native", "mcore"):
            runs[backend] = tmp / family / f"tp_cp_{backend}"
            _run(tmp, family, runs[backend], **{"parallel.tp": 2, "parallel.cp": 2, "parallel.backend": f'"{backend}"',
                                                "train.micro_batches_per_step": 4, "train.max_steps": STEPS})
        if rank == 0:
            _assert_same(f"{family} tp x cp", runs["native"], runs["mcore"])
        dist.barrier()


@pytest.mark.heavy
def test_mcore_tp2_cp2_moe_and_hybrid_sft_match_native(tmp_path):
    spawn(tmp_path, _tp_cp_parts, world=4)
