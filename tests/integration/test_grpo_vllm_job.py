"""A whole GRPO job with `rl.rollout_backend = "vllm"` through the entry point (one process, tiny random
Qwen2.5-VL, synthetic VQA prompts with images; marker `vllm`: runs in the environment docs/vllm.md builds,
`bash .ci/vllm_tests.sh`; skipped where vllm is not importable).

A run killed with SIGKILL before step 3 and resumed from its step-2 checkpoint repeats the uninterrupted
run exactly, as with the built-in engine (tests/integration/test_grpo_job.py): the resumed job starts a
fresh vLLM engine from model.path, its first push writes the checkpoint's weights into it, and every
request's sampling seed is drawn from the step's generator (a function of seed and step), so the same
completions come back — the same rewards, losses, KL, lengths and gradient norms at every step and the
same exported weights, with the reference model (KL), recomputed old log-probs (the vLLM / training
mismatch metrics), 2 PPO epochs x 2 mini-batches and sequence-mean loss all active.

A SIGTERM while a step's vLLM rollout runs (one job in this process, ~30 s) gives the generation up between engine
steps: the step is abandoned, the checkpoint of the step before saved, and the job exits 143."""
from __future__ import annotations

import importlib.util

import pytest
from jobs import REPO, load_safetensors_dir, read_metrics, run_job
from test_grpo_job import grpo_overrides

pytestmark = [pytest.mark.vllm, pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed here (run these tests in the vLLM environment: docs/vllm.md, "
                                        "'Running the vLLM tests')")]

GRPO_DEMO = REPO / "launch" / "configs" / "demo_grpo.toml"
VLLM = {"rl.rollout_backend": '"vllm"', "rl.vllm.cpu_kv_cache_gib": "1", "rl.vllm.max_num_seqs": "16"}


@pytest.mark.heavy  # three vLLM jobs, ~2.5-3.5 min: over CI's budget; `bash .ci/vllm_tests.sh -m vllm` runs it
def test_vllm_grpo_exact_resume_after_kill9(tmp_path):
    assets = tmp_path / "assets"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_job(grpo_overrides(straight, assets, **VLLM), config=GRPO_DEMO)
    rows = read_metrics(straight / "metrics_train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert float(rows[0]["reward/std"]) > 0 and float(rows[0]["grad_norm"]) > 0  # a real update happened
    for r in rows:  # the vLLM back end ran; its log-probs are of the distribution with the vision tokens masked
        # (docs/vllm.md), the training forward's without: per token log(1 - p(vision tokens)), ~3e-3 for this
        # random tiny model (the unmasked equality within 1e-4 is tests/unit/rl/test_vllm_engine.py's)
        assert float(r["rollout/weight_push_mb"]) > 0
        assert 0 < float(r["rollout/logprob_abs_diff"]) < 0.02, r["rollout/logprob_abs_diff"]
    assert (straight / "checkpoints" / "step_4" / "COMPLETE").is_file()

    r = run_job(grpo_overrides(crashed, assets, **VLLM), config=GRPO_DEMO, env={"MEGATRON_VLM_FAULT_KILL_AT_STEP": "3"},
                check=False)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    assert (crashed / "checkpoints" / "step_2" / "COMPLETE").is_file()
    r = run_job(grpo_overrides(crashed, assets, **VLLM), config=GRPO_DEMO)
    assert "Resumed from checkpoint: step=2" in r.stderr
    resumed = {int(x["step"]): x for x in read_metrics(crashed / "metrics_train.csv")}
    assert sorted(resumed) == [1, 2, 3, 4]
    for row in rows:
        for key in ("reward/mean", "loss", "actor/kl", "response_length/mean", "grad_norm", "rollout/logprob_abs_diff"):
            assert float(resumed[int(row["step"])][key]) == float(row[key]), (row["step"], key)
    a, b = load_safetensors_dir(straight / "hf"), load_safetensors_dir(crashed / "hf")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


def test_a_sigterm_while_vllm_generates_abandons_the_step_and_saves(tmp_path, monkeypatch, keep_signal_handlers, caplog):
    """SIGTERM while step 2's vLLM rollout runs, its engine steps slowed to 1 s (a long generation): the engine used
    not to ask the stop flag, so the step's whole rollout ran, the step was trained and step 2 saved. Now the
    generation is given up once the stop has been pending ABANDON_GRACE_S, the step abandoned (no row of it), the
    checkpoint of step 1 saved, and the job exits 143 (the resumed run redoes step 2, as with the built-in engine:
    tests/integration/test_grpo_stop_hung_step.py)."""
    import os
    import signal
    import time

    from vllm.v1.engine.llm_engine import LLMEngine

    from megatron_vlm import runner
    from megatron_vlm.config import load_config
    from megatron_vlm.inference.vllm_engine import VLLMRolloutEngine

    calls, signalled = [0], {}
    generate, step = VLLMRolloutEngine.generate, LLMEngine.step

    def counted_generate(self, *a, **k):
        calls[0] += 1
        return generate(self, *a, **k)

    def slow_step(self):
        if calls[0] == 2:  # step 2's rollout (no evaluation runs): the signal after its first engine step
            if "at" not in signalled:
                signalled["at"] = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
        return step(self)

    monkeypatch.setattr(VLLMRolloutEngine, "generate", counted_generate)
    monkeypatch.setattr(LLMEngine, "step", slow_step)
    out = tmp_path / "run"
    sets = grpo_overrides(out, tmp_path / "assets", **VLLM, **{"rl.rollout.max_new_tokens": "12", "rl.eval.at_start": "false",
                                                              "checkpoint.every_steps": "100", "train.max_steps": "3",
                                                              "checkpoint.export_hf": "false"})
    with caplog.at_level("WARNING", logger="megatron_vlm"):
        code = runner.run_job(load_config(GRPO_DEMO, sets))
    took = time.monotonic() - signalled["at"]
    assert code == 143
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step_1"], took
    assert [int(r["step"]) for r in read_metrics(out / "metrics_train.csv")] == [1]
    assert "gave up waiting for its generation" in caplog.text
    assert took < 12.0, took  # the grace and the save, not the 12+ slowed steps of the whole rollout
