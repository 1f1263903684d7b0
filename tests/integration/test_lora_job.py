"""A whole LoRA SFT job through the entry point (tiny Qwen2.5-VL, adapter dropout and activation
checkpointing on): the run writes a PEFT adapter that `peft` loads onto the transformers base model
with the logits of the merged export; resuming from a checkpoint reproduces the adapter exactly;
`convert_checkpoint.py` writes the same adapter, and with `--merge` the same merged model."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from jobs import REPO, load_safetensors_dir, read_metrics, run_job, run_job_here, small_demo_overrides

pytest.importorskip("peft")


def _overrides(out, assets, **extra):
    lora = {"train.train_layers": "[]", "lora.r": 4, "lora.alpha": 8, "lora.dropout": 0.1,
            "lora.target_modules": '["q_proj", "v_proj", "o_proj", "down_proj"]', "train.activation_checkpointing": "true",
            "train.max_steps": 3, "checkpoint.every_steps": 2, "checkpoint.keep_last": 0, "train.eval_generate": "false",
            "data.synthetic_eval_size": 4, "optimizer.lr": 3e-3}
    return small_demo_overrides(out, assets, **{**lora, **extra})


def _convert(argv):
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "launch" / "convert_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


def test_lora_job_adapter_resume_and_merge(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_job_here(_overrides(straight, tmp_path))
    ckpt = straight / "checkpoints"
    r = run_job_here(_overrides(resumed, tmp_path, **{"checkpoint.resume": f'"{ckpt / "step_2"}"'}))
    assert "Resumed from checkpoint: step=2" in r.stderr
    a, b = load_safetensors_dir(straight / "adapter"), load_safetensors_dir(resumed / "adapter")
    assert a.keys() == b.keys() and len(a) == 2 * 4 * 2  # 4 projections x 2 layers x (A, B)
    assert all(torch.equal(a[k], b[k]) for k in a)
    la = {int(x["step"]): float(x["loss"]) for x in read_metrics(straight / "metrics_train.csv")}
    lb = {int(x["step"]): float(x["loss"]) for x in read_metrics(resumed / "metrics_train.csv")}
    assert lb[3] == la[3] and sorted(lb) == [3]
    # the adapter trained: B moved away from its zero initialisation
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 0

    # convert_checkpoint: the adapter again, and the merged model equal to the run's export
    assert _convert(["--checkpoint", str(ckpt / "step_3"), "--out", str(tmp_path / "adapter2")]) == 0
    c = load_safetensors_dir(tmp_path / "adapter2")
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)
    assert _convert(["--checkpoint", str(ckpt / "step_3"), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    m, hf = load_safetensors_dir(tmp_path / "merged"), load_safetensors_dir(straight / "hf")
    assert m.keys() == hf.keys() and all(torch.equal(m[k], hf[k]) for k in m)

    # peft on the transformers base model == transformers on the merged export
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    sys.path.insert(0, str(REPO))
    from tests.fixtures import tiny_qwen2_5_vl as F

    base = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(straight / "adapter")).eval()
    merged = AutoModelForImageTextToText.from_pretrained(str(straight / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": F.mm_token_type_ids(ids)}
    with torch.no_grad():
        ref, got = peft_model(**batch).logits, merged(**batch).logits
    assert (ref - got).abs().max().item() <= 1e-4
    with torch.no_grad(), peft_model.disable_adapter():
        plain = peft_model(**batch).logits
    assert (plain - got).abs().max().item() > 1e-3  # the merged export is not the base model

    # launch/evaluate.py with eval.adapter on the base model answers as the merged export does
    sys.path.insert(0, str(REPO / "launch"))
    import evaluate

    def evaluate_run(name, model, adapter=""):
        ev = tmp_path / f"{name}.toml"
        ev.write_text(f'[model]\npath = "{model}"\n[data]\nmax_tokens_per_pack = 262\nnum_workers = 0\n'
                      f'[train]\noutput_dir = "{tmp_path / name}"\n[eval]\nmax_new_tokens = 6\nadapter = "{adapter}"\n'
                      f'[[eval.benchmarks]]\nname = "heldout"\npath = "{tmp_path / "data" / "eval.jsonl"}"\nformat = "messages"\n')
        assert evaluate.main(["--config", str(ev)]) == 0
        return [json.loads(x)["greedy"] for x in (tmp_path / name / "eval_predictions" / "heldout.jsonl").open()]

    with_adapter = evaluate_run("eval_adapter", tmp_path / "model", straight / "adapter")
    assert len(with_adapter) == 4 and with_adapter == evaluate_run("eval_merged", straight / "hf")


@pytest.mark.heavy
def test_kill_after_a_periodic_evaluation_resumes_exactly_with_adapter_dropout(tmp_path):
    """kill -9 before step 4, after the step-2 checkpoint and evaluation; `resume = "auto"` reruns steps 3-4. The
    adapter dropout draws from torch's RNG, which the evaluation's loader used to shift after the checkpoint had
    saved it: the resumed step 3 then dropped other units (loss 7.05717 vs 7.05703, adapter off by 5e-4)."""
    common = {"train.max_steps": 4, "train.eval_every": 2, "lora.target_modules": '["q_proj", "v_proj"]',
              "optimizer.lr": 1e-3}
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job(_overrides(straight, tmp_path, **common))
    r = run_job(_overrides(crashed, tmp_path, **common), env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "4"}, check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    r = run_job(_overrides(crashed, tmp_path, **common))
    assert "Resumed from checkpoint: step=2" in r.stderr
    la = {int(x["step"]): float(x["loss"]) for x in read_metrics(straight / "metrics_train.csv")}
    lb = {int(x["step"]): float(x["loss"]) for x in read_metrics(crashed / "metrics_train.csv")}
    assert [lb[s] for s in range(1, 5)] == [la[s] for s in range(1, 5)]
    ea = {int(x["step"]): x["loss"] for x in read_metrics(straight / "metrics_eval.csv")}
    eb = {int(x["step"]): x["loss"] for x in read_metrics(crashed / "metrics_eval.csv")}
    assert sorted(ea) == sorted(eb) == [2, 4] and ea == eb
    a, b = load_safetensors_dir(straight / "adapter"), load_safetensors_dir(crashed / "adapter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
