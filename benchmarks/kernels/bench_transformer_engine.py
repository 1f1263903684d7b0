"""Transformer Engine backends (`kernels/thirdparty/transformer_engine.py`) vs ours and torch: RMSNorm /
LayerNorm (forward and backward) and packed varlen attention (forward and backward).

Why a script of its own: `auto` gives TE's norms priority 20 (above our Triton norms) and its attention
19 (below flash-attn) without a measurement yet; these rows decide those priorities on a GPU. Shapes as
bench_rms_norm.py / bench_attention.py (16k tokens of the Qwen2.5-VL-3B / 7B and Nemotron-3-Nano LMs,
InternViT LayerNorm; a packed 16k causal training batch with GQA, ViT windows), bf16. Each case's first
row (the torch reference for norms, SDPA with a block-diagonal mask for attention) is the baseline of its
ratios. TE rows are 'n/a' with the reason when transformer_engine or CUDA is missing.
"""
import importlib.util

import torch
from bench_attention import bench_pair, block_diagonal_mask, cu, sdpa_batched
from bench_rms_norm import fwd_bwd_rows
from common import Table, attention_flops, environment, measure_peaks, ours_available, parse_args

from megatron_vlm.kernels.reference import norms as reference_norms


def te_note(device):
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine not installed"
    return None if device == "cuda" else "needs CUDA"




def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"Transformer Engine backends ({environment()})", measure_peaks(device, quick))
    note = te_note(device)
    if note is None:
        from megatron_vlm.kernels.thirdparty import transformer_engine as te
    ours = ours_available(device)
    eps = 1e-6

    norm_cases = [("Qwen2.5-VL-3B LM 16k x 2048", 16384, 2048), ("Qwen2.5-VL-7B LM 16k x 3584", 16384, 3584),
                  ("Nemotron-3-Nano 16k x 2688", 16384, 2688), ("InternViT LN 32 tiles x 1025 x 1024", 32 * 1025, 1024)]
    if quick:
        norm_cases = [("tiny 64 x 80", 64, 80), ("InternViT LN tiny 64 x 80", 64, 80)]
    for name, n, h in norm_cases:
        x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
        nbytes = x.numel() * x.element_size()
        layer = name.startswith("InternViT")
        case = name + (" layer_norm" if layer else " rms_norm")
        inputs = (x, w, b) if layer else (x, w)
        if layer:
            rows = [("torch reference", lambda: reference_norms.layer_norm(x, w, b, eps))]
        else:
            rows = [("torch reference", lambda: reference_norms.rms_norm(x, w, eps))]
        if ours:
            if layer:
                from megatron_vlm.kernels.triton.layer_norm import layer_norm as ours_ln

                rows.append(("ours triton", lambda: ours_ln(x, w, b, eps)))
            else:
                from megatron_vlm.kernels.triton.rms_norm import rms_norm as ours_rms

                rows.append(("ours triton", lambda: ours_rms(x, w, eps)))
        if note is None:
            rows.append(("transformer_engine", (lambda: te.layer_norm(x, w, b, eps)) if layer else (lambda: te.rms_norm(x, w, eps))))
        for impl, fn in rows:
            fwd_bwd_rows(table, case, impl, fn, inputs, 2 * nbytes, 3 * nbytes, device, quick)
        if note is not None:
            table.add(case + " fwd", "transformer_engine", None, note=note)

    attn_cases = [("packed 8 samples 16k causal (16/2, D128)", [4096, 3072, 2560, 2048, 1792, 1280, 768, 768], 16, 2, 128, True),
                  ("ViT windows 64 x 256 non-causal (16/16, D80)", [64] * 256, 16, 16, 80, False),
                  ("InternViT 8 tiles x 1025 (16/16, D64)", [1025] * 8, 16, 16, 64, False)]
    if quick:
        attn_cases = [("tiny varlen causal (4/2, D64)", [5, 17, 42], 4, 2, 64, True)]
    for name, lengths, hq, hkv, d, causal in attn_cases:
        g = torch.Generator(device=device).manual_seed(0)
        total = sum(lengths)
        q, k, v = (torch.randn(total, h, d, generator=g, device=device, dtype=dtype).requires_grad_() for h in (hq, hkv, hkv))
        cu_seqlens = cu(lengths, device)
        flops = attention_flops(lengths, lengths, hq, d, causal=causal)
        mask = block_diagonal_mask(lengths, causal, device)
        bench_pair(table, name, "sdpa + mask", lambda: sdpa_batched(q[None], k[None], v[None], False, mask=mask)[0],
                   (q, k, v), flops, device, quick)
        kw = dict(causal=causal, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max(lengths),
                  max_seqlen_k=max(lengths))
        if ours:
            from megatron_vlm.kernels.triton.attention import attention as ours_attention

            bench_pair(table, name, "ours triton", lambda: ours_attention(q, k, v, **kw), (q, k, v), flops, device, quick)
        if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            from megatron_vlm.kernels.thirdparty.flash_attn import attention as fa

            bench_pair(table, name, "flash_attn", lambda: fa(q, k, v, **kw), (q, k, v), flops, device, quick)
        if note is None:
            bench_pair(table, name, "transformer_engine", lambda: te.attention(q, k, v, **kw), (q, k, v), flops, device, quick)
        else:
            table.add(name + " fwd", "transformer_engine", None, note=note)
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
