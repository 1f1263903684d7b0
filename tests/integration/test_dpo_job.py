"""Whole DPO jobs through the entry point (tiny Qwen2.5-VL, synthetic VQA preference pairs).

- full fine-tuning with the precomputed reference: a run resumed from its step-2 checkpoint (in another
  folder, so the reference table is scored again from the initial weights) logs the same step-3/4 metrics
  and exports the same weights as the straight run;
- LoRA with the on-the-fly (adapters-off) reference: the run writes a PEFT adapter (adapter_config.json +
  adapter_model.safetensors) whose B factors moved, and resuming reproduces it exactly;
- heavy: the demo's task, measured before and after, raises the held-out preference accuracy;
- heavy: kill -9 after an evaluation and `resume = "auto"` reproduce the straight run exactly.
"""
from __future__ import annotations

import json

import pytest
import torch
from jobs import REPO, load_safetensors_dir, merged_sets, read_metrics, run_job, run_job_here, small_demo_overrides

DPO_DEMO = REPO / "launch" / "configs" / "demo_dpo.toml"


def _overrides(out, assets, **extra):
    sets = {"data.synthetic_train_size": 32, "data.synthetic_eval_size": 8, "train.max_steps": 4,
            "checkpoint.every_steps": 2, "checkpoint.keep_last": 0, "optimizer.lr": 2e-3}
    return small_demo_overrides(out, assets, **merged_sets(sets, extra))


def _train(path):
    return {int(r["step"]): r for r in read_metrics(path / "metrics_train.csv")}


def test_dpo_job_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_job_here(_overrides(straight, tmp_path), config=DPO_DEMO)
    r = run_job_here(_overrides(resumed, tmp_path, **{"checkpoint.resume": f'"{straight / "checkpoints" / "step_2"}"'}),
                config=DPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr
    a, b = _train(straight), _train(resumed)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected", "grad_norm"):
            assert a[step][key] == b[step][key], (step, key)
    assert float(a[4]["loss"]) != float(a[1]["loss"])  # it trained
    wa, wb = load_safetensors_dir(straight / "hf"), load_safetensors_dir(resumed / "hf")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ref_a = torch.load(straight / "dpo_reference_logps.pt", weights_only=True)
    ref_b = torch.load(resumed / "dpo_reference_logps.pt", weights_only=True)
    assert all(torch.equal(ref_a["tables"][s], ref_b["tables"][s]) for s in ("train", "eval"))
    # TRL's metrics, and the held-out evaluation before the first step (policy = reference: margins 0)
    ev = {int(r["step"]): r for r in read_metrics(straight / "metrics_eval.csv")}
    assert float(ev[0]["rewards/margins"]) == 0.0 and abs(float(ev[0]["loss"]) - 0.6931471805599453) < 1e-6


@pytest.mark.parametrize("loss", ["sigmoid"])
def test_lora_dpo_writes_a_peft_adapter_and_resumes(tmp_path, loss):
    lora = {"train.train_layers": "[]", "lora.r": 4, "lora.alpha": 8, "lora.target_modules": '["q_proj", "v_proj"]',
            "dpo.reference": '"on_the_fly"', "dpo.loss_type": f'"{loss}"', "train.max_steps": 3}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_job_here(_overrides(straight, tmp_path, **lora), config=DPO_DEMO)
    run_job_here(_overrides(resumed, tmp_path, **lora, **{"checkpoint.resume": f'"{straight / "checkpoints" / "step_2"}"'}),
            config=DPO_DEMO)
    adapter = straight / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    meta = json.loads((adapter / "adapter_config.json").read_text())
    assert meta["r"] == 4 and meta["peft_type"] == "LORA"
    a, b = load_safetensors_dir(adapter), load_safetensors_dir(resumed / "adapter")
    assert a.keys() == b.keys() and len(a) == 2 * 2 * 2  # 2 projections x 2 layers x (A, B)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 0
    assert _train(straight)[3]["loss"] == _train(resumed)[3]["loss"]


@pytest.mark.heavy
def test_dpo_raises_held_out_preference_accuracy(tmp_path):
    """The demo config, shortened: preference accuracy on the 180 held-out pairs before vs after."""
    out = tmp_path / "run"
    sets = {"model.path": f'"{tmp_path / "model"}"', "data.synthetic_dir": f'"{tmp_path / "data"}"',
            "train.output_dir": f'"{out}"', "data.num_workers": 0, "checkpoint.enable": "false",
            "checkpoint.export_hf": "false"}
    run_job([f"{k}={v}" for k, v in sets.items()], config=DPO_DEMO, timeout=1800)
    ev = {int(r["step"]): r for r in read_metrics(out / "metrics_eval.csv")}
    first, last = ev[min(ev)], ev[max(ev)]
    before, after = float(first["preference_accuracy"]), float(last["preference_accuracy"])
    print(f"held-out preference accuracy {before:.3f} -> {after:.3f}; rewards/accuracies "
          f"{float(last['rewards/accuracies']):.3f}, margins {float(last['rewards/margins']):.3f}")
    assert after >= before + 0.15, (before, after)
    assert float(last["rewards/accuracies"]) > 0.6 and float(last["rewards/margins"]) > 0


@pytest.mark.heavy
@pytest.mark.distributed
def test_two_ranks_equal_one_rank_with_two_micro_batches(tmp_path):
    """The step's loss is the mean over every pair of the step on every rank: 2 ranks x 1 pack per step log
    the metrics of 1 rank x 2 packs, and precompute the same reference table."""
    common = {"train.max_steps": 2, "train.log_every": 1, "checkpoint.enable": "false", "checkpoint.export_hf": "false"}
    two, one = tmp_path / "two", tmp_path / "one"
    run_job(_overrides(two, tmp_path, **common), nproc=2, config=DPO_DEMO)
    run_job(_overrides(one, tmp_path, **common, **{"train.micro_batches_per_step": 2}), config=DPO_DEMO)
    a, b = _train(two), _train(one)
    for step in (1, 2):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected", "grad_norm"):
            assert float(a[step][key]) == pytest.approx(float(b[step][key]), rel=1e-5, abs=1e-6), (step, key)
    ta = torch.load(two / "dpo_reference_logps.pt", weights_only=True)["tables"]
    tb = torch.load(one / "dpo_reference_logps.pt", weights_only=True)["tables"]
    assert all(torch.allclose(ta[s], tb[s], rtol=1e-6, atol=1e-4) for s in ("train", "eval"))


@pytest.mark.heavy
def test_dpo_kill9_after_an_evaluation_resumes_exactly(tmp_path):
    """kill -9 before step 4, after the step-2 checkpoint and evaluation; `resume = "auto"` in the same folder (the
    reference table read back, not scored again): the straight run's metrics, evaluations and export."""
    common = {"train.eval_every": 2}
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job(_overrides(straight, tmp_path, **common), config=DPO_DEMO)
    r = run_job(_overrides(crashed, tmp_path, **common), config=DPO_DEMO, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "4"},
                check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    r = run_job(_overrides(crashed, tmp_path, **common), config=DPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr and "reference log-probs read from" in r.stderr
    a, b = _train(straight), _train(crashed)
    for step in range(1, 5):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected", "grad_norm"):
            assert a[step][key] == b[step][key], (step, key)
    assert read_metrics(straight / "metrics_eval.csv") == read_metrics(crashed / "metrics_eval.csv")
    wa, wb = load_safetensors_dir(straight / "hf"), load_safetensors_dir(crashed / "hf")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.heavy
def test_prompt_sharing_off_trains_as_the_shared_packs(tmp_path):
    """`dpo.prompt_sharing = "off"` reaches the step (the log says so) and the plain packs train as the shared ones
    (training/pair_prompts.py), to float rounding."""
    common = {"train.max_steps": 2, "train.log_every": 1, "checkpoint.enable": "false", "checkpoint.export_hf": "false"}
    shared, plain = tmp_path / "shared", tmp_path / "plain"
    r_on = run_job(_overrides(shared, tmp_path, **common), config=DPO_DEMO)
    r_off = run_job(_overrides(plain, tmp_path, **common, **{"dpo.prompt_sharing": '"off"'}), config=DPO_DEMO)
    assert "prompts shared on" in r_on.stderr
    assert "prompts shared off (dpo.prompt_sharing = 'off')" in r_off.stderr
    a, b = _train(shared), _train(plain)
    for step in (1, 2):
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm"):
            assert float(a[step][key]) == pytest.approx(float(b[step][key]), rel=1e-4, abs=1e-5), (step, key)
