"""The checkpoint's RNG state covers the NPU generator: a fake `torch.npu` (the attributes torch_npu's
Random-Number-Generator API documents: is_available, get_rng_state, set_rng_state) stands in for torch_npu."""
import types

import torch

from megatron_vlm.checkpoint.manager import rng_state, set_rng_state


def test_npu_rng_state_is_saved_and_restored(monkeypatch):
    device_state = {"value": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    fake = types.SimpleNamespace(
        is_available=lambda: True,
        get_rng_state=lambda device="npu": device_state["value"].clone(),
        set_rng_state=lambda new_state, device="npu": device_state.update(value=new_state.clone()),
    )
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    saved = rng_state()
    device_state["value"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # draws after the checkpoint
    set_rng_state(saved)
    assert device_state["value"].tolist() == [1, 2, 3]
