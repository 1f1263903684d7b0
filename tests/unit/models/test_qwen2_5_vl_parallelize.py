"""parallelize_qwen2_5_vl on one device: activation checkpointing of every transformer block keeps the
loss and the gradients, and parameter names (hence checkpoints / exports) are unchanged."""
import torch

from megatron_vlm.config.sections import ParallelConfig
from megatron_vlm.models import build_model
from megatron_vlm.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl
from tests.fixtures import tiny_qwen2_5_vl as F


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    logits = model(batch["input_ids"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], batch["input_ids"][0, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_keeps_loss_and_grads():
    torch.manual_seed(0)
    model = build_model(F.tiny_qwen2_5_vl_config_dict(text_layers=2, vision_depth=2))
    g = torch.Generator().manual_seed(1)
    batch = F.batch_samples([F.build_sample([3, ("image", (1, 4, 8)), 5], g)])
    names = [n for n, _ in model.named_parameters()]
    loss, grads = _loss_and_grads(model, batch)
    out = parallelize_qwen2_5_vl(model, None, ParallelConfig(), activation_checkpointing=True)
    assert out is model and [n for n, _ in model.named_parameters()] == names
    assert all(getattr(b, "_mvlm_ac", False) for b in model.transformer_blocks())
    loss_ac, grads_ac = _loss_and_grads(model, batch)
    assert torch.allclose(loss, loss_ac, atol=1e-6)
    for n in names:
        assert torch.allclose(grads[n], grads_ac[n], atol=1e-6), n
