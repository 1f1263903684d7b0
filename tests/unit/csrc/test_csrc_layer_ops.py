"""The fused CPU layer ops of megatron_vlm._C (csrc/cpu_layer_ops.cpp via kernels/csrc/layer_ops.py) against
the torch references: values and gradients, every layout the wrappers accept, the fallbacks, row independence.

Ground truth: the references of kernels/reference/ evaluated in float64 (the C++ kernels run fp32), and the
references in fp32 for the expected fp32 rounding gap.
"""
import importlib

import pytest
import torch

from megatron_vlm import kernels
from megatron_vlm.kernels.registry import DEFAULT_REGISTRY, BackendUnavailableError

ref_norms = importlib.import_module("megatron_vlm.kernels.reference.norms")
ref_swiglu = importlib.import_module("megatron_vlm.kernels.reference.swiglu")
ref_rotary = importlib.import_module("megatron_vlm.kernels.reference.rotary")
ref_decode = importlib.import_module("megatron_vlm.kernels.reference.decode_attention")


@pytest.fixture
def ops(ext):
    return importlib.import_module("megatron_vlm.kernels.csrc.layer_ops")


def _grads(outputs, inputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    cot = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outputs]
    return torch.autograd.grad(outputs, inputs, cot)


def _leaf(t, dtype=torch.float32):
    return t.detach().to(dtype).requires_grad_()


def _close(a, b, rel=2e-6):
    scale = max(b.abs().max().item(), 1e-6)
    assert (a.double() - b.double()).abs().max().item() <= rel * scale, ((a.double() - b.double()).abs().max().item(), scale)


@pytest.mark.parametrize("shape", [(2206, 256), (3, 5, 64), (4, 33), (1, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_values_and_grads_match_float64_reference(ops, shape, with_residual):
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    got_in = [_leaf(x), _leaf(w)] + ([_leaf(r)] if with_residual else [])
    ref_in = [_leaf(t, torch.float64) for t in got_in]
    got = ops.rms_norm(got_in[0], got_in[1], 1e-6, residual=got_in[2] if with_residual else None)
    ref = ref_norms.rms_norm(ref_in[0], ref_in[1], 1e-6, residual=ref_in[2] if with_residual else None)
    for a, b in zip(got if with_residual else (got,), ref if with_residual else (ref,)):
        assert a.dtype == torch.float32 and a.shape == b.shape
        _close(a, b)
    for a, b in zip(_grads(got, got_in), _grads(ref, ref_in)):
        _close(a, b, rel=5e-6)


def test_rms_norm_gradient_of_the_sum_output_flows(ops):
    """The fused residual's second output (x + residual) feeds the next residual stream: its gradient must
    reach x and residual on top of the normalised output's."""
    g = torch.Generator().manual_seed(2)
    x, r, w = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g), torch.randn(16, generator=g)
    got_in, ref_in = [_leaf(x), _leaf(r), _leaf(w)], [_leaf(x, torch.float64), _leaf(r, torch.float64), _leaf(w, torch.float64)]
    out, summed = ops.rms_norm(got_in[0], got_in[2], 1e-5, residual=got_in[1])
    rout, rsummed = ref_norms.rms_norm(ref_in[0], ref_in[2], 1e-5, residual=ref_in[1])
    (summed * 3.0).sum().backward()
    (rsummed * 3.0).sum().backward()
    for a, b in zip(got_in[:2], ref_in[:2]):
        _close(a.grad, b.grad)
    assert got_in[2].grad is None or not got_in[2].grad.any()  # the normalised output was not used
    assert torch.equal(got_in[0].grad, torch.full_like(x, 3.0))  # only the sum was used: d/dx = 3 exactly


@pytest.mark.parametrize("shape", [(2206, 768), (64, 1, 768), (5, 13)])
def test_swiglu_values_and_grads_match_float64_reference(ops, shape):
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(shape, generator=g) * 4, torch.randn(shape, generator=g)
    got_in, ref_in = [_leaf(gate), _leaf(up)], [_leaf(gate, torch.float64), _leaf(up, torch.float64)]
    got, ref = ops.swiglu(*got_in), ref_swiglu.swiglu(*ref_in)
    _close(got, ref)
    for a, b in zip(_grads(got, got_in), _grads(ref, ref_in)):
        _close(a, b)


def test_swiglu_extreme_gates_stay_finite_and_accurate(ops):
    """The polynomial exp clamps its argument: silu(-100) ~ -4e-42 (not NaN / inf), silu(100) = 100."""
    gate = torch.tensor([-1e4, -100.0, -88.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.0, 88.5, 100.0, 1e4])
    got = ops.swiglu(gate, torch.ones_like(gate))
    ref = torch.nn.functional.silu(gate.double())
    assert torch.isfinite(got).all()
    assert ((got.double() - ref).abs() <= 1e-6 * ref.abs().clamp_min(1.0)).all(), (got, ref)
    gate_leaf = _leaf(gate)
    ops.swiglu(gate_leaf, torch.ones_like(gate)).sum().backward()
    assert torch.isfinite(gate_leaf.grad).all()


@pytest.mark.parametrize("x_shape,cos_shape", [
    ((2206, 4, 64), (2206, 64)),      # packed training input
    ((64, 1, 6, 64), (64, 1, 64)),    # a decode step: q and k heads side by side
    ((2, 5, 3, 32), (5, 32)),         # batched, cos shared across the batch
    ((2, 5, 3, 32), (2, 5, 32)),
])
def test_rotary_values_and_grads_match_float64_reference(ops, x_shape, cos_shape):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(x_shape, generator=g)
    # unequal halves on purpose: the contract rotates element i by cos[i] / sin[i], whatever the halves hold
    cos, sin = torch.randn(cos_shape, generator=g), torch.randn(cos_shape, generator=g)
    got_x, ref_x = _leaf(x), _leaf(x, torch.float64)
    got = ops.apply_rotary(got_x, cos, sin)
    ref = ref_rotary.apply_rotary(ref_x, cos.double(), sin.double())
    assert got.shape == x.shape
    _close(got, ref)
    _close(_grads(got, got_x)[0], _grads(ref, ref_x)[0])


def test_rotary_layouts_outside_the_kernel_run_the_reference(ops):
    """Interleaved pairs, partial rotary and bf16 are the reference's (bitwise); half-width cos / sin over the
    whole head dim are expanded and run the kernel."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 2, 16, generator=g)
    cos, sin = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    assert torch.equal(ops.apply_rotary(x, cos, sin, interleaved=True), ref_rotary.apply_rotary(x, cos, sin, interleaved=True))
    c8, s8 = cos[:, :8], sin[:, :8]
    assert torch.equal(ops.apply_rotary(x, c8, s8), ref_rotary.apply_rotary(x, c8, s8))
    _close(ops.apply_rotary(x, c8, s8, rotary_dim=16), ref_rotary.apply_rotary(x.double(), c8.double(), s8.double(), rotary_dim=16))
    xb = x.bfloat16()
    assert torch.equal(ops.apply_rotary(xb, cos, sin), ref_rotary.apply_rotary(xb, cos, sin))
    with pytest.raises(ValueError, match="do not broadcast"):
        ops.apply_rotary(x, torch.randn(5, 16), torch.randn(5, 16))


def _caches(g, slots, length, hkv, d):
    return torch.randn(slots, length, hkv, d, generator=g), torch.randn(slots, length, hkv, d, generator=g)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (8, 1, 128), (2, 2, 40), (6, 3, 36)])
def test_decode_attention_slot_layout_matches_the_loop(ops, hq, hkv, d):
    g = torch.Generator().manual_seed(6)
    batch, slots, length = 9, 12, 23
    q = torch.randn(batch, hq, d, generator=g)
    kc, vc = _caches(g, slots, length, hkv, d)
    seqlens = torch.randint(1, length + 1, (batch,), generator=g)
    seqlens[2] = 0  # no key: zeros
    slot_ids = torch.randperm(slots, generator=g)[:batch]
    for kw in ({}, {"slot_ids": slot_ids}, {"slot_ids": slot_ids, "max_seqlen_k": 11}, {"softmax_scale": 0.3}):
        got = ops.decode_attention(q, kc, vc, seqlens, **kw)
        ref = ref_decode.decode_attention_loop(q.double(), kc.double(), vc.double(), seqlens, **kw)
        _close(got, ref)
        assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_decode_attention_strided_query_and_int32_indices(ops):
    """The decode step passes q as a view of the joint q / k rotary output (rows not contiguous) and the cache's
    int32 / int64 index tensors as they are."""
    g = torch.Generator().manual_seed(12)
    qk = torch.randn(6, 4 + 2, 64, generator=g)
    q = qk[:, :4]
    assert not q.is_contiguous()
    kc, vc = _caches(g, 8, 10, 2, 64)
    seqlens, slots = torch.tensor([3, 10, 1, 7, 0, 5], dtype=torch.int32), torch.tensor([7, 0, 3, 1, 2, 6], dtype=torch.int32)
    got = ops.decode_attention(q, kc, vc, seqlens, slot_ids=slots, max_seqlen_k=10)
    assert torch.equal(got, ops.decode_attention(q.contiguous(), kc, vc, seqlens.long(), slot_ids=slots.long()))
    _close(got, ref_decode.decode_attention_loop(q.double(), kc.double(), vc.double(), seqlens, slot_ids=slots))


def test_decode_attention_paged_layout_matches_the_loop_and_the_slot_layout(ops):
    g = torch.Generator().manual_seed(7)
    batch, hq, hkv, d, block = 5, 4, 2, 64, 4
    q = torch.randn(batch, hq, d, generator=g)
    seqlens = torch.tensor([1, 4, 5, 13, 16], dtype=torch.int32)
    kslot, vslot = _caches(g, batch, 16, hkv, d)
    # the same keys scattered over shuffled blocks
    order = torch.randperm(batch * 4, generator=g)
    kp, vp = torch.empty(batch * 4, block, hkv, d), torch.empty(batch * 4, block, hkv, d)
    kp[order] = kslot.reshape(batch * 4, block, hkv, d)
    vp[order] = vslot.reshape(batch * 4, block, hkv, d)
    table = order.reshape(batch, 4).int()
    paged = ops.decode_attention(q, kp, vp, seqlens, block_table=table)
    slot = ops.decode_attention(q, kslot, vslot, seqlens)
    ref = ref_decode.decode_attention_loop(q.double(), kp.double(), vp.double(), seqlens, block_table=table)
    _close(paged, ref)
    assert torch.equal(paged, slot)  # same keys in the same order: the same sums


def test_decode_attention_rejects_out_of_range_blocks_before_reading(ops):
    q = torch.randn(2, 2, 8)
    kc = vc = torch.randn(3, 4, 1, 8)
    with pytest.raises(IndexError, match="cache block"):
        ops.decode_attention(q, kc, vc, torch.tensor([5, 2]), block_table=torch.tensor([[0, 7], [1, 0]]))


def test_results_of_a_row_do_not_depend_on_the_batch(ops):
    """Continuous batching swaps rows in and out: a row's output must be bitwise the same alone or in any batch."""
    g = torch.Generator().manual_seed(8)
    x, r, w = torch.randn(37, 96, generator=g), torch.randn(37, 96, generator=g), torch.randn(96, generator=g)
    full, _ = ops.rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(full[11:12], ops.rms_norm(x[11:12], w, 1e-6, residual=r[11:12])[0])
    gate, up = torch.randn(37, 96, generator=g), torch.randn(37, 96, generator=g)
    assert torch.equal(ops.swiglu(gate, up)[5:9], ops.swiglu(gate[5:9].clone(), up[5:9].clone()))
    q = torch.randn(8, 4, 64, generator=g)
    kc, vc = _caches(g, 8, 20, 2, 64)
    seqlens = torch.randint(1, 21, (8,), generator=g)
    batch = ops.decode_attention(q, kc, vc, seqlens)
    alone = ops.decode_attention(q[3:4], kc, vc, seqlens[3:4], slot_ids=torch.tensor([3]))
    assert torch.equal(batch[3:4], alone)


def test_the_cpu_ops_run_on_torchs_threads(ext):
    """at::parallel_for inside _C spreads work over torch.set_num_threads threads: compiled without OpenMP it
    silently ran every op on the calling thread (CMakeLists.txt)."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.ops.megatron_vlm.parallel_threads(64) == 1
        torch.set_num_threads(2)
        assert torch.ops.megatron_vlm.parallel_threads(64) == 2
        assert torch.ops.megatron_vlm.parallel_threads(1) == 1  # one item: no second thread
    finally:
        torch.set_num_threads(old)


def test_weight_gradient_does_not_depend_on_the_thread_count(ops):
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(1500, 64, generator=g), torch.randn(64, generator=g)
    grads = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            xl, wl = _leaf(x), _leaf(w)
            grads.append(_grads(ops.rms_norm(xl, wl, 1e-6), [xl, wl]))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_other_dtypes_and_noncontiguous_inputs(ops):
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(8, 32, generator=g), torch.randn(32, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(ops.rms_norm(xb, wb, 1e-6), ref_norms.rms_norm(xb, wb, 1e-6))
    assert torch.equal(ops.swiglu(xb, xb), ref_swiglu.swiglu(xb, xb))
    xt = torch.randn(32, 8, generator=g).t()  # non-contiguous fp32: copied, same numbers as the contiguous call
    assert torch.equal(ops.rms_norm(xt, w, 1e-6), ops.rms_norm(xt.contiguous(), w, 1e-6))
    wt = torch.randn(32, 2, generator=g).t()[0].requires_grad_()  # a non-contiguous weight that trains
    out = ops.rms_norm(x, wt, 1e-6)
    _close(out, ref_norms.rms_norm(x.double(), wt.detach().double(), 1e-6))
    out.sum().backward()
    assert wt.grad is not None and wt.grad.shape == (32,)
    with pytest.raises(ValueError, match="does not match hidden size"):
        ops.rms_norm(x, torch.randn(31), 1e-6)
    with pytest.raises(ValueError, match="gate shape"):
        ops.swiglu(x, x[:, :16])


def test_registry_picks_csrc_for_cpu_float32_only(ext):
    assert DEFAULT_REGISTRY.choose("rms_norm", "cpu", torch.float32) == "csrc"
    for op in ("swiglu", "apply_rotary", "decode_attention"):
        assert DEFAULT_REGISTRY.choose(op, "cpu", torch.float32) == "csrc"
        assert DEFAULT_REGISTRY.choose(op, "cpu", torch.bfloat16) == "torch"
    with kernels.use_backends({"rms_norm": "csrc"}), pytest.raises(BackendUnavailableError, match="float32") as err:
        kernels.rms_norm(torch.randn(2, 4).bfloat16(), torch.ones(4).bfloat16(), 1e-6)
    # forced, the call fails: the reason must not claim that it runs the reference instead (only `auto` does)
    assert "set the op to auto" in str(err.value)


def test_compiled_block_equals_eager(ops):
    """parallel.compile compiles decoder blocks with these ops inside (fake kernels registered in C++)."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(6, 4, 2, 16, generator=g), torch.randn(16, generator=g)
    cos, sin = torch.randn(6, 4, 16, generator=g), torch.randn(6, 4, 16, generator=g)

    def block(x):
        h = kernels.rms_norm(x, w, 1e-6)
        h = kernels.apply_rotary(h, cos, sin)
        return kernels.swiglu(h, x)

    eager = block(x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(eager, compiled)


def test_compiled_backward_equals_eager(ops):
    """Training under parallel.compile: gradients through the compiled ops equal eager ones. rms_norm without a
    residual has a second, non-differentiable output (an empty tensor); the compiled backward hands it a zero
    gradient of that empty shape, which the kernel must ignore rather than check against x's shape."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(12)
    x0, w0, r0 = torch.randn(6, 16, generator=g), torch.randn(16, generator=g), torch.randn(6, 16, generator=g)
    leaves = [_leaf(t) for t in (x0, w0, r0)]
    eager = _grads(_norms_block(*leaves), leaves)
    leaves = [_leaf(t) for t in (x0, w0, r0)]
    compiled = _grads(torch.compile(_norms_block, fullgraph=True, backend="aot_eager")(*leaves), leaves)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_compiled_with_dynamic_shapes(ops):
    """Packs of changing length: after the first change dynamo traces the token count as a symbol, and the C++
    fake kernels must size their outputs from symbolic sizes (an int64 numel of such a tensor raises)."""
    torch._dynamo.reset()
    compiled = torch.compile(_norms_block, fullgraph=True, backend="eager", dynamic=True)
    g = torch.Generator().manual_seed(13)
    for rows in (6, 9):
        x, w, r = torch.randn(rows, 16, generator=g), torch.randn(16, generator=g), torch.randn(rows, 16, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, w, r), _norms_block(x, w, r), rtol=0, atol=0)


def _norms_block(x, w, r):
    h = kernels.rms_norm(x, w, 1e-6)
    normed, summed = kernels.rms_norm(h, w, 1e-6, residual=r)
    return kernels.swiglu(normed, summed)
