"""`launch/convert_checkpoint.py` writes the dtype a run exports in: the run's `checkpoint.export_dtype` (its
config.toml) for `--checkpoint`, `--dtype` over it (and for `--adapter --merge`); it always wrote fp32 before, a
folder twice the size of the run's own bf16 export. It also writes the run's data pixel limits into the processor
configs, as the run's export does. Reference: the dtypes safetensors reads back from the written files."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from safetensors import safe_open

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.checkpoint.layout import run_layout
from megatron_vlm.checkpoint.manager import CheckpointManager
from megatron_vlm.config.sections import LoRAConfig
from megatron_vlm.testing.synthesize import synthesize_model_folder
from megatron_vlm.training.lora import setup_lora, write_adapter

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launch"))
import convert_checkpoint  # noqa: E402


class _Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A model folder, and a full fine-tuning run folder with one checkpoint whose config.toml says bfloat16."""
    tmp = tmp_path_factory.mktemp("run")
    base = synthesize_model_folder("tiny_qwen2_5_vl", tmp / "base", seed=3)
    model = load_hf_model(base)
    wrapper = _Wrapper(model)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    layout = run_layout(NS(model=NS(path=str(base)), lora=None, train=NS(train_layers=[])),
                        model_type=model.hf_config["model_type"], world_size=1, mcore_tp=None, mcore_ep=None)
    CheckpointManager(tmp / "run", keep_last=0, rank=0).save(1, wrapper, opt, {"data": {}}, layout=layout)
    (tmp / "run" / "config.toml").write_text(f'[model]\npath = "{base}"\n[checkpoint]\nexport_dtype = "bfloat16"\n'
                                             f'[data]\nmax_pixels = {28 * 28 * 64}\n')
    return NS(tmp=tmp, base=base, model=model, ckpt=tmp / "run" / "checkpoints" / "step_1")


def _convert(args, capsys):
    code = convert_checkpoint.main([str(a) for a in args])
    return code, capsys.readouterr().err


def _dtypes(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118


def test_a_run_checkpoint_converts_in_the_runs_export_dtype(run, tmp_path, capsys):
    code, err = _convert(["--checkpoint", run.ckpt, "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert _dtypes(tmp_path / "hf") == {"BF16"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    pre = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert pre["size"]["longest_edge"] == 28 * 28 * 64  # the run's data.max_pixels


@pytest.mark.parametrize("name, stored", [("float16", "F16"), ("float32", "F32")])
def test_dtype_overrides_the_runs_export_dtype(run, tmp_path, capsys, name, stored):
    code, err = _convert(["--checkpoint", run.ckpt, "--dtype", name, "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert _dtypes(tmp_path / "hf") == {stored}


def test_an_adapter_merge_is_written_in_the_dtype_asked(run, tmp_path, capsys):
    lora = LoRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    model = load_hf_model(run.base)
    setup_lora(model, lora, model.hf_config)
    write_adapter(tmp_path / "adapter", model.state_dict(), model.hf_config, lora, base_model_name_or_path=str(run.base))
    code, err = _convert(["--adapter", tmp_path / "adapter", "--model-path", run.base, "--merge", "--dtype",
                          "bfloat16", "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert _dtypes(tmp_path / "hf") == {"BF16"}


def test_a_bad_export_dtype_in_the_runs_config_is_one_line_exit_2(run, tmp_path, capsys):
    cfg = run.ckpt.parent.parent / "config.toml"
    kept = cfg.read_text()
    try:
        cfg.write_text(kept.replace('"bfloat16"', '"fp8"'))
        code, err = _convert(["--checkpoint", run.ckpt, "--out", tmp_path / "hf"], capsys)
    finally:
        cfg.write_text(kept)
    assert code == 2 and "checkpoint.export_dtype" in err and "--dtype" in err
    assert not (tmp_path / "hf").exists()


def test_a_bf16_run_without_export_dtype_converts_as_its_own_export(run, tmp_path, capsys):
    """`model.dtype = "bfloat16"` (the weights held in bf16) and no `checkpoint.export_dtype`: the run's own export is
    "as the run holds them", bf16; the converter built an fp32 model, read the bf16 checkpoint into it and wrote an
    fp32 folder (twice the size, config.json naming float32). Reference: the run's export path
    (`export_hf_from_state_dict` of the held state dict, no dtype), read back by safetensors."""
    from safetensors.torch import load_file

    from megatron_vlm.checkpoint.export import export_hf_from_state_dict

    model = load_hf_model(run.base, dtype=torch.bfloat16)
    wrapper = _Wrapper(model)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    layout = run_layout(NS(model=NS(path=str(run.base)), lora=None, train=NS(train_layers=[])),
                        model_type=model.hf_config["model_type"], world_size=1, mcore_tp=None, mcore_ep=None)
    CheckpointManager(tmp_path / "run", keep_last=0, rank=0).save(1, wrapper, opt, {"data": {}}, layout=layout)
    (tmp_path / "run" / "config.toml").write_text(f'[model]\npath = "{run.base}"\ndtype = "bfloat16"\n')
    export_hf_from_state_dict(model.state_dict(), run.base, tmp_path / "own")  # the run's export (rank 0's gather)
    code, err = _convert(["--checkpoint", tmp_path / "run" / "checkpoints" / "step_1", "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert _dtypes(tmp_path / "hf") == _dtypes(tmp_path / "own") == {"BF16"}
    own, conv = load_file(tmp_path / "own" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert own.keys() == conv.keys() and all(torch.equal(own[k], conv[k]) for k in own)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_bf16_lora_run_converts_to_the_adapter_its_own_export_writes(run, tmp_path, capsys):
    """A LoRA run with `model.dtype = "bfloat16"` holds bf16 factors and writes its adapter as held (bf16); the
    converter read them into an fp32 model and wrote an fp32 adapter. Reference: the run's adapter path
    (`write_adapter` of the held state dict), read back by safetensors."""
    from safetensors.torch import load_file

    lora = LoRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    model = load_hf_model(run.base, dtype=torch.bfloat16)
    setup_lora(model, lora, model.hf_config)
    wrapper = _Wrapper(model)
    opt = torch.optim.AdamW([p for p in wrapper.parameters() if p.requires_grad], lr=1e-3)
    layout = run_layout(NS(model=NS(path=str(run.base)), lora=lora, train=NS(train_layers=[])),
                        model_type=model.hf_config["model_type"], world_size=1, mcore_tp=None, mcore_ep=None)
    CheckpointManager(tmp_path / "run", keep_last=0, rank=0).save(1, wrapper, opt, {"data": {}}, layout=layout)
    (tmp_path / "run" / "config.toml").write_text(f'[model]\npath = "{run.base}"\ndtype = "bfloat16"\n'
                                                  '[lora]\nr = 4\nalpha = 8.0\ntarget_modules = ["q_proj", "v_proj"]\n')
    write_adapter(tmp_path / "own", model.state_dict(), model.hf_config, lora, base_model_name_or_path=str(run.base))
    code, err = _convert(["--checkpoint", tmp_path / "run" / "checkpoints" / "step_1", "--out", tmp_path / "ad"], capsys)
    assert code == 0, err
    own = load_file(tmp_path / "own" / "adapter_model.safetensors")
    conv = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    assert {t.dtype for t in own.values()} == {torch.bfloat16}
    assert own.keys() == conv.keys() and all(conv[k].dtype == own[k].dtype and torch.equal(own[k], conv[k]) for k in own)


def test_the_settings_recorded_with_the_checkpoint_win_over_a_rewritten_config_toml(run, tmp_path, capsys):
    """The converter read the export dtype, model.dtype and pixel limits from the run folder's config.toml, which a
    later job in that folder rewrites: a checkpoint then converted to another dtype / limits than its run exported.
    They are now recorded in its layout.json at save; config.toml is the fallback for older records."""
    import shutil

    folder = tmp_path / "run"
    model = load_hf_model(run.base)
    wrapper = _Wrapper(model)
    cfg = NS(model=NS(path=str(run.base), dtype="float32"), lora=None, train=NS(train_layers=[]),
             checkpoint=NS(export_dtype="bfloat16"), data=NS(min_pixels=None, max_pixels=28 * 28 * 64,
                                                            video_min_pixels=None, video_max_pixels=None))
    layout = run_layout(cfg, model_type=model.hf_config["model_type"], world_size=1, mcore_tp=None, mcore_ep=None)
    CheckpointManager(folder, keep_last=0, rank=0).save(1, wrapper, torch.optim.AdamW(wrapper.parameters()),
                                                         {"data": {}}, layout=layout)
    # a later job in the same folder with other settings
    (folder / "config.toml").write_text(f'[model]\npath = "{run.base}"\n[checkpoint]\nexport_dtype = "float32"\n'
                                        f'[data]\nmax_pixels = {28 * 28 * 16}\n')
    code, err = _convert(["--checkpoint", folder / "checkpoints" / "step_1", "--out", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert _dtypes(tmp_path / "hf") == {"BF16"}
    pre = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert pre["size"]["longest_edge"] == 28 * 28 * 64
    shutil.rmtree(tmp_path / "hf")
