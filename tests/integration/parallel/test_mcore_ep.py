"""`parallel.backend = "mcore"` with expert parallelism (parallel.ep = 2) on 2 gloo processes (one start).

Before the jobs, in the same workers: megatron-core's expert-parallel group is our ep mesh's, each rank's
megatron-core MoE layer holds half of the routed experts (the native experts rank * E/2 ...), the layer's
forward equals the native block's and its expert gradients are the native ones summed over the ep ranks'
tokens, and the gathered state maps back to the native weights exactly. Then the tiny Qwen3-VL-MoE SFT with
megatron-core MoE layers (all-to-all dispatcher; activation checkpointing on; the [moe] auxiliary loss) and
ep = 2 gives the native ep = 2 run's per-step losses and grad norms (fp32, 1e-5), MoE load statistics and HF
export (all experts gathered back; 1e-6).

Heavy: the tiny Nemotron-VL SFT (the hybrid's MoE blocks: sigmoid routing with the expert bias, shared expert)
with ep = 2 likewise gives the native ep = 2 run's losses, grad norms, MoE statistics, end-of-run evaluation
(loss, greedy answer accuracy: decoding in lock-step through the ep layers) and export, and its ep = 2
checkpoint resumes with the uninterrupted run's losses; two GRPO steps
(Qwen3-VL-MoE) with ep = 2 give the native ep = 2 run's loss, grad norm and reward, the rollout decoding
in lock-step through the expert-parallel megatron-core layers (`rl.rollout.weights = "shared"`) or through a
native copy refreshed from their gathered weights ("copy").
"""
from __future__ import annotations

import copy
import csv
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


def _check_layer_experts(tmp: Path, rank: int) -> None:
    from megatron.core import parallel_state
    from torch.distributed.tensor import DTensor

    from megatron_vlm.models.common.moe import moe_layers
    from megatron_vlm.models.mcore.layer import native_state_dict, use_mcore_layers
    from megatron_vlm.parallel.mesh import ParallelDims, build_ep_mesh

    folder = tmp / "layer" / "model"
    if rank == 0:
        synthesize_model_folder("tiny_qwen3_moe", folder, seed=0)
    dist.barrier()
    native = load_hf_model(str(folder), dtype=torch.float32)
    ref = {k: v.clone() for k, v in native.state_dict().items()}
    mc = copy.deepcopy(native)
    ep_mesh = build_ep_mesh(ParallelDims(1, 2, 2, ep=2), "cpu")
    use_mcore_layers(mc, ep_mesh=ep_mesh)
    assert dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()) == [0, 1]
    n_experts = moe_layers(native)[0].num_experts
    layer = mc.language_model.layers[0]
    experts = layer.mcore.mlp.experts.local_experts
    assert layer.ep == 2 and len(experts) == n_experts // 2
    native_first = native.language_model.layers[0].mlp.experts.gate_up_proj
    for j, expert in enumerate(experts):  # rank r holds the native experts r * E/2 + j
        w = expert.linear_fc1.weight
        assert isinstance(w, DTensor) and w.shape[0] == 2 * w.to_local().shape[0]
        assert torch.equal(w.to_local(), native_first[rank * n_experts // 2 + j])
    gathered = native_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                                  for k, v in mc.state_dict().items()}, mc)
    assert gathered.keys() == ref.keys() and all(torch.equal(gathered[k], ref[k]) for k in ref)

    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(rank))  # other tokens per rank
    out_n, out_m = native(ids), mc(ids)
    torch.testing.assert_close(out_m, out_n, atol=1e-5, rtol=0)
    out_n.square().mean().backward()
    out_m.square().mean().backward()
    grad_n = native.language_model.layers[0].mlp.experts.gate_up_proj.grad.clone()
    dist.all_reduce(grad_n)  # an expert's gradient comes from every rank's tokens routed to it
    for j, expert in enumerate(experts):
        torch.testing.assert_close(expert.linear_fc1.weight.grad.to_local(), grad_n[rank * n_experts // 2 + j],
                                   atol=1e-7, rtol=1e-5)
    dist.barrier()


def _same_sft(tmp: Path, rank: int, family: str, **ck) -> dict:
    """The native and the mcore ep = 2 SFT runs of `family`; rank 0 asserts they train alike."""
    eval_ = int(ck.get("data.synthetic_eval_size", 0)) > 0
    runs = {}
    for backend in ("native", "mcore"):
        out = runs[backend] = tmp / f"{family}_ep_{backend}"
        # mcore with activation checkpointing: the recomputed forward repeats the dispatcher's all-to-alls (and
        # must not count the expert loads twice)
        _run(tmp, family, out, **{"parallel.ep": 2, "parallel.backend": f'"{backend}"', "train.max_steps": STEPS,
                                  "moe.n_step_per_workload_report": 1, **ck,
                                  "train.activation_checkpointing": str(backend == "mcore").lower()})
    if rank == 0:
        a, b = runs["native"], runs["mcore"]
        for key in ("loss", "grad_norm"):
            x, y = _column(a, key), _column(b, key)
            assert len(x) == len(y) == STEPS and len(set(x)) > 1, (family, key, x, y)
            assert max(abs(p - q) / max(1.0, abs(p)) for p, q in zip(x, y)) <= 1e-5, (family, key, x, y)
        # the [moe] statistics are global: every rank's tokens counted, as the native ep run counts them
        for key in ("moe/tokens_per_layer_mean", "moe/max_fraction_max", "moe/entropy_mean"):
            x, y = _column(a, key), _column(b, key)
            assert len(x) == STEPS and max(abs(p - q) for p, q in zip(x, y)) <= 1e-6, (family, key, x, y)
        table = (b / "moe_layer_expert_table.csv").read_text()
        assert table == (a / "moe_layer_expert_table.csv").read_text() and len(table.splitlines()) > STEPS
        if eval_:  # the end-of-run evaluation: loss, and greedy decoding in lock-step through the ep layers
            ev = [list(csv.DictReader((o / "metrics_eval.csv").read_text().splitlines()))[-1] for o in (a, b)]
            assert float(ev[0]["answer_n"]) > 0 and ev[0]["answer_accuracy"] == ev[1]["answer_accuracy"], ev
            assert abs(float(ev[0]["loss"]) - float(ev[1]["loss"])) <= 1e-5, ev
        e_a, e_b = _export(a), _export(b)
        assert e_a.keys() == e_b.keys() and any(".experts." in k for k in e_a)
        diff = max(((e_a[k] - e_b[k]).abs().max().item(), k) for k in e_a)
        assert diff[0] <= 1e-6, (family, diff)
    dist.barrier()
    return runs


def _parts(tmp: Path, rank: int) -> None:
    _check_layer_experts(tmp, rank)
    _same_sft(tmp, rank, "qwen3_vl_moe", **{"moe.aux_loss_coef": 0.01})


def _resume(tmp: Path, rank: int, family: str, runs: dict, ck: dict) -> None:
    """The mcore ep = 2 run's step-2 checkpoint resumes with the uninterrupted run's losses."""
    resumed = tmp / f"{family}_ep_mcore_resumed"
    if rank == 0:
        shutil.copytree(runs["mcore"] / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    dist.barrier()
    _run(tmp, family, resumed, **{"parallel.ep": 2, "parallel.backend": '"mcore"', "train.max_steps": STEPS,
                                  "train.activation_checkpointing": "true", **ck, "checkpoint.resume": '"auto"',
                                  "checkpoint.export_hf": "false"})
    if rank == 0:
        full, res = _column(runs["mcore"], "loss"), _column(resumed, "loss")
        assert len(res) == STEPS - 2 and max(abs(p - q) for p, q in zip(full[2:], res)) <= 1e-6, (full, res)
    dist.barrier()


@pytest.mark.heavy  # ~14 s; CI keeps tests/unit/mcore/test_mcore_ep_shard.py
def test_mcore_ep2_sft_matches_native_ep2(tmp_path):
    spawn(tmp_path, _parts)


def _heavy_parts(tmp: Path, rank: int) -> None:
    ck = {"checkpoint.enable": "true", "checkpoint.every_steps": 2}
    _resume(tmp, rank, "nemotron_vl", _same_sft(tmp, rank, "nemotron_vl", **ck, **{"data.synthetic_eval_size": 8}), ck)
    model = tmp / "grpo" / "model"
    if rank == 0:
        synthesize_model_folder("tiny_qwen3_vl_moe", model, seed=0)
    dist.barrier()
    runs = {}
    for name, backend, weights in (("native", "native", "shared"), ("mcore", "mcore", "shared"),
                                   ("mcore_copy", "mcore", "copy")):
        runs[name] = tmp / "grpo" / name
        _grpo(model, runs[name], init_distributed(), **{"parallel.ep": 2, "parallel.backend": f'"{backend}"',
                                                        "rl.rollout.weights": f'"{weights}"'})
    if rank == 0:
        assert _column(runs["native"], "grad_norm")[0] > 0
        for name in ("mcore", "mcore_copy"):
            for key in ("loss", "grad_norm", "reward/mean"):
                ref, got = _column(runs["native"], key), _column(runs[name], key)
                scale = max(1.0, max(abs(v) for v in ref))
                assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, \
                    (name, key, ref, got)
    dist.barrier()


@pytest.mark.heavy
def test_mcore_ep2_nemotron_sft_and_grpo_match_native_ep2(tmp_path):
    spawn(tmp_path, _heavy_parts)
