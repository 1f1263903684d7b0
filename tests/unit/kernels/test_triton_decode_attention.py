"""Triton decode attention (compiled on CUDA, interpreted on CPU) against the per-sequence loop of the
reference module (`decode_attention_loop`, itself checked against the batched attention op in
test_decode_attention.py): slot layout with permuted slot ids, paged layout with a shuffled block
table, sequences without keys, GQA / MQA, `max_seqlen_k` bounds, bf16; and a greedy rollout of the
tiny Qwen2.5-VL with the triton backend selected equals the torch backend token for token. Larger
bf16 shapes run on CUDA only (`gpu`: the interpreter is too slow for them)."""
import pytest
import torch
from kernel_checks import DEVICE

import megatron_vlm.kernels as K
from megatron_vlm.kernels.reference.decode_attention import decode_attention as torch_backend
from megatron_vlm.kernels.reference.decode_attention import decode_attention_loop
from megatron_vlm.kernels.registry import DEFAULT_REGISTRY
from megatron_vlm.kernels.triton.decode_attention import decode_attention, num_splits

FP32 = dict(atol=2e-6, rtol=1e-5)


def _slot_case(b, slots, length, hq, hkv, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k = torch.randn(slots, length, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, length, hkv, d, generator=g).to(dtype)
    slot_ids = torch.randperm(slots, generator=g)[:b]
    seqlens = torch.randint(0, length + 1, (b,), generator=g)
    seqlens[0] = length  # a full slot (keys past the first 64-key block) next to short and empty ones
    return q, k, v, slot_ids, seqlens


def _on(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("shape", [(3, 5, 70, 4, 2, 16), (5, 6, 9, 6, 1, 24), (2, 2, 3, 2, 2, 8), (2, 3, 90, 16, 2, 16),
                                   (2, 2, 40, 2, 2, 80)])
def test_slot_layout_matches_loop(shape):
    q, k, v, slot_ids, seqlens = _slot_case(*shape, seed=sum(shape))
    seqlens[-1] = 0  # no keys: zeros
    ref = decode_attention_loop(q, k, v, seqlens, slot_ids=slot_ids)
    out = decode_attention(*_on(q, k, v, seqlens), slot_ids=slot_ids.to(DEVICE))
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.cpu(), ref, **FP32)
    assert out[-1].abs().max() == 0
    # max_seqlen_k bounds the keys read, as in the reference
    bound = 5
    ref = decode_attention_loop(q, k, v, seqlens, slot_ids=slot_ids, max_seqlen_k=bound)
    out = decode_attention(*_on(q, k, v, seqlens), slot_ids=slot_ids.to(DEVICE), max_seqlen_k=bound)
    torch.testing.assert_close(out.cpu(), ref, **FP32)
    # without slot ids sequence b reads slot b; a softmax scale is honoured
    out = decode_attention(*_on(q, k, v, seqlens), softmax_scale=0.3)
    torch.testing.assert_close(out.cpu(), decode_attention_loop(q, k, v, seqlens, softmax_scale=0.3), **FP32)


def _paged_case(seed, b, hq, hkv, d, block, blocks, per_seq):
    """q `[b, hq, d]`, a paged cache of `blocks` blocks and a block table of `per_seq` distinct blocks per sequence."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g)
    k = torch.randn(blocks, block, hkv, d, generator=g)
    v = torch.randn(blocks, block, hkv, d, generator=g)
    table = torch.randperm(blocks, generator=g)[: b * per_seq].view(b, per_seq).to(torch.int32)
    return q, k, v, table


def test_paged_layout_matches_loop_and_slot_layout():
    b, hq, hkv, d, block, blocks, per_seq = 4, 8, 2, 16, 4, 24, 5
    q, k, v, table = _paged_case(3, b, hq, hkv, d, block, blocks, per_seq)
    seqlens = torch.tensor([1, 4, 17, 20])
    out = decode_attention(*_on(q, k, v, seqlens), block_table=table.to(DEVICE))
    ref = decode_attention_loop(q, k, v, seqlens, block_table=table)
    torch.testing.assert_close(out.cpu(), ref, **FP32)
    # the same keys laid out as slots (the blocks of a sequence concatenated) give the same output
    ks = k[table.long()].reshape(b, per_seq * block, hkv, d)
    vs = v[table.long()].reshape(b, per_seq * block, hkv, d)
    slot_out = decode_attention(*_on(q, ks, vs, seqlens))
    torch.testing.assert_close(slot_out.cpu(), ref, **FP32)
    bounded = decode_attention(*_on(q, k, v, seqlens), block_table=table.to(DEVICE), max_seqlen_k=6)
    torch.testing.assert_close(bounded.cpu(), decode_attention_loop(q, k, v, seqlens, block_table=table, max_seqlen_k=6), **FP32)


def test_bf16_small():
    q, k, v, slot_ids, seqlens = _slot_case(3, 4, 21, 4, 2, 16, seed=11, dtype=torch.bfloat16)
    out = decode_attention(*_on(q, k, v, seqlens), slot_ids=slot_ids.to(DEVICE))
    assert out.dtype == torch.bfloat16
    exact = decode_attention_loop(q.float(), k.float(), v.float(), seqlens, slot_ids=slot_ids)  # fp32 of the same inputs
    torch.testing.assert_close(out.cpu().float(), exact, atol=1.6e-2, rtol=1.6e-2)  # one bf16 rounding of the output


def test_bad_input_is_refused():
    q, k, v, slot_ids, seqlens = _slot_case(2, 3, 5, 4, 2, 8, seed=1)
    with pytest.raises(ValueError, match="not both"):
        decode_attention(*_on(q, k, v, seqlens), slot_ids=slot_ids.to(DEVICE),
                         block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="kv heads"):
        decode_attention(*_on(q[:, :3], k, v, seqlens))


def test_greedy_rollout_with_triton_backend_equals_torch_backend():
    from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams
    from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine
    from megatron_vlm.models import build_model
    from tests.fixtures import tiny_qwen2_5_vl as F

    class Tok:
        pad_token_id = F.PAD_TOKEN_ID
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=False):
            return ""

    torch.manual_seed(0)
    model = build_model(F.tiny_qwen2_5_vl_config_dict()).to(DEVICE).eval()
    g = torch.Generator().manual_seed(7)
    prompts = []
    for parts in ([2, ("image", (1, 4, 4)), 3], [5, 1]):
        s = F.build_sample(parts, g)
        prompts.append(RolloutPrompt(torch.tensor(s["input_ids"]), s["pixel_values"], s["image_grid_thw"]))
    params = SamplingParams(max_new_tokens=4, n=2, temperature=0.0)
    # the triton kernel in eager steps with slots refilled; then in static (CUDA-graph-shaped) steps that read a
    # group's shared prompt through its first row's copy (the hint from the runner's buffers), on the text prompt
    # only (a static step attends over the whole slot capacity: slow in the interpreter)
    runs = (("torch", "off", False, prompts, params), ("triton", "off", False, prompts, params),
            ("torch", "off", False, prompts[1:], SamplingParams(max_new_tokens=3, n=3, temperature=0.0)),
            ("triton", "on", True, prompts[1:], SamplingParams(max_new_tokens=3, n=3, temperature=0.0)))
    results = []
    for backend, graphs, shared, batch, sampling in runs:
        with K.use_backends({"decode_attention": backend}):
            assert DEFAULT_REGISTRY.choose("decode_attention", DEVICE, torch.float32) == backend
            eng = PolicyRolloutEngine(model, Tok(), EngineOptions(eos_token_ids=[-1], device=DEVICE, max_num_seqs=3,
                                                                  cuda_graphs=graphs, share_prefix_reads=shared))
            results.append(eng.generate(batch, sampling).samples)
    for ref, got in ((results[0], results[1]), (results[2], results[3])):
        for a, b in zip(ref, got, strict=True):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["slot", "paged"])
def test_bf16_cuda_large_matches_torch_backend(layout):
    """Decode shapes of the 3B rollout (16 / 2 heads, D 128) over ~1.5k cached keys, bf16 on CUDA."""
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d, length = 32, 16, 2, 128, 1536
    q = torch.randn(b, hq, d, generator=g).to("cuda", torch.bfloat16)
    seqlens = torch.randint(1, length + 1, (b,), generator=g).cuda()
    if layout == "slot":
        k = torch.randn(b + 3, length, hkv, d, generator=g).to("cuda", torch.bfloat16)
        v = torch.randn_like(k)
        kw = dict(slot_ids=torch.randperm(b + 3, generator=g)[:b].cuda())
    else:
        block = 16
        per_seq = length // block
        k = torch.randn(b * per_seq + 7, block, hkv, d, generator=g).to("cuda", torch.bfloat16)
        v = torch.randn_like(k)
        kw = dict(block_table=torch.randperm(b * per_seq + 7, generator=g)[: b * per_seq].view(b, per_seq).to("cuda", torch.int32))
    out = decode_attention(q, k, v, seqlens, **kw)
    ref = torch_backend(q.float(), k.float(), v.float(), seqlens, **kw)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # auto on CUDA since it was timed faster than the torch backend per decode step (kernels/builtin_ops.py)
    assert K.DEFAULT_REGISTRY.choose("decode_attention", "cuda", torch.bfloat16) == "triton"


def test_split_count_fills_the_gpu_in_whole_key_blocks():
    """Enough (sequence, kv head, split) programs for ~2 per SM, each split a whole number of key blocks, the
    splits covering the cache exactly once; a cache of one block or a batch that already fills the GPU: no split."""
    for pairs, length, sms in [(32, 1130, 132), (128, 1536, 132), (6, 70, 8), (1, 64, 132), (512, 4096, 132), (2, 1, 8)]:
        splits, chunk = num_splits(pairs, length, sms, block_n=64)
        assert chunk % 64 == 0 and (splits - 1) * chunk < length <= splits * chunk
        assert splits <= max(1, -(-2 * sms // pairs))
    assert num_splits(32, 1130, 132, block_n=64) == (9, 128)  # 16 sequences x 2 kv heads: 288 programs
    assert num_splits(512, 4096, 132, block_n=64)[0] == 1
    assert num_splits(1, 64, 132, block_n=64) == (1, 64)


def test_split_results_equal_one_split():
    """Merging the splits' partial softmaxes gives the single-pass result (fp32, to rounding)."""
    import megatron_vlm.kernels.triton.decode_attention as T

    q, k, v, slot_ids, seqlens = _slot_case(2, 3, 90, 8, 2, 16, seed=4)
    split = decode_attention(*_on(q, k, v, seqlens), slot_ids=slot_ids.to(DEVICE))
    one = T.num_splits
    try:
        T.num_splits = lambda pairs, length, sms, block_n=T._BLOCK_N: (1, -(-length // block_n) * block_n)
        whole = decode_attention(*_on(q, k, v, seqlens), slot_ids=slot_ids.to(DEVICE))
    finally:
        T.num_splits = one
    assert T.num_splits(4, 90, T._sm_count(torch.device(DEVICE)))[0] > 1  # the first call did split
    torch.testing.assert_close(split, whole, **FP32)


# shared prompts: rows 0-3 share 16 keys (root 1), rows 4-5 share 9 (root 5), row 6 alone (the interpreter's
# 16-key blocks and 8 stand-in SMs split these caches: prefix and suffix keys in one block, several splits)
_ROOTS = [1, 1, 1, 1, 5, 5, 6]
_PREFIX = [16, 16, 16, 16, 9, 9, 0]
_LENS = [30, 17, 16, 40, 9, 20, 25]


def _shared_case(seed, hq=4, hkv=1, d=8, length=40):
    g = torch.Generator().manual_seed(seed)
    b = len(_ROOTS)
    q = torch.randn(b, hq, d, generator=g)
    k = torch.randn(b + 2, length, hkv, d, generator=g)
    v = torch.randn_like(k)
    slot_ids = torch.randperm(b + 2, generator=g)[:b]
    for row, (root, p) in enumerate(zip(_ROOTS, _PREFIX)):  # the copies the hint promises
        k[slot_ids[row], :p] = k[slot_ids[root], :p]
        v[slot_ids[row], :p] = v[slot_ids[root], :p]
    return q, k, v, slot_ids, torch.tensor(_LENS), (torch.tensor(_ROOTS), torch.tensor(_PREFIX))


@pytest.mark.parametrize("layout", ["slot", "paged"])
def test_shared_prefix_reads_the_roots_copy(layout):
    """With the hint each sequence gets its own attention (the loop over its own keys), and the prefix comes from
    the root's copy: row 0's own copy of the prefix is broken (the hinted call does not see it; the loop does),
    row 3's keys after the prefix are changed (both see it: the suffix is each row's own). One call per layout
    (the interpreter is slow)."""
    q, k, v, slot_ids, seqlens, hint = _shared_case(seed=21)
    k[slot_ids[3], _PREFIX[3]:] += 1.0
    truth = decode_attention_loop(q, k, v, seqlens, slot_ids=slot_ids)  # every copy intact
    k[slot_ids[0], : _PREFIX[0]] += 1.0
    broken = decode_attention_loop(q, k, v, seqlens, slot_ids=slot_ids)
    assert (broken[0] - truth[0]).abs().max() > 1e-2  # the break matters to a call that reads row 0's own copy
    if layout == "paged":  # the slots cut into blocks of 8 positions in a shuffled pool
        block, per = 8, k.shape[1] // 8
        perm = torch.randperm(k.shape[0] * per, generator=torch.Generator().manual_seed(2))
        kc, vc = (torch.empty(k.shape[0] * per, block, *k.shape[2:]) for _ in range(2))
        kc[perm], vc[perm] = k.reshape(-1, block, *k.shape[2:]), v.reshape(-1, block, *v.shape[2:])
        kw = dict(block_table=perm.view(k.shape[0], per)[slot_ids].to(torch.int32))
        torch.testing.assert_close(decode_attention_loop(q, kc, vc, seqlens, **kw), broken, **FP32)  # the same keys
    else:
        kc, vc, kw = k, v, dict(slot_ids=slot_ids)
    out = decode_attention(*_on(q, kc, vc, seqlens), shared_prefix=tuple(_on(*hint)),
                           **{n: t.to(DEVICE) for n, t in kw.items()})
    torch.testing.assert_close(out.cpu(), truth, **FP32)


def test_inputs_that_need_gradients_get_them_through_the_reference():
    """The kernel has no backward; a call whose q / cache require gradients runs the torch backend (as the csrc
    backend does) instead of returning an output cut from the graph (no gradient, silently)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 64, generator=g).to(DEVICE).requires_grad_()
    k, v = (torch.randn(2, 8, 2, 64, generator=g).to(DEVICE) for _ in range(2))
    seqlens = torch.tensor([5, 8], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k, v, seqlens)
    assert out.requires_grad
    (grad,) = torch.autograd.grad(out.sum(), q)
    q_ref = q.detach().requires_grad_()
    (want,) = torch.autograd.grad(torch_backend(q_ref, k, v, seqlens).sum(), q_ref)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("splits", [1, 3])
def test_ids_outside_the_cache_give_nan_rows_not_other_memory(splits, monkeypatch):
    """A block table (or slot id) naming a block outside the cache is not read (the kernel cannot raise without a host
    sync): the rows that would have read it come out NaN, which the sampler refuses; the other rows are exact."""
    import megatron_vlm.kernels.triton.decode_attention as T

    monkeypatch.setattr(T, "num_splits", lambda rows, length, sms: (splits, -(-length // splits)))
    b, hq, hkv, d, block, blocks, per_seq = 4, 4, 2, 16, 4, 20, 5
    q, k, v, table = _paged_case(5, b, hq, hkv, d, block, blocks, per_seq)
    seqlens = torch.tensor([6, 17, 20, 3])
    ref = decode_attention_loop(q, k, v, seqlens, block_table=table)
    table[1, 3] = blocks + 7  # row 1 reads its 4th block (keys 12..15 < 17): outside the pool
    table[3, 4] = -1  # row 3 never reaches its 5th block (3 keys): not read, no effect
    out = decode_attention(*_on(q, k, v, seqlens), block_table=table.to(DEVICE)).cpu()
    assert torch.isnan(out[1]).all()
    keep = torch.tensor([0, 2, 3])
    torch.testing.assert_close(out[keep], ref[keep], **FP32)
    slots = decode_attention(*_on(q, k.reshape(blocks // 5, 5 * block, hkv, d), v.reshape(blocks // 5, 5 * block, hkv, d),
                                  seqlens), slot_ids=torch.tensor([0, 9, 1, 2]).to(DEVICE)).cpu()  # slot 9 of 4
    assert torch.isnan(slots[1]).all() and not torch.isnan(slots[keep]).any()
