"""parallel/master_weights.py without a GPU: where `place_unsharded` (training/model_bundle.py) puts the weights of
a model without FSDP2 units in bf16, the copies to the accelerator recorded instead of made."""
from __future__ import annotations

import torch
from torch import nn

from megatron_vlm.training.model_bundle import place_unsharded


def _is_cuda(x) -> bool:
    return isinstance(x, (torch.device, str)) and torch.device(x).type == "cuda"


def test_frozen_weights_reach_the_device_in_bf16_only(monkeypatch):
    """A frozen parameter never trains: its fp32 weight stays in host memory (for checkpoints and exports) and the
    device gets its bf16 weight only. Moving the fp32 model to the device first held every frozen weight there in
    fp32 as well (a LoRA run's whole base model: twice the bf16 weights `--check` counts)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    frozen_host = {p.data_ptr() for p in model[0].parameters()}
    moved: list[tuple[torch.dtype, bool]] = []  # each tensor copied to the device: (its dtype there, a frozen weight)
    to = torch.Tensor.to

    def recorded(self, *args, **kwargs):
        """Tensor.to with the copy to the GPU recorded, the tensor left in host memory."""
        if not (any(_is_cuda(a) for a in args) or _is_cuda(kwargs.get("device"))):
            return to(self, *args, **kwargs)
        out = to(self, *[None if _is_cuda(a) else a for a in args],
                 **{k: None if k == "device" else v for k, v in kwargs.items()})
        moved.append((out.dtype, self.data_ptr() in frozen_host))
        return out

    monkeypatch.setattr(torch.Tensor, "to", recorded)
    masters = place_unsharded(model, torch.device("cuda"), "bf16")
    monkeypatch.undo()
    assert masters is not None and len(masters.params) == 2
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ((_, host, low),) = [f for f in masters.frozen if f[0] is model[0].weight]
    assert host.dtype == torch.float32 and torch.equal(host, frozen) and low.dtype == torch.bfloat16
    assert (torch.bfloat16, True) in moved and (torch.float32, True) not in moved, moved
    assert (torch.float32, False) in moved  # the trainable ones' masters: fp32 on the device
