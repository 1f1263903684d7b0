"""The layout record of a checkpoint (checkpoint/layout.py), in one process with a tiny model: the manager writes it
only when given one; another model family is refused naming model.path and both model types; settings whose
change loads fine today (lora.alpha, the parallel sizes) are not refused; the megatron-core tp recorded in it is
checked before any shard is read; an unreadable record counts as a corrupt checkpoint (auto falls back past it).
The refusals of real jobs: tests/integration/test_resume_layout_job.py."""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_vlm.checkpoint.layout import (
    LAYOUT_FILE,
    checkpoint_adapters,
    checkpoint_trained,
    layout_refusals,
    read_layout,
    run_adapters,
    run_layout,
)
from megatron_vlm.checkpoint.manager import CheckpointManager
from tests.unit.checkpoint.test_checkpoint_faults import _checkpointer, _ckdir, _save


def _cfg(path="/m/qwen", backend="native", lora=None, **sizes):
    return NS(model=NS(path=path), parallel=NS(backend=backend, **{"tp": 1, "cp": 1, "ep": 1, "pp": 1, **sizes}),
              lora=lora)


def _lora(**kw):
    return NS(**{"r": 4, "alpha": 8.0, "use_rslora": False, "target_modules": [], "include_vision": False, **kw})


def _layout(cfg, model_type="qwen2_5_vl", world_size=2):
    return run_layout(cfg, model_type=model_type, world_size=world_size, mcore_tp=None, mcore_ep=None)


def test_manager_writes_the_record_only_when_given(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(tmp_path, keep_last=0, rank=0)
    layout = _layout(_cfg(lora=_lora()))
    with_record, without = mgr.save(2, model, opt, {}, layout=layout), mgr.save(4, model, opt, {})
    assert read_layout(with_record) == layout and read_layout(without) is None
    (with_record / LAYOUT_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable layout record"):
        read_layout(with_record)


def test_another_model_family_is_refused_naming_model_path():
    saved = _layout(_cfg(path="/m/qwen"), model_type="qwen2_5_vl")
    now = _layout(_cfg(path="/m/internvl"), model_type="internvl")
    [msg] = layout_refusals(saved, now, Path("/runs/a/checkpoints/step_2"))
    assert msg.startswith("model.path: /runs/a/checkpoints/step_2 was written for a \"qwen2_5_vl\" model")
    assert '(model.path = "/m/qwen")' in msg and '("/m/internvl") is a "internvl" model' in msg
    # another folder of the same family (e.g. the run's own export) is not refused
    assert layout_refusals(saved, _layout(_cfg(path="/runs/a/hf")), Path("x")) == []


def test_what_loads_today_is_not_refused():
    """Other data-parallel / native tp / cp / pp sizes (DCP reshards) and another lora.alpha or use_rslora."""
    saved = _layout(_cfg(lora=_lora()), world_size=4)
    now = _layout(_cfg(lora=_lora(alpha=32.0, use_rslora=True), tp=2, cp=2, pp=2), world_size=8)
    assert layout_refusals(saved, now, Path("x")) == []


def test_several_differences_are_all_named():
    saved, now = _layout(_cfg()), _layout(_cfg(backend="mcore", lora=_lora()))
    msgs = layout_refusals(saved, now, Path("x"))
    assert [m.split(":")[0] for m in msgs] == ["parallel.backend", "lora"]


def test_adapted_and_trained_names_from_checkpoint_metadata_and_state_dict():
    meta = ["model.model.layers.0.q_proj.lora_A.weight", "model.model.layers.0.q_proj.lora_B.weight",
            "model.model.layers.0.q_proj.weight", "optim.state.model.layers.0.q_proj.lora_A.weight.exp_avg"]
    assert checkpoint_adapters(meta) == {"model.layers.0.q_proj"}
    assert run_adapters(["model.layers.0.q_proj.lora_A.weight", "model.layers.0.q_proj.weight"]) == {"model.layers.0.q_proj"}
    assert checkpoint_trained(meta + ["optim.state.model.norm.weight.step", "optim.param_groups.model.norm.weight.lr"]) == {
        "model.layers.0.q_proj.lora_A.weight", "model.norm.weight"}


def test_recorded_mcore_tp_is_checked_before_the_shards(tmp_path, capsys, monkeypatch):
    ck = _checkpointer(tmp_path)
    ck.layout = {**ck.layout, "parallel.backend": "mcore", "mcore_tp": 2, "mcore_ep": 1}
    _save(ck, 2)
    resumed = _checkpointer(tmp_path, seed=1)
    resumed.layout = {**copy.deepcopy(ck.layout), "mcore_tp": 1}
    resumed.mcore_tp, resumed.mcore_ep = 1, 1
    monkeypatch.setattr(resumed.manager, "load", lambda *a: pytest.fail("loaded the shards of a refused checkpoint"))
    with pytest.raises(SystemExit) as e:
        resumed.resume()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "saved with parallel.tp = 2" in err and "(now 1)" in err, err


def test_unreadable_record_falls_back_like_a_corrupt_checkpoint(tmp_path, caplog):
    ck = _checkpointer(tmp_path)
    _save(ck, 2)
    _save(ck, 4)
    step4 = _ckdir(tmp_path) / "step_4"
    (step4 / LAYOUT_FILE).write_text("[]")
    resumed = _checkpointer(tmp_path, seed=1)
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        point = resumed.resume()
    assert point.step == 2 and torch.all(resumed.wrapper.weight == 2.0)
    assert f"cannot load checkpoint {step4}" in caplog.text and "not a layout record" in caplog.text


@pytest.mark.parametrize("saved_mode, now_mode", [("sft", "dpo"), ("dpo", "reward"), ("reward", "dpo"), ("sft", "grpo")])
def test_a_checkpoint_of_another_train_mode_is_refused_naming_train_mode(saved_mode, now_mode):
    """A checkpoint continues the run that wrote it: an SFT checkpoint resumed by a DPO run of the same data size
    loaded (its pack position taken for the pairs', its step count kept) while the DPO reference came from
    model.path, not from the weights the policy resumed with."""
    def cfg(mode):
        c = _cfg()
        c.train = NS(mode=mode, train_layers=[])
        return c

    ckpt = Path("/runs/a/checkpoints/step_2")
    [msg] = layout_refusals(_layout(cfg(saved_mode)), _layout(cfg(now_mode)), ckpt)
    assert msg.startswith(f'train.mode: {ckpt} was written by a train.mode = "{saved_mode}" run'), msg
    assert "convert_checkpoint.py" in msg
    assert layout_refusals(_layout(cfg(now_mode)), _layout(cfg(now_mode)), ckpt) == []
    older = _layout(cfg(saved_mode))
    del older["train.mode"]  # a record written before the mode was: loads as before
    assert layout_refusals(older, _layout(cfg(now_mode)), ckpt) == []
