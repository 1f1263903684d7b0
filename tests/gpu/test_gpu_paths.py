"""The training paths on a CUDA device, compared with the CPU reference run of the same job.

Run by `benchmarks/gpu_suite.sh` (section "tests"); skipped without CUDA. What each test proves:
- SFT: bf16 FSDP2 (mixed precision, NCCL process group, fused AdamW) follows the fp32 CPU run of the
  same tiny job step for step, within bf16 tolerance (the loss curve, and the trained weights);
- GRPO: a short GRPO job runs on the GPU end to end (rollout with the KV cache on the device, rewards,
  update, export) with finite losses;
- rollout: greedy decoding in fp32 gives the same tokens on the GPU as on the CPU.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from jobs import REPO, load_safetensors_dir, read_metrics, run_job, small_demo_overrides  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_sft_bf16_on_gpu_follows_fp32_cpu(tmp_path):
    assets = tmp_path / "assets"
    runs = {}
    for name, device, precision in (("cpu", "cpu", "fp32"), ("gpu", "cuda", "bf16")):
        out = tmp_path / name
        run_job(small_demo_overrides(out, assets, **{"train.max_steps": 10, "train.precision": f'"{precision}"',
                                                    "checkpoint.every_steps": 0}),
                env={"MEGATRON_VLM_DEVICE": device})
        runs[name] = ([float(r["loss"]) for r in read_metrics(out / "metrics_train.csv")],
                      load_safetensors_dir(out / "hf"))
    (cpu_loss, cpu_w), (gpu_loss, gpu_w) = runs["cpu"], runs["gpu"]
    assert len(cpu_loss) == len(gpu_loss) == 10
    for step, (a, b) in enumerate(zip(cpu_loss, gpu_loss), 1):
        assert math.isfinite(b) and abs(a - b) <= 0.03 * abs(a) + 0.01, f"step {step}: cpu {a} vs gpu {b}"
    changed = 0
    for key, w in cpu_w.items():
        diff = (gpu_w[key].float() - w.float()).abs().max().item()
        assert diff <= 0.02 * max(w.float().abs().max().item(), 1.0), f"{key}: max |diff| {diff}"
        changed += 1
    assert changed > 0


def test_grpo_job_on_gpu(tmp_path):
    assets, out = tmp_path / "assets", tmp_path / "grpo"
    run_job(small_demo_overrides(tmp_path / "sft", assets, **{"train.max_steps": 2}), env={"MEGATRON_VLM_DEVICE": "cuda"})
    sets = {
        "model.path": f'"{tmp_path / "sft" / "hf"}"', "data.synthetic_dir": f'"{assets / "data"}"',
        "data.synthetic_train_size": "64", "data.synthetic_eval_size": "8", "data.max_tokens_per_pack": "256",
        "train.output_dir": f'"{out}"', "train.max_steps": "3", "logging.tensorboard": "false",
        "checkpoint.every_steps": "0", "rl.batch.group_size": "4", "rl.batch.prompts_per_step": "4", "rl.rollout.max_new_tokens": "4",
        "rl.model_path_hint": '""', "rl.eval.every_steps": "0",
    }
    run_job([f"{k}={v}" for k, v in sets.items()], config=REPO / "launch" / "configs" / "demo_grpo.toml",
            env={"MEGATRON_VLM_DEVICE": "cuda"})
    rows = read_metrics(out / "metrics_train.csv")
    assert len(rows) == 3 and all(math.isfinite(float(r["loss"])) for r in rows)
    assert (out / "hf" / "config.json").is_file()


def test_greedy_rollout_same_tokens_on_gpu_and_cpu(devices=("cpu", "cuda")):
    from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
    from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
    from megatron_vlm.models import build_model
    from megatron_vlm.testing.tiny_model import tiny_qwen2_5_vl_hf_config

    torch.manual_seed(0)
    cfg = tiny_qwen2_5_vl_hf_config({"vocab_size": 256, "eos_token_id": 1, "image_token_id": 250, "video_token_id": 251,
                                     "vision_start_token_id": 252})
    model = build_model(cfg, dtype=torch.float32, device="cpu").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.randint(10, 200, (n,), generator=g)) for n in (5, 9, 13)]
    params = SamplingParams(max_new_tokens=12, n=2, temperature=0.0)

    class Tok:
        eos_token_id, pad_token_id = None, 0

        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    out = {}
    for device in devices:
        model.to(device)
        engine = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], device=device))
        out[device] = [s.token_ids.tolist() for s in engine.generate(prompts, params).samples]
    first, second = (out[d] for d in devices)
    assert first == second and all(len(t) == 12 for t in first)
