"""Selective activation checkpointing: same loss and gradients as no checkpointing, fewer tensors kept.

The policy keeps matmul / attention outputs and recomputes the ops between them; a wrong policy (an op
recomputed with different inputs, a mutation replayed twice) shows up as a gradient difference.
"""
import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.parallel import apply_ac
from megatron_vlm.testing.tiny_model import tiny_qwen2_5_vl_hf_config

TOKENS = {"vocab_size": 256, "eos_token_id": 1, "image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252,
          "vision_end_token_id": 253}


def tiny_qwen2_5_vl_config():
    return tiny_qwen2_5_vl_hf_config(TOKENS)


def _loss_and_grads(policy):
    torch.manual_seed(0)
    model = build_model(tiny_qwen2_5_vl_config(), dtype=torch.float32, device="cpu")
    if policy is not None:
        apply_ac(model.transformer_blocks(), policy=policy)
    ids = torch.randint(10, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointing_keeps_loss_and_gradients(policy):
    ref_loss, ref = _loss_and_grads(None)
    loss, grads = _loss_and_grads(policy)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref.keys() and grads
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-6, atol=1e-7, msg=n)


def test_selective_recomputes_no_matmul_full_recomputes_all():
    """Matmul calls over forward + backward: selective == none (their outputs are kept), full > none (re-run)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                self.n += 1
            return func(*args, **(kwargs or {}))

    def matmuls(policy):
        torch.manual_seed(0)
        model = build_model(tiny_qwen2_5_vl_config(), dtype=torch.float32, device="cpu")
        if policy is not None:
            apply_ac(model.transformer_blocks(), policy=policy)
        ids = torch.randint(10, 200, (2, 24), generator=torch.Generator().manual_seed(1))
        with CountMatmuls() as counter:
            model(ids).float().logsumexp(-1).mean().backward()
        return counter.n

    none, sel, full = matmuls(None), matmuls("selective"), matmuls("full")
    assert sel == none < full, (none, sel, full)


def test_unknown_policy_is_refused():
    model = build_model(tiny_qwen2_5_vl_config(), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="selective"):
        apply_ac(model.transformer_blocks(), policy="some")


def _attention_forward_calls(backend, policy):
    """Attention forward-op calls over forward + backward of a checkpointed `attention(...) @ w`."""
    import functools

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from megatron_vlm.kernels import attention, use_backends
    from megatron_vlm.parallel.apply import _selective_policy

    names = {"aten._scaled_dot_product_flash_attention_for_cpu", "megatron_vlm.varlen_attention_fwd"}

    class CountAttention(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func._schema.name.replace("::", ".") in names
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, 4, 16, generator=g, requires_grad=True) for _ in range(3))
    w = torch.randn(16, 16, generator=g, requires_grad=True)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)

    def block(q, k, v, w):
        return (attention(q, k, v, causal=True, cu_seqlens_q=cu, max_seqlen_q=13) @ w).tanh()

    with use_backends({"attention": backend}), CountAttention() as counter:
        if policy is None:
            out = block(q, k, v, w)
        else:
            ctx = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            out = checkpoint(block, q, k, v, w, use_reentrant=False, context_fn=ctx)
        out.square().sum().backward()
    return counter.n


@pytest.mark.parametrize("backend", ["sdpa", "csrc"])
def test_selective_keeps_attention_output_of_each_backend(backend):
    """Under "selective" an attention backend's forward runs once, as without checkpointing (not re-run in
    backward): a backend whose op the policy does not list pays its forward twice per step."""
    from megatron_vlm import _ext

    if backend == "csrc" and _ext.load() is None:
        pytest.skip("megatron_vlm._C not built here")
    none = _attention_forward_calls(backend, None)
    assert none >= 1, f"the {backend} backend ran no attention op this test counts"
    assert _attention_forward_calls(backend, "selective") == none


@pytest.mark.parametrize("op", ["torch_attn::_varlen_attn", "flash_attn::_flash_attn_varlen_forward",
                                "megatron_vlm::triton_attention_fwd", "aten::_scaled_dot_product_flash_attention"])
def test_selective_policy_saves_cuda_attention_ops(op):
    """The CUDA-only attention ops (not runnable here) are kept by name, overloads included."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from megatron_vlm.parallel.apply import _selective_policy

    fake = SimpleNamespace(_schema=SimpleNamespace(name=op))
    assert _selective_policy(None, fake) is CheckpointPolicy.MUST_SAVE
    assert _selective_policy(None, SimpleNamespace(_schema=SimpleNamespace(name="aten::_softmax"))) \
        is CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_policy_saves_the_registered_attention_ops():
    """The attention ops registered here (torch's varlen op where this torch has it, SDPA's kernels, flash-attn's
    where installed), resolved from `torch.ops` rather than spelled in the test: a renamed op is caught, where the
    name test above only repeats the list."""
    import importlib

    from torch.utils.checkpoint import CheckpointPolicy

    from megatron_vlm.parallel.apply import SELECTIVE_SAVE_OPS, _selective_policy

    registered = {"aten"}
    for namespace, module in (("torch_attn", "torch.nn.attention.varlen"), ("flash_attn", "flash_attn.flash_attn_interface")):
        try:
            importlib.import_module(module)  # registers the namespace's custom ops
            registered.add(namespace)
        except Exception:  # noqa: BLE001 -- absent or unbuildable here: its ops are checked where it imports
            pass
    checked = set()
    for name in SELECTIVE_SAVE_OPS:
        namespace, op = name.split(".", 1)
        if namespace not in registered:
            continue
        packet = getattr(getattr(torch.ops, namespace), op, None)
        assert packet is not None, f"{name}: no such op in this torch / {namespace}"
        for overload in packet.overloads():
            assert _selective_policy(None, getattr(packet, overload)) is CheckpointPolicy.MUST_SAVE, (name, overload)
        checked.add(name)
    assert {"aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention"} <= checked
