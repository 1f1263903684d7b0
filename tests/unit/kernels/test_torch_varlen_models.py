"""Whole tiny models on the `torch_varlen` attention backend (torch's `varlen_attn`, `auto` on CUDA) against the
reference backend: log-probs and every gradient of packed training forwards equal (fp64).

torch's kernel runs on CUDA only, so here its own custom op `torch_attn::_varlen_attn` (and its backward op) get a
CPU kernel that computes what flash-attn's varlen kernel documents (per-sequence softmax attention over separate
query / key `cu_seqlens`, bottom-right aligned, `window_size=(left, right)` with `is_causal` capping the right side at
0, GQA: query head h reads key head h // (Hq / Hkv)) from plain torch ops. Everything above it is torch's: the
public `varlen_attn` function, the op's autograd formula and its name, which selective activation checkpointing
matches (parallel/apply.py SELECTIVE_SAVE_OPS). Calls the backend hands to another kernel (the prompt-shared packs'
separate key lengths, InternViT's batched tiles) run our Triton kernel, as on CUDA (here interpreted: float32 dot
products, so those cases compare to float32 rounding).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm.checkpoint.hf import load_hf_model
from megatron_vlm.kernels import registry as kernel_registry
from megatron_vlm.kernels import use_backends
from megatron_vlm.kernels.torch_fused import varlen_attention as backend
from megatron_vlm.training.lm_loss import TokenLogprobModel

varlen = pytest.importorskip("torch.nn.attention.varlen")

_CALLS = {"fwd": 0, "bwd": 0}


def _pieces(query, key, value, cu_q, cu_k, is_causal, scale, window_size):
    """Per sequence: (query rows, key rows, scale, P [H, Sq, Sk], v [Sk, H, D] with kv heads repeated)."""
    left, right = (-1, -1) if window_size is None else window_size
    if is_causal:
        right = 0
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        sq, sk = b - a, d - c
        s = torch.einsum("qhd,khd->hqk", query[a:b], key[c:d]) * scale
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if right >= 0:
            keep &= j <= i + right
        if left >= 0:
            keep &= j >= i - left
        s = s.masked_fill(~keep, float("-inf"))
        yield (a, b), (c, d), scale, s, torch.softmax(s, -1).nan_to_num(0.0), key[c:d], value[c:d]


def _forward_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                    window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch_attn::_varlen_attn on the CPU: (out, lse [H, Tq], rng state)."""
    _CALLS["fwd"] += 1
    assert enable_gqa or key.shape[1] == query.shape[1], "GQA without enable_gqa"
    assert seqused_k is None and block_table is None
    # the kernel sizes its grid from the hints: rows past them would be left unwritten
    assert max_q >= int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k >= int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
    out, lse = torch.zeros_like(query), query.new_zeros(query.shape[1], query.shape[0])
    for (a, b), _, _, s, p, _, v in _pieces(query, key, value, cu_seq_q, cu_seq_k, is_causal, scale, window_size):
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v)
        lse[:, a:b] = torch.logsumexp(s, -1)
    return out, lse.float(), torch.zeros(2, dtype=torch.uint64)


def _backward_kernel(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                     scale=None, window_size=None):
    """torch_attn::_varlen_attn_backward on the CPU: the softmax-attention gradients (kv heads summed over their
    query groups), written out, since the kernel runs below autograd."""
    _CALLS["bwd"] += 1
    rep = query.shape[1] // key.shape[1]
    dq = torch.zeros_like(query)
    dk_full = query.new_zeros(key.shape[0], query.shape[1], key.shape[2])
    dv_full = torch.zeros_like(dk_full)
    for (a, b), (c, d), sc, _, p, k, v in _pieces(query, key, value, cu_seq_q, cu_seq_k, is_causal, scale,
                                                   window_size):
        do = grad_out[a:b]
        dv_full[c:d] = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, v)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, k) * sc
        dk_full[c:d] = torch.einsum("hqk,qhd->khd", ds, query[a:b]) * sc
    fold = lambda t: t.unflatten(1, (key.shape[1], rep)).sum(2)  # noqa: E731
    return dq, fold(dk_full), fold(dv_full)


def _default_cpu(op):
    def run(*args, **kwargs):  # what the op did on the CPU before: its device-generic implementation
        return op._backend_fns[None](*args, **kwargs)
    return run


@pytest.fixture
def cpu_varlen(monkeypatch):
    """torch's varlen ops with the CPU kernels above; the backend allowed on the CPU in fp64; counters reset."""
    for op, kernel in ((varlen._varlen_attn, _forward_kernel), (varlen._varlen_attn_backward, _backward_kernel)):
        if "cpu" not in op._backend_fns:
            op.register_kernel("cpu")(_default_cpu(op))  # once per process; the test swaps the function
        monkeypatch.setitem(op._backend_fns, "cpu", kernel)
    monkeypatch.setattr(backend, "check", lambda device_type, dtype: None)
    reg = kernel_registry.DEFAULT_REGISTRY
    monkeypatch.setitem(reg.backends["attention"], "torch_varlen",
                        dataclasses.replace(reg.backends["attention"]["torch_varlen"], check=None))
    backend._found.clear()
    reg.clear_cache()
    _CALLS.update(fwd=0, bwd=0)
    yield _CALLS
    monkeypatch.undo()
    backend._found.clear()
    reg.clear_cache()


def test_the_cpu_kernel_is_torch_varlen_attn(cpu_varlen):
    """The adapter reaches torch's own function and op (not a stand-in of the function): GQA, causal."""
    fn, params = backend._varlen()
    assert fn is varlen.varlen_attn and "window_size" in params
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q = torch.randn(15, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(15, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    from megatron_vlm.kernels.reference.attention import attention as reference

    for causal in (True, False):
        got = backend.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        exp = reference(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        torch.testing.assert_close(got, exp, atol=1e-12, rtol=0)
        up = torch.randn(got.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), up), torch.autograd.grad(exp, (q, k, v), up)):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert cpu_varlen == {"fwd": 2, "bwd": 2}


def _prompts(folder, tmp_path):
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa
    from megatron_vlm.rl.prompts.dataset import load_prompt_dataset
    from megatron_vlm.rl.prompts.encoder import PromptEncoder

    vqa = write_synthetic_vqa(tmp_path / "vqa", 2, 2, seed=0)["eval"]
    encoder = PromptEncoder(load_processor(str(folder)), max_frames=4, fps=2.0, max_new_tokens=5, max_tokens=4096)
    prompts = [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]
    assert all(p is not None and p.pixel_values is not None for p in prompts)
    return prompts


def _samples(prompts, vocab, group, seed=0):
    from megatron_vlm.rl.batching import TrainSample, group_by_prompt

    g = torch.Generator().manual_seed(seed)
    out = []
    for p in prompts:
        for _ in range(group):
            n = int(torch.randint(2, 6, (1,), generator=g))
            out.append(TrainSample(prompt=p, response_ids=torch.randint(0, vocab, (n,), generator=g),
                                   behav_logp=torch.zeros(n), advantage=0.0))
    return group_by_prompt(out)


def _logp_and_grads(model, batch, weights):
    model.zero_grad(set_to_none=True)
    logp = TokenLogprobModel(model).train()({k: v for k, v in batch.items() if k != "num_response_tokens"})
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(a, b, *, fp32: bool = False):
    """Equal in fp64; `fp32`: the gradients to float32 rounding, where calls fell back to our Triton kernel (here
    interpreted, with float32 dot products); a wrong mapping (causal, GQA pairing, lengths) is off by O(1)."""
    torch.testing.assert_close(a[0], b[0], atol=1e-6 if fp32 else 1e-10, rtol=0)
    assert a[1].keys() == b[1].keys() and len(b[1]) > 10
    for name in b[1]:
        scale = float(b[1][name].abs().max())
        atol, rtol = (1e-5 * scale + 1e-12, 1e-4) if fp32 else (1e-10, 1e-8)
        torch.testing.assert_close(a[1][name], b[1][name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind,share", [("tiny_qwen2_5_vl", False), ("tiny_qwen2_5_vl", True),
                                        ("tiny_internvl", False), ("tiny_nemotron_vl", False)])
def test_grpo_packs_equal_the_reference_backend(cpu_varlen, tmp_path, kind, share):
    """A GRPO update's packed forward and backward (images, the vision tower's full and windowed attention, GQA
    decoders; InternViT's batched tiles; `share`: the prompt-shared pack, whose decoder calls take separate key
    lengths) on torch_varlen against the reference backend."""
    from megatron_vlm.rl.batching import pack_samples
    from megatron_vlm.testing.synthesize import synthesize_model_folder

    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    model = load_hf_model(str(folder), dtype=torch.float64)
    vocab = model.lm_head.weight.shape[0]
    batch = pack_samples(_samples(_prompts(folder, tmp_path), vocab, group=2), share_prompts=share)
    assert ("prefix_segments" in batch) == share
    weights = torch.randn(batch["num_response_tokens"], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with use_backends({"attention": "torch"}):
        ref = _logp_and_grads(model, batch, weights)
    with use_backends({"attention": "torch_varlen"}):
        got = _logp_and_grads(model, batch, weights)
    _same(got, ref, fp32=share or kind == "tiny_internvl")  # InternViT's batched tiles: our kernel
    assert cpu_varlen["fwd"] > 0 and cpu_varlen["bwd"] == cpu_varlen["fwd"]


def test_dpo_pair_packs_equal_the_reference_backend(cpu_varlen, tmp_path):
    """DPO's pair packs, plain and with each prompt shared by its chosen and rejected answers
    (training/pair_prompts.py): the pair log-prob sums and the gradients of the loss."""
    from megatron_vlm.testing.synthesize import synthesize_model_folder
    from megatron_vlm.training.dpo.losses import sigmoid_loss
    from megatron_vlm.training.dpo.sequence import pair_sums
    from megatron_vlm.training.pair_prompts import share_pair_prompts
    from tests.unit.training.test_pair_prompts import _pack, _random_pairs

    folder = synthesize_model_folder("tiny_qwen2", tmp_path / "q", seed=0)
    model = TokenLogprobModel(load_hf_model(str(folder), dtype=torch.float64, device="cpu")).train()
    plain = _pack(_random_pairs(3, seed=1))
    for pack in (plain, share_pair_prompts(plain)):
        results = []
        for name in ("torch", "torch_varlen"):
            with use_backends({"attention": name}):
                model.zero_grad(set_to_none=True)
                c, r, n_c, n_r = pair_sums(model(pack), pack)
                sigmoid_loss(c, r, c.detach() + 0.3, r.detach() - 0.2, n_c, n_r, beta=0.1).mean().backward()
                results.append((torch.cat([c.detach(), r.detach()]),
                                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        _same(results[1], results[0], fp32="prefix_segments" in pack)
    assert cpu_varlen["fwd"] > 0


def test_selective_checkpointing_keeps_the_varlen_output(cpu_varlen):
    """parallel/apply.py "selective": the op's output is kept (its name is in SELECTIVE_SAVE_OPS), so backward
    runs no second forward of the kernel; "full" re-runs it once per block (the control)."""
    from megatron_vlm.models import build_model
    from megatron_vlm.parallel.apply import apply_ac
    from megatron_vlm.testing.tiny_text_model import tiny_qwen_text_hf_config

    x = torch.randint(10, 200, (1, 17), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 6, 17], dtype=torch.int32)
    forwards = {}
    for policy in ("selective", "full"):
        torch.manual_seed(0)
        model = build_model(tiny_qwen_text_hf_config("qwen3")).double()
        layers = model.model.layers if hasattr(model, "model") else model.language_model.layers
        apply_ac(layers, policy)
        with use_backends({"attention": "torch_varlen"}):
            out = model(x, cu_seqlens=cu)
            before = cpu_varlen["fwd"]
            assert before == len(layers)
            out.pow(2).mean().backward()
        forwards[policy] = cpu_varlen["fwd"] - before
        cpu_varlen.update(fwd=0, bwd=0)
    assert forwards == {"selective": 0, "full": len(layers)}
