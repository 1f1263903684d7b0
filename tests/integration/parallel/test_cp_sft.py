"""Context parallelism (`parallel.cp = 2`) on 2 gloo processes trains exactly like data parallelism.

For each family's tiny model (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, InternVL, Nemotron-VL with its Mamba2
layers left unsplit, text-only Qwen2), two SFT jobs run inside the same two spawned workers (process
start-up paid once): dp (dp_shard = 2, one pack per rank and step) and cp (cp = 2, both ranks read the
same two packs per step, each holding half of every pack's tokens in its decoder layers). The global
batch of a step is the same two packs, so the per-step losses and grad norms must agree (fp32,
1e-5) and so must the final Hugging Face exports (1e-6; a small learning rate keeps Adam from
amplifying summation-order differences of near-zero gradients).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from jobs import REPO, free_port, load_safetensors_dir, read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 10
# (model.synthesize, data kind); nemotron_vl: hybrid Mamba2 / attention / MoE
FAMILIES = [("tiny_qwen2_5_vl", "vqa"), ("tiny_qwen3_vl", "vqa"), ("tiny_qwen3_vl_moe", "vqa"),
            ("tiny_internvl", "vqa"), ("tiny_nemotron_vl", "vqa"), ("tiny_qwen2", "arith")]


def _overrides(tmp: Path, name: str, kind: str, layout: str, out: Path) -> list[str]:
    sets = {
        "model.synthesize": f'"{name}"', "model.path": f'"{tmp / name}"', "train.output_dir": f'"{out}"',
        "train.max_steps": STEPS, "train.eval_every": 0, "train.log_every": 1, "checkpoint.enable": "false",
        "logging.tensorboard": "false", "logging.console": "false",
        "data.num_workers": 0, "data.max_tokens_per_pack": 128, "scheduler.warmup_steps": 1,
        "train.train_layers": '[".*"]', "optimizer.lr": 1e-4,
    }
    if kind == "vqa":
        sets.update({"data.synthetic_dir": f'"{tmp / "vqa"}"', "data.synthetic_train_size": 96,
                     "data.synthetic_eval_size": 0})
    else:
        sets.update({"data.train_path": f'"{tmp / "arith" / "train.parquet"}"', "data.eval_path": '""'})
    if layout == "cp":
        sets.update({"parallel.cp": 2, "train.micro_batches_per_step": 2})
    return [f"{k}={v}" for k, v in sets.items()]


def _config(kind: str):
    return REPO / "launch" / "configs" / ("demo_sft.toml" if kind == "vqa" else "demo_math_sft.toml")


def _run(tmp: Path, name: str, kind: str, layout: str, out: Path) -> None:
    import torch.distributed as dist

    from megatron_vlm.config import load_config
    from megatron_vlm.jobs import run_kind
    from megatron_vlm.parallel import init_distributed
    from megatron_vlm.testing.synthesize import synthesize_model_folder
    from megatron_vlm.training.context import RunContext

    cfg = load_config(_config(kind), _overrides(tmp, name, kind, layout, out))
    env = init_distributed()
    if env.is_main and not (tmp / name / "config.json").is_file():
        synthesize_model_folder(name, tmp / name, seed=0)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    if dist.get_world_size() > 1:
        dist.barrier()
    assert run_kind(RunContext(cfg=cfg, env=env, run_dir=out)) == 0


def _worker(rank: int, tmp: str, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    tmp_path = Path(tmp)
    for name, kind in FAMILIES:
        for layout in ("dp", "cp"):
            _run(tmp_path, name, kind, layout, tmp_path / f"{name}-{layout}")
    from megatron_vlm.parallel import destroy_distributed

    destroy_distributed()


def _column(out: Path, key: str) -> list[float]:
    return [float(r[key]) for r in read_metrics(out / "metrics_train.csv")]


def test_cp2_matches_dp_all_families(tmp_path):
    from megatron_vlm.data.synthetic_arith import write_synthetic_arith

    write_synthetic_arith(tmp_path / "arith", eval_size=8)
    mp.spawn(_worker, args=(str(tmp_path), free_port()), nprocs=2, join=True)
    for name, _ in FAMILIES:
        dp, cp = tmp_path / f"{name}-dp", tmp_path / f"{name}-cp"
        l1, l2 = _column(dp, "loss"), _column(cp, "loss")
        assert len(l1) == len(l2) == STEPS, name
        assert max(abs(a - b) for a, b in zip(l1, l2)) <= 1e-5, (name, l1, l2)
        assert len(set(l1)) > 1, (name, l1)  # the model trains: the comparison is not of constants
        g1, g2 = _column(dp, "grad_norm"), _column(cp, "grad_norm")
        assert max(abs(a - b) for a, b in zip(g1, g2)) <= 1e-5 * max(g1), (name, g1, g2)
        p1, p2 = load_safetensors_dir(dp / "hf"), load_safetensors_dir(cp / "hf")
        assert p1.keys() == p2.keys() and p1, name
        worst = max(((p1[k] - p2[k]).abs().max().item(), k) for k in p1)
        assert worst[0] <= 1e-6, (name, worst)
