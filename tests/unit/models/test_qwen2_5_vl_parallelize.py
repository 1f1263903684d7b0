"""parallelize_qwen2_5_vl on one device: activation checkpointing of every transformer block keeps the
loss and the gradients, and parameter names (hence checkpoints / exports) are unchanged."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _CountOps(TorchDispatchMode):
    """Counts the aten ops that reach the kernels (selective checkpointing's kept outputs do not)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _counted(model, batch):
    with _CountOps() as ops:
        loss, grads = _loss_and_grads(model, batch)
    return loss, grads, ops.counts


def test_selective_checkpointing_keeps_loss_grads_and_recomputes_no_matmul():
    """train.activation_checkpointing = "selective": the same loss and gradients as no checkpointing; backward
    re-runs the cheap ops (more elementwise ops than without checkpointing) but no matmul and no attention,
    which whole-block checkpointing ("full") re-runs."""
    counts, results = {}, {}
    g = torch.Generator().manual_seed(1)
    batch = F.batch_samples([F.build_sample([3, ("image", (1, 4, 8)), 5, ("image", (1, 8, 4)), 2], g)])
    for policy in (False, "selective", "full"):
        torch.manual_seed(0)
        model = build_model(F.tiny_qwen2_5_vl_config_dict(text_layers=2, vision_depth=2))
        parallelize_qwen2_5_vl(model, None, ParallelConfig(), activation_checkpointing=policy)
        *results[policy], counts[policy] = _counted(model, batch)
    for policy in ("selective", "full"):
        loss, grads = results[policy]
        assert torch.equal(loss, results[False][0]), policy
        for n, g_ref in results[False][1].items():
            assert torch.allclose(grads[n], g_ref, atol=1e-6, rtol=1e-5), (policy, n)
    matmuls = ("aten.mm", "aten.addmm")
    assert sum(counts["selective"][k] for k in matmuls) == sum(counts[False][k] for k in matmuls) > 0
    assert sum(counts["full"][k] for k in matmuls) > sum(counts[False][k] for k in matmuls)
    assert sum(counts["selective"].values()) > sum(counts[False].values())  # the cheap ops were recomputed


def test_activation_checkpointing_policy_names():
    with pytest.raises(ValueError, match="expected true, false, 'full' or 'selective'"):
        parallelize_qwen2_5_vl(build_model(F.tiny_qwen2_5_vl_config_dict(text_layers=1, vision_depth=2)), None,
                               ParallelConfig(), activation_checkpointing="partial")
