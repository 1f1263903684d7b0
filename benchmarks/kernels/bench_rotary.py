"""Rotary embedding: ours (Triton) vs the transformers-style eager formula, torch.compile and
Liger-Kernel's rope when installed; forward and backward of one of q / k.

Shapes: 16k tokens of q for Qwen2.5-VL-7B (28 heads, D = 128, M-RoPE cos/sin per sample),
Nemotron-3-Nano (32 heads), and Qwen2.5-VL ViT tokens (16 heads, D = 80; the 2-D vision rotary
arrives as full-width cos / sin, as transformers builds it). Bytes: read x, write y, read cos /
sin (per token, small next to the per-head tensor).
Target (issue 4): >= 85% of the copy bandwidth on tensors >= 64 MB and >= 2x torch eager.
`--no-compile` leaves out the torch.compile rows (the GPU lease does); `--cases REGEX` selects cases (common.py).
"""
import torch
from common import Table, compile_fn, environment, liger, measure_peaks, ours_available, parse_args, try_bench, wanted


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def eager_rotary(x, cos, sin):
    """transformers' apply_rotary_pos_emb for [B, S, H, D] with cos [B, S, D]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"apply_rotary ({environment()})", measure_peaks(device, quick))
    ours = None
    if ours_available(device):
        from megatron_vlm.kernels.triton.rotary import apply_rotary as ours
    lk = liger(device)
    compiled = compile_fn(eager_rotary, quick)
    cases = [("Qwen2.5-VL-7B q 16k x 28 x 128", 1, 16384, 28, 128), ("Nemotron-3-Nano q 16k x 32 x 128", 1, 16384, 32, 128),
             ("Qwen2.5-VL ViT 64k x 16 x 80", 1, 65536, 16, 80)]
    if quick:
        cases = [("tiny 2 x 33 x 4 x 64", 2, 33, 4, 64)]
    for name, b, s, h, d in cases:
        x = torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True)
        angles = torch.randn(b, s, d // 2, device=device)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        nbytes = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
        rows = [("eager", lambda: eager_rotary(x, cos, sin)), ("torch.compile", lambda: compiled(x, cos, sin))]
        if ours is not None:
            rows.append(("ours triton", lambda: ours(x, cos, sin)))
        if lk is not None and device == "cuda":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            xt = x.transpose(1, 2)  # Liger takes [B, H, S, D] q and k: benchmark q = k = x (counts both)
            rows.append(("liger (q and k)", lambda: liger_rotary_pos_emb(xt, xt, cos.to(dtype), sin.to(dtype))))
        for impl, fn in rows:
            if not wanted(name, impl):
                continue
            try_bench(table, name + " fwd", impl, fn, device, quick, bytes_moved=nbytes)
            try:
                out = fn()
                outs = out if isinstance(out, tuple) else (out,)
                grads = [torch.randn_like(o) for o in outs]
                try_bench(table, name + " bwd", impl, lambda: torch.autograd.grad(outs, (x,), grads, retain_graph=True),
                          device, quick, bytes_moved=nbytes)
            except Exception as exc:  # noqa: BLE001
                table.add(name + " bwd", impl, None, note=f"{type(exc).__name__}: {str(exc)[:60]}")
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
