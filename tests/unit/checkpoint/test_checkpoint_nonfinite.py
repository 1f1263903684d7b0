"""Non-finite weights are corruption: a checkpoint whose shard bytes decode to NaN / 3.4e38-overflowing
values is not loaded (resume falls back to the previous complete one), a model holding NaN is never
saved (the save fails, the previous checkpoint stays and is not pruned) and never exported (the previous
export stays), and a PEFT adapter with a NaN factor is refused when read."""
from __future__ import annotations

import logging
import struct

import pytest
import torch

from megatron_vlm.checkpoint.hf import save_hf_model
from megatron_vlm.finite import NonFiniteError, nonfinite_tensors
from megatron_vlm.models import build_model
from tests.fixtures import tiny_qwen2_5_vl as F
from tests.unit.checkpoint.test_checkpoint_faults import _checkpointer, _ckdir, _save


def _flip(step_dir, value: float, to: bytes) -> None:
    """Overwrite the stored weight (filled with `value`) in the DCP shard with other bytes, as bit rot would."""
    pattern = struct.pack("<f", value) * 12  # Linear(4, 3).weight
    for f in step_dir.glob("*.distcp"):
        data = f.read_bytes()
        at = data.find(pattern)
        if at >= 0:
            f.write_bytes(data[:at] + to * 3 + data[at + 12:])
            return
    raise AssertionError("weight bytes not found in the shard")


@pytest.mark.parametrize("to", [struct.pack("<f", float("nan")), struct.pack("<f", float("inf"))], ids=["nan", "inf"])
def test_checkpoint_with_non_finite_weights_is_corrupt_and_falls_back(tmp_path, caplog, to):
    ck = _checkpointer(tmp_path)
    _save(ck, 2)
    _save(ck, 4)
    step4 = _ckdir(tmp_path) / "step_4"
    _flip(step4, 4.0, to)
    resumed = _checkpointer(tmp_path, seed=1)
    with caplog.at_level(logging.INFO, logger="megatron_vlm"):
        point = resumed.resume()
    assert point.step == 2 and torch.all(resumed.wrapper.weight == 2.0)
    assert f"cannot load checkpoint {step4}" in caplog.text and "non-finite" in caplog.text


def test_non_finite_weights_are_never_saved_and_the_previous_checkpoint_is_kept(tmp_path, capsys):
    ck = _checkpointer(tmp_path, keep_last=1)
    _save(ck, 2)
    with torch.no_grad():
        ck.wrapper.weight[0, 0] = float("nan")
    with pytest.raises(SystemExit) as e:
        ck.save(4, {"pos": 4})
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "refusing to save step_4" in err and "non-finite" in err and "weight" in err
    assert sorted(p.name for p in _ckdir(tmp_path).iterdir()) == ["step_2"]  # not pruned, nothing half-written


def test_non_finite_weights_are_never_exported(tmp_path):
    torch.manual_seed(0)
    model = build_model(F.tiny_qwen2_5_vl_config_dict())
    out = tmp_path / "hf"
    save_hf_model(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("inf")
    with pytest.raises(NonFiniteError, match="refusing to export"):
        save_hf_model(model, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_nonfinite_tensors_names_nested_entries_and_ignores_integers():
    tree = {"a": torch.ones(2), "b": {"c": torch.tensor([1.0, float("nan")])}, "n": torch.tensor([3]), "s": [torch.tensor(-float("inf"))]}
    assert nonfinite_tensors(tree) == ["b.c", "s.0"]
