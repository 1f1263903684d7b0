"""Decode attention (one query token per sequence against its KV cache): the torch backend (gather +
masked SDPA) vs ours (Triton, split-K) at rollout shapes, slot and paged layouts.

Why: a decode step reads the whole KV cache of every running sequence once and does almost no
arithmetic per byte, so the figure that matters is the share of the copy bandwidth (GB/s counts the
keys and values actually cached, not the padding a backend may read). The first Triton version took
3 ms per call at the 3B rollout shape on an H100 (93 % of a decode step, slower than the torch
backend); `auto` on CUDA picks the backend these rows show faster (kernels/builtin_ops.py).

Shapes: Qwen2.5-VL-3B (16 / 2 heads, D 128) and -7B (28 / 4) decode batches of 16-64 sequences with
1.1k-4k cached keys (1k-token image prompts + the completion so far), bf16 on CUDA.
`--cases REGEX` selects cases (common.py); `--quick` is a CPU smoke test (tiny fp32 case, Triton
rows only under TRITON_INTERPRET=1).
"""
import torch
from common import Table, environment, measure_peaks, ours_available, parse_args, try_bench, wanted

from megatron_vlm.kernels.reference.decode_attention import decode_attention as torch_backend


def _case(batch, hq, hkv, d, keys, layout, device, dtype, block=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # lengths spread over [keys / 2, keys]: continuous batching mixes old and new sequences
    seqlens = torch.randint(keys // 2, keys + 1, (batch,), generator=g)
    q = torch.randn(batch, hq, d, generator=g).to(device, dtype)
    if layout == "slot":
        k = torch.randn(batch + 4, keys, hkv, d, generator=g).to(device, dtype)
        kw = dict(slot_ids=torch.randperm(batch + 4, generator=g)[:batch].to(device))
    else:
        per_seq = -(-keys // block)
        n_blocks = batch * per_seq + 4
        k = torch.randn(n_blocks, block, hkv, d, generator=g).to(device, dtype)
        kw = dict(block_table=torch.randperm(n_blocks, generator=g)[: batch * per_seq].view(batch, per_seq)
                  .to(device, torch.int32))
    v = torch.randn_like(k)
    nbytes = 2 * int(seqlens.sum()) * hkv * d * k.element_size() + 2 * q.numel() * q.element_size()
    return q, k, v, seqlens.to(device), kw, keys, nbytes


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"decode_attention ({environment()})", measure_peaks(device, quick))
    ours = None
    if ours_available(device):
        from megatron_vlm.kernels.triton.decode_attention import decode_attention as ours
    cases = [("3B B16 x 1.1k keys (16/2, D128) slot", 16, 16, 2, 128, 1130, "slot"),
             ("3B B64 x 1.5k keys (16/2, D128) slot", 64, 16, 2, 128, 1536, "slot"),
             ("3B B64 x 1.5k keys (16/2, D128) paged 16", 64, 16, 2, 128, 1536, "paged"),
             ("3B B64 x 4k keys (16/2, D128) slot", 64, 16, 2, 128, 4096, "slot"),
             ("7B B64 x 4k keys (28/4, D128) slot", 64, 28, 4, 128, 4096, "slot")]
    if quick:
        cases = [("tiny B3 x 70 keys (4/2, D16) slot", 3, 4, 2, 16, 70, "slot"),
                 ("tiny B3 x 70 keys (4/2, D16) paged 16", 3, 4, 2, 16, 70, "paged")]
    for name, batch, hq, hkv, d, keys, layout in cases:
        if not wanted(name):
            continue
        q, k, v, seqlens, kw, length, nbytes = _case(batch, hq, hkv, d, keys, layout, device, dtype)
        rows = [("torch backend", lambda: torch_backend(q, k, v, seqlens, max_seqlen_k=length, **kw))]
        if ours is not None:
            rows.append(("ours triton", lambda: ours(q, k, v, seqlens, max_seqlen_k=length, **kw)))
        for impl, fn in rows:
            try_bench(table, name, impl, fn, device, quick, bytes_moved=nbytes)
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
