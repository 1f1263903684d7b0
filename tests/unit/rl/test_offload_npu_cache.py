"""Moving an offloaded model (the reference policy, a reward model) back to the CPU empties the device
cache on an NPU as on CUDA: a fake `torch.npu` (torch_npu's documented `empty_cache`) counts the calls."""
from __future__ import annotations

import types

import torch

from megatron_vlm.rl.reference import ReferencePolicy
from megatron_vlm.rl.rewards.model_reward import on_device


class _Model:
    """Records where it was moved (a real module cannot move to an NPU on this machine)."""

    def __init__(self):
        self.moves: list[str] = []

    def to(self, device):
        self.moves.append(str(getattr(device, "type", device)))
        return self


def _fake_npu(monkeypatch) -> dict:
    calls = {"empty_cache": 0}
    fake = types.SimpleNamespace(is_available=lambda: True,
                                 empty_cache=lambda: calls.update(empty_cache=calls["empty_cache"] + 1))
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    return calls


NPU = types.SimpleNamespace(type="npu")


def test_reference_offload_empties_npu_cache(monkeypatch):
    calls = _fake_npu(monkeypatch)
    ref = ReferencePolicy.__new__(ReferencePolicy)
    ref.scorer, ref.device, ref._on_device = _Model(), NPU, False
    with ref.on_device():
        assert ref._on_device
    assert ref.scorer.moves == ["npu", "cpu"]
    assert calls["empty_cache"] == 1


def test_reward_model_offload_empties_npu_cache(monkeypatch):
    calls = _fake_npu(monkeypatch)
    model = _Model()
    with on_device(model, NPU, offload=True):
        pass
    assert model.moves == ["npu", "cpu"] and calls["empty_cache"] == 1
    with on_device(model, NPU, offload=False):  # not offloaded: stays, nothing emptied
        pass
    assert calls["empty_cache"] == 1


def test_rollout_engine_release_memory_empties_npu_cache(monkeypatch):
    """The built-in engine gives its caches back to the training step on an NPU too (it emptied CUDA's only)."""
    from megatron_vlm.inference.policy_engine import PolicyRolloutEngine

    calls = _fake_npu(monkeypatch)
    engine = PolicyRolloutEngine.__new__(PolicyRolloutEngine)
    engine.device, engine._packs = NPU, {}
    monkeypatch.setattr(engine, "_drop_runner", lambda: None, raising=False)
    engine.release_memory()
    assert calls["empty_cache"] == 1
    engine.device = torch.device("cpu")
    engine.release_memory()  # the CPU: nothing to give back
    assert calls["empty_cache"] == 1
