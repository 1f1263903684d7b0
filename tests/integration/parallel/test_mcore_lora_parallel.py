"""`[lora]` with `parallel.backend = "mcore"` on 2 gloo processes (one start): data parallelism (FSDP2 shards the
adapters with their blocks), context parallelism (each rank's layers see half of every pack's tokens), expert
parallelism (each rank's MoE layers hold half of the frozen routed experts) and pipeline parallelism (each
stage holds its own layers' adapters; the adapter file and export gathered over the stages). For each layout
the megatron-core run equals the native LoRA run of the same layout: losses and grad norms (1e-5), the merged
HF export (1e-6) and the PEFT adapter (1e-5: Adam steps on a ~1e-7 gradient difference). The tiny
Qwen3-VL-MoE: MoE layers with adapted attention (QK-norm after the q / k updates) and a dense layer with an
adapted MLP; adapter dropout on. tp is refused with [lora] under mcore (tests/unit/mcore/test_mcore_lora.py).
In CI ~30 s."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("megatron.core")

from tests.integration.parallel.test_mcore_pp import STEPS, _assert_close_runs  # noqa: E402
from tests.integration.parallel.test_mcore_tp import _spawn  # noqa: E402
from tests.integration.parallel.test_tp_cp_families import _run  # noqa: E402

pytestmark = [pytest.mark.distributed]

LORA = {"train.train_layers": "[]", "lora.r": 4, "lora.alpha": 8, "lora.dropout": 0.1, "optimizer.lr": 1e-3,
        "train.max_steps": STEPS}
LAYOUTS = {"dp": {}, "cp": {"parallel.cp": 2}, "ep": {"parallel.ep": 2}, "pp": {"parallel.pp": 2, "train.micro_batches_per_step": 2}}


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


def test_mcore_lora_dp_cp_ep_pp_match_native(tmp_path):
    _spawn(tmp_path, _layouts)
