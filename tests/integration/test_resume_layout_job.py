"""Resuming a checkpoint written with other layout-defining settings (checkpoint/layout.py), through whole tiny SFT
jobs of the demo config (Qwen2.5-VL), run in this process by the job runner (one through the entry point):

- a native checkpoint resumed with parallel.backend = "mcore" and the reverse, a full fine-tuning checkpoint
  resumed with [lora] and the reverse, a LoRA checkpoint resumed with another lora.r or other target layers:
  exit 2 before any shard is read, the message naming the key, the checkpoint's value, this run's value and
  what to do (not DCP's "Missing key"); with resume = "auto" no fallback to an older checkpoint;
- a full fine-tuning checkpoint resumed with train.train_layers training more parameters (no optimizer state for
  them): exit 2 naming train.train_layers and both values;
- what resumes today still does: the same settings, another lora.alpha, target_modules spelled differently
  for the same layers, train.train_layers training a subset;
- a checkpoint without the record (written before it existed) loads as before, and when it cannot, the
  error says that it predates the record.
"""
from __future__ import annotations

import contextlib
import io
import shutil

import pytest
from jobs import DEMO, read_metrics, small_demo_overrides
from jobs import run_job as run_job_process

from megatron_vlm.checkpoint.layout import LAYOUT_FILE, read_layout
from megatron_vlm.config import load_config
from megatron_vlm.runner import run_job

BASE = {"train.max_steps": 2, "checkpoint.every_steps": 2, "checkpoint.keep_last": 0, "checkpoint.export_hf": "false",
        "train.eval_generate": "false", "data.synthetic_eval_size": 4, "logging.console": "false"}
LORA = {"train.train_layers": "[]", "lora.r": 4, "lora.alpha": 8}
MCORE = {"parallel.backend": '"mcore"'}


def _job(out, assets, **sets) -> tuple[int, str]:
    """Run one job in this process: (exit code, stderr)."""
    cfg = load_config(DEMO, small_demo_overrides(out, assets, **{**BASE, **sets}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = run_job(cfg)
        except SystemExit as e:  # a refused resume ends the job with SystemExit(2) on every rank
            code = e.code
    return code, err.getvalue()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The checkpoints of three short runs: native full fine-tuning (steps 2 and 4), megatron-core (step 2), LoRA
    (step 2); and where their shared assets are."""
    tmp = tmp_path_factory.mktemp("resume_layout")
    runs = {"native": {"train.max_steps": 4}, "lora": LORA}
    try:
        import megatron.core  # noqa: F401
        runs["mcore"] = MCORE
    except ImportError:
        pass
    for name, sets in runs.items():
        code, err = _job(tmp / name, tmp, **sets)
        assert code == 0, err[-4000:]
    return tmp


def _resume(ckpts, run: str, step: int = 2) -> dict:
    return {"checkpoint.resume": f'"{ckpts / run / "checkpoints" / f"step_{step}"}"'}


def _need_mcore(ckpts):
    if not (ckpts / "mcore").is_dir():
        pytest.skip("megatron-core is not installed")


def _assert_refused(code: int, err: str, *parts: str) -> None:
    assert code == 2, err[-4000:]
    line = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(line) == 1, err[-4000:]
    for p in parts:
        assert p in line[0], (p, line[0])
    assert "Missing key" not in err and "Size mismatch" not in err  # refused before DCP read a shard


def test_the_record_is_written_with_each_checkpoint(ckpts):
    native, lora = (read_layout(ckpts / r / "checkpoints" / "step_2") for r in ("native", "lora"))
    assert native["parallel.backend"] == "native" and native["lora"] is None
    assert native["model_type"] == "qwen2_5_vl" and native["sizes"]["world_size"] == 1
    assert lora["lora"]["r"] == 4 and lora["lora"]["target_modules"] == []


@pytest.mark.parametrize("saved,now", [("native", "mcore"), ("mcore", "native")])
def test_other_backend_is_refused_naming_it(ckpts, tmp_path, saved, now):
    _need_mcore(ckpts)
    code, err = _job(tmp_path / "run", ckpts, **_resume(ckpts, saved), **(MCORE if now == "mcore" else {}))
    ckpt = ckpts / saved / "checkpoints" / "step_2"
    _assert_refused(code, err, "error: parallel.backend:", str(ckpt), f'written with parallel.backend = "{saved}"',
                    f'this run has parallel.backend = "{now}"', f'Set parallel.backend = "{saved}" to resume it',
                    "model.path = ", "another train.output_dir")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_full_checkpoint_is_refused_by_a_lora_job(ckpts, tmp_path):
    code, err = _job(tmp_path / "run", ckpts, **_resume(ckpts, "native"), **LORA)
    _assert_refused(code, err, "error: lora:", "is a full fine-tuning checkpoint (written without a [lora] section)",
                    "this run has [lora] (r = 4)", "Remove [lora] to resume it", "launch/convert_checkpoint.py")


def test_lora_checkpoint_is_refused_by_a_full_job(ckpts, tmp_path):
    code, err = _job(tmp_path / "run", ckpts, **_resume(ckpts, "lora"))
    _assert_refused(code, err, "error: lora:", "is a LoRA checkpoint (written with [lora] r = 4",
                    "this run has no [lora] section (full fine-tuning)", "Add that [lora] section to resume it",
                    "--merge")


def test_other_lora_rank_is_refused(ckpts, tmp_path):
    code, err = _job(tmp_path / "run", ckpts, **_resume(ckpts, "lora"), **{**LORA, "lora.r": 8})
    _assert_refused(code, err, "error: lora.r:", "written with lora.r = 4", "this run has lora.r = 8",
                    "Set lora.r = 4 to resume it")


def test_other_adapted_layers_are_refused(ckpts, tmp_path):
    """Fewer targets loaded without an error before, silently dropping the other layers' trained factors."""
    code, err = _job(tmp_path / "run", ckpts, **_resume(ckpts, "lora"), **{**LORA, "lora.target_modules": '["q_proj"]'})
    _assert_refused(code, err, "error: lora.target_modules:", "has adapters on 14 layers, this run on 2",
                    "only in the checkpoint: ", "written with lora.target_modules = []",
                    'this run has lora.target_modules = ["q_proj"]', 'lora.init_from_mode = "merge"')


def test_training_more_parameters_is_refused(ckpts, tmp_path):
    """The demo trains the merger and the language model; train_layers = [] trains the vision tower too."""
    code, err = _job(tmp_path / "run", ckpts, **_resume(ckpts, "native"), **{"train.train_layers": "[]"})
    _assert_refused(code, err, "error: train.train_layers:", "of them with no state in it (model.visual.blocks.",
                    'written with train.train_layers = ["^visual\\\\.merger\\\\.", "^language_model\\\\."]',
                    "this run has train.train_layers = []", "Set train.train_layers as it was (or to a subset)")


def test_auto_does_not_fall_back_past_a_refused_checkpoint(ckpts, tmp_path):
    _need_mcore(ckpts)
    run = tmp_path / "run"
    shutil.copytree(ckpts / "native" / "checkpoints", run / "checkpoints")
    code, err = _job(run, ckpts, **MCORE, **{"checkpoint.resume": '"auto"'})
    _assert_refused(code, err, "error: parallel.backend:", str(run / "checkpoints" / "step_4"))
    assert "falling back" not in err and "step_2" not in err


def test_resumes_that_worked_still_work(ckpts, tmp_path):
    """Another lora.alpha (a scaling, not a shape), target_modules naming the default layers explicitly, and
    train.train_layers training a subset of what the checkpoint has optimizer state for."""
    default = '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]'
    for name, run, sets in (("same", "lora", LORA), ("alpha", "lora", {**LORA, "lora.alpha": 16}),
                            ("targets", "lora", {**LORA, "lora.target_modules": default}),
                            ("subset", "native", {"train.train_layers": "['^language_model\\.']"})):
        code, err = _job(tmp_path / name, ckpts, **_resume(ckpts, run), **{"train.max_steps": 3, **sets})
        assert code == 0, (name, err[-4000:])
        assert [int(r["step"]) for r in read_metrics(tmp_path / name / "metrics_train.csv")] == [3], name


def test_a_checkpoint_without_the_record_loads_as_before(ckpts, tmp_path):
    old = tmp_path / "old" / "checkpoints"
    shutil.copytree(ckpts / "native" / "checkpoints" / "step_2", old / "step_2")
    (old / "step_2" / LAYOUT_FILE).unlink()
    code, err = _job(tmp_path / "same", ckpts, **{"train.max_steps": 3, "checkpoint.resume": f'"{old / "step_2"}"'})
    assert code == 0, err[-4000:]
    assert [int(r["step"]) for r in read_metrics(tmp_path / "same" / "metrics_train.csv")] == [3]
    code, err = _job(tmp_path / "lora", ckpts, **LORA, **{"checkpoint.resume": f'"{old / "step_2"}"'})
    assert code == 2 and "Missing key in checkpoint state_dict" in err, err[-4000:]
    assert "this checkpoint predates the layout record (layout.json)" in err


def test_refusal_through_the_entry_point(ckpts, tmp_path):
    """The same refusal from `launch/pretrain_vlm.py` in its own process: exit status 2, one line on stderr."""
    r = run_job_process(small_demo_overrides(tmp_path / "run", ckpts, **{**BASE, **_resume(ckpts, "lora")}), check=False)
    assert r.returncode == 2, r.stderr[-4000:]
    assert "error: lora: " in r.stderr and "this run has no [lora] section" in r.stderr, r.stderr[-4000:]


def test_other_sample_lengths_are_refused_naming_the_setting(ckpts, tmp_path):
    """A resume whose image size settings give the same records other token lengths (another pack plan) is refused
    before it continues at the checkpoint's position in that other plan (data/plan_lengths.py)."""
    code, err = _job(tmp_path / "bigger", ckpts, **_resume(ckpts, "native"),
                     **{"train.max_steps": 3, "data.min_pixels": 112 * 112})
    assert code == 2, err[-4000:]
    line = [x for x in err.splitlines() if x.startswith("config error: ")]
    assert len(line) == 1 and line[0].startswith("config error: data.min_pixels / data.max_pixels"), err[-4000:]
    for part in ("the samples' token lengths differ", '"pixels": [3136, ', '"pixels": [12544, ', 'checkpoint.resume = "none"'):
        assert part in line[0], (part, line[0])
