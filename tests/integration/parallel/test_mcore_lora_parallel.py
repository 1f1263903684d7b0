"""`[lora]` with `parallel.backend = "mcore"` on 2 gloo processes (one start): data parallelism (FSDP2 shards the
adapters with their blocks), context parallelism (each rank's layers see half of every pack's tokens), expert
parallelism (each rank's MoE layers hold half of the frozen routed experts) and pipeline parallelism (each
stage holds its own layers' adapters; the adapter file and export gathered over the stages) and tensor
parallelism (each rank reads its blocks of the whole factors; native: split DTensor factors). For each layout
the megatron-core run equals the native LoRA run of the same layout: losses and grad norms (1e-5), the merged
HF export (1e-6) and the PEFT adapter (1e-5: Adam steps on a ~1e-7 gradient difference). The tiny
Qwen3-VL-MoE: MoE layers with adapted attention (QK-norm after the q / k updates) and a dense layer with an
adapted MLP; adapter dropout on. Then two GRPO steps of the tiny Qwen2.5-VL (dp = 2, rl.loss.kl_coef > 0: rollouts
decoded through the adapted megatron-core layers, the reference = the policy with its adapters off) give the
native LoRA run's loss, grad norm and reward (1e-5), and so do two GRPO steps with tp = 2. In CI ~40 s."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron_vlm.parallel import init_distributed  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from tests.integration.parallel.spawn import spawn  # noqa: E402
from tests.integration.parallel.test_mcore_pp import STEPS, _assert_close_runs  # noqa: E402
from tests.integration.parallel.test_tp_cp_families import _column, _grpo, _run  # noqa: E402

pytestmark = [pytest.mark.distributed]

LORA = {"train.train_layers": "[]", "lora.r": 4, "lora.alpha": 8, "lora.dropout": 0.1, "optimizer.lr": 1e-3,
        "train.max_steps": STEPS}
LAYOUTS = {"dp": {}, "cp": {"parallel.cp": 2}, "ep": {"parallel.ep": 2}, "pp": {"parallel.pp": 2, "train.micro_batches_per_step": 2},
           "tp": {"parallel.tp": 2}}


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


def _layouts(tmp: Path, rank: int) -> None:
    family = "qwen3_vl_moe"
    for layout, sets in LAYOUTS.items():
        runs = {}
        for backend in ("native", "mcore"):
            runs[backend] = tmp / family / f"{layout}_{backend}"
            _run(tmp, family, runs[backend], **{"parallel.backend": f'"{backend}"', **LORA, **sets})
        if rank == 0:
            _assert_close_runs(f"{family} [lora] {layout}: mcore vs native", runs["native"], runs["mcore"])
            a, b = _adapter(runs["native"]), _adapter(runs["mcore"])
            assert a.keys() == b.keys() and a and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)
            diff = max(((a[k] - b[k]).abs().max().item(), k) for k in a)
            assert diff[0] <= 1e-5, (layout, diff)
        dist.barrier()


def _grpo_lora(tmp: Path, rank: int, tp: int) -> None:
    """Two GRPO steps (dp = 2, or tp = 2) with [lora] and a KL term: the rollout decodes through the adapted
    layers, the reference is the policy with its adapters switched off."""
    model = tmp / "grpo" / "model"
    if rank == 0 and not model.is_dir():
        synthesize_model_folder("tiny_qwen2_5_vl", model, seed=0)
    dist.barrier()
    runs = {}
    for backend in ("native", "mcore"):
        runs[backend] = tmp / "grpo" / f"{backend}_tp{tp}"
        _grpo(model, runs[backend], init_distributed(), **{"parallel.backend": f'"{backend}"', "rl.loss.kl_coef": 0.1,
                                                           "parallel.tp": tp,
                                                           **{k: v for k, v in LORA.items() if k != "train.max_steps"}})
    if rank == 0:
        for key in ("loss", "grad_norm", "reward/mean"):
            ref, got = _column(runs["native"], key), _column(runs["mcore"], key)
            scale = max(1.0, max(abs(v) for v in ref))
            assert len(ref) == len(got) == 2 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5 * scale, (tp, key, ref, got)
        assert _column(runs["native"], "grad_norm")[0] > 0
    dist.barrier()


def _all(tmp: Path, rank: int) -> None:
    _layouts(tmp, rank)
    _grpo_lora(tmp, rank, tp=1)
    _grpo_lora(tmp, rank, tp=2)


@pytest.mark.heavy  # ~38 s; CI keeps the unit tests (tests/unit/mcore/test_mcore_lora.py)
def test_mcore_lora_dp_cp_ep_pp_match_native(tmp_path):
    spawn(tmp_path, _all)
