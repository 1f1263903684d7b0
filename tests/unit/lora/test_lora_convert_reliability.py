"""`launch/convert_checkpoint.py` and `eval.adapter` on bad or misleading inputs.

- Conversion follows the checkpoint's own `layout.json`: a LoRA checkpoint whose run folder's config.toml
  lost its `[lora]` section (an evaluation pointed at the run used to overwrite it) still converts to its
  adapter / merged model, never silently to the base weights.
- An evaluation pointed at an existing run folder never overwrites its config.toml.
- Input errors are one `error:` line with exit 2: `--out` a file, a `--model-path` without config.json, a
  checkpoint without `.metadata`, a base model the adapter does not fit, an adapter or checkpoint holding
  NaN (nothing written).
- `eval.adapter` honours the adapter's `target_modules`: factors for layers it does not name are refused.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_vlm.checkpoint.hf import save_hf_model
from megatron_vlm.checkpoint.layout import run_layout
from megatron_vlm.checkpoint.manager import CheckpointManager
from megatron_vlm.config.sections import LoRAConfig
from megatron_vlm.models import build_model
from megatron_vlm.models.common.lora import lora_modules
from megatron_vlm.training.lora import setup_lora, write_adapter
from tests.fixtures import tiny_qwen2_5_vl as FQ

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launch"))
import convert_checkpoint  # noqa: E402

LORA = LoRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


class _Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model


def _lora_model(cfg: dict, lora: LoRAConfig = LORA, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(cfg)
    setup_lora(model, lora, model.hf_config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A base model folder and a LoRA run folder with one checkpoint (and its layout record)."""
    tmp = tmp_path_factory.mktemp("lora_run")
    cfg = FQ.tiny_qwen2_5_vl_config_dict()
    torch.manual_seed(0)
    save_hf_model(build_model(cfg), tmp / "base")
    model = _lora_model(cfg)
    torch.manual_seed(0)
    base_sd = build_model(cfg).state_dict()
    model.load_state_dict({**model.state_dict(), **base_sd}, strict=True)  # the base weights of tmp/base
    wrapper = _Wrapper(model)
    opt = torch.optim.AdamW([p for n, p in wrapper.named_parameters() if "lora_" in n], lr=1e-3)
    layout = run_layout(NS(model=NS(path=str(tmp / "base")), lora=LORA, train=NS(train_layers=[])),
                        model_type=cfg["model_type"], world_size=1, mcore_tp=None, mcore_ep=None)
    CheckpointManager(tmp / "run", keep_last=0, rank=0).save(1, wrapper, opt, {"data": {}}, layout=layout)
    # what an evaluation pointed at the run left as its config.toml before: no [lora] section
    (tmp / "run" / "config.toml").write_text(f'[model]\npath = "{tmp / "base"}"\n')
    return NS(tmp=tmp, cfg=cfg, model=model, ckpt=tmp / "run" / "checkpoints" / "step_1")


def _convert(args, capsys):
    code = convert_checkpoint.main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_conversion_follows_the_checkpoint_layout_not_config_toml(run, tmp_path, capsys):
    code, err = _convert(["--checkpoint", run.ckpt, "--out", tmp_path / "adapter"], capsys)
    assert code == 0, err
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    b = {k: v for k, v in written.items() if k.endswith("lora_B.weight")}
    assert len(b) == len(lora_modules(run.model)) and all(v.abs().sum() > 0 for v in b.values())
    code, err = _convert(["--checkpoint", run.ckpt, "--merge", "--out", tmp_path / "merged"], capsys)
    assert code == 0, err
    base = load_file(str(run.tmp / "base" / "model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)


def test_a_merge_mode_checkpoint_converts_to_an_adapter_naming_no_base(run, tmp_path, capsys):
    """A run with lora.init_from_mode = "merge" trained its factors on base + the earlier adapter: the converted
    adapter must not name the original base (PEFT would load it without the earlier adapter), as the run's own
    export does not; the layout records the mode, so config.toml is not needed."""
    merge = LoRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"], init_from=str(tmp_path / "earlier"),
                       init_from_mode="merge")
    wrapper = _Wrapper(run.model)
    opt = torch.optim.AdamW([p for n, p in wrapper.named_parameters() if "lora_" in n], lr=1e-3)
    layout = run_layout(NS(model=NS(path=str(run.tmp / "base")), lora=merge, train=NS(train_layers=[])),
                        model_type=run.cfg["model_type"], world_size=1, mcore_tp=None, mcore_ep=None)
    CheckpointManager(tmp_path / "run", keep_last=0, rank=0).save(1, wrapper, opt, {"data": {}}, layout=layout)
    code, err = _convert(["--checkpoint", tmp_path / "run" / "checkpoints" / "step_1", "--out", tmp_path / "adapter"],
                         capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    code, err = _convert(["--checkpoint", run.ckpt, "--out", tmp_path / "plain"], capsys)  # continue mode: the base
    assert code == 0 and json.loads((tmp_path / "plain" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(run.tmp / "base")


def test_input_errors_are_one_line_exit_2(run, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["--checkpoint", run.ckpt, "--out", a_file], "--out: "),
        (["--checkpoint", run.ckpt, "--model-path", tmp_path, "--out", tmp_path / "o"], "--model-path: "),
        (["--adapter", tmp_path / "nowhere", "--merge", "--model-path", run.tmp / "base", "--out", tmp_path / "o"],
         "--adapter: "),
    ]
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(run.ckpt, broken)
    (broken / ".metadata").unlink()
    cases.append((["--checkpoint", broken, "--out", tmp_path / "o"], "has no .metadata"))
    for args, expect in cases:
        code, err = _convert(args, capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], (args, err)
    assert not (tmp_path / "o").exists()


def test_checkpoint_that_does_not_fit_the_model_or_is_damaged_is_one_line_exit_2(run, tmp_path, capsys):
    """DCP reports a load failure as CheckpointException, a BaseException: it escaped the input-error handling as a
    traceback with exit 1 (a --model-path of another size, a truncated shard)."""
    import copy
    import shutil

    other_cfg = copy.deepcopy(run.cfg)
    other_cfg["text_config"]["intermediate_size"] *= 2  # the same family, other MLP widths
    save_hf_model(build_model(other_cfg), tmp_path / "other")
    code, err = _convert(["--checkpoint", run.ckpt, "--model-path", tmp_path / "other", "--out", tmp_path / "o"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Size mismatch" in lines[0], err
    damaged = tmp_path / "damaged"
    shutil.copytree(run.ckpt.parent.parent, damaged)  # the run folder (config.toml beside checkpoints/)
    shard = next((damaged / "checkpoints" / "step_1").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 10])
    code, err = _convert(["--checkpoint", damaged / "checkpoints" / "step_1", "--out", tmp_path / "o"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert not (tmp_path / "o").exists()


def test_adapter_on_a_base_it_does_not_fit_is_refused(run, tmp_path, capsys):
    write_adapter(tmp_path / "adapter", run.model.state_dict(), run.cfg, LORA)
    weightless = tmp_path / "weightless"  # a config.json without its weights
    weightless.mkdir()
    (weightless / "config.json").write_text((run.tmp / "base" / "config.json").read_text())
    code, err = _convert(["--adapter", tmp_path / "adapter", "--merge", "--model-path", weightless,
                          "--out", tmp_path / "o"], capsys)
    assert code == 2 and err.startswith("error: --model-path: cannot load") and len(err.strip().splitlines()) == 1, err
    # factors whose shapes do not fit the base's layers
    f = tmp_path / "adapter" / "adapter_model.safetensors"
    t = load_file(str(f))
    save_file({k: (torch.cat([v, v], dim=1) if k.endswith("lora_A.weight") else v) for k, v in t.items()}, str(f))
    code, err = _convert(["--adapter", tmp_path / "adapter", "--merge", "--model-path", run.tmp / "base",
                          "--out", tmp_path / "o"], capsys)
    assert code == 2 and err.startswith("error: cannot merge") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_non_finite_adapter_or_checkpoint_is_refused(run, tmp_path, capsys):
    write_adapter(tmp_path / "adapter", run.model.state_dict(), run.cfg, LORA)
    f = tmp_path / "adapter" / "adapter_model.safetensors"
    t = load_file(str(f))
    key = next(k for k in t if k.endswith("lora_B.weight"))
    t[key][0, 0] = float("nan")
    save_file(t, str(f), metadata={"format": "pt"})
    code, err = _convert(["--adapter", tmp_path / "adapter", "--merge", "--model-path", run.tmp / "base",
                          "--out", tmp_path / "o"], capsys)
    assert code == 2 and "non-finite" in err and ".lora_B" in err, err
    assert not (tmp_path / "o").exists()
    # evaluation reads the adapter the same way (setup_lora -> read_peft_adapter): refused, not scored as garbage
    with pytest.raises(ValueError, match="lora.init_from: .*non-finite"):
        setup_lora(build_model(run.cfg), LoRAConfig(r=4, alpha=8.0, init_from=str(tmp_path / "adapter")), run.cfg)


def test_eval_adapter_honours_target_modules(run, tmp_path):
    from megatron_vlm.jobs import _eval_adapter_lora

    write_adapter(tmp_path / "adapter", run.model.state_dict(), run.cfg, LORA)
    meta = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    lora = _eval_adapter_lora(str(tmp_path / "adapter"))
    fresh = build_model(run.cfg)
    setup_lora(fresh, lora, run.cfg)  # as written: exactly the layers target_modules names
    assert len(lora_modules(fresh)) == len(meta["target_modules"]) == len(lora_modules(run.model))
    # an adapter whose factors cover layers target_modules does not name: PEFT would not apply those
    meta["target_modules"] = [t for t in meta["target_modules"] if t.endswith("q_proj")]
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="differ from lora.target_modules"):
        setup_lora(build_model(run.cfg), _eval_adapter_lora(str(tmp_path / "adapter")), run.cfg)


def test_evaluation_never_overwrites_a_run_config(tmp_path, capsys):
    import evaluate

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("# the training run's config\n")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = tmp_path / "e.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path / "m"}"\n[train]\noutput_dir = "{run_dir}"\n'
                   f'[eval]\nadapter = "{tmp_path / "lora"}"\n[[eval.benchmarks]]\nname = "x"\npath = "{tmp_path}"\n'
                   'format = "geometry3k"\n')
    assert evaluate.main(["--config", str(cfg)]) == 2  # (the adapter is unreadable: stops early)
    capsys.readouterr()
    assert (run_dir / "config.toml").read_text() == "# the training run's config\n"
    assert (run_dir / "eval_config.toml").is_file()
