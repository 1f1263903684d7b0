"""RMSNorm (plain and with the fused residual add) and LayerNorm: ours (Triton) vs torch eager,
torch.compile, F.rms_norm / F.layer_norm and Liger-Kernel when installed; forward and backward.

Shapes: 16k tokens of the Qwen2.5-VL-3B / 7B and Nemotron-3-Nano language models (hidden 2048,
3584, 2688), Qwen2.5-VL ViT tokens (hidden 1280, RMSNorm), InternViT tiles (hidden 1024,
LayerNorm). Memory-bound: GB/s counts the bytes each implementation must move at least
(forward: read x (+ residual), write y (+ sum); backward: read dy and x, write dx).
Target (issue 4): >= 85% of the copy bandwidth on tensors >= 64 MB and >= 2x torch eager.
`--no-compile` leaves out the torch.compile rows (the GPU lease does: compiling them takes most of its
slot); `--cases REGEX` selects cases; the title names the selection (common.py).
"""
import torch
import torch.nn.functional as F
from common import Table, compile_fn, environment, liger, measure_peaks, ours_available, parse_args, try_bench, wanted


def eager_rms_norm(x, w, eps):
    """What model code writes without a kernel (transformers' Qwen2RMSNorm)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager_add_rms_norm(x, r, w, eps):
    s = x + r
    return eager_rms_norm(s, w, eps), s


def fwd_bwd_rows(table, case, impl, fn, inputs, fwd_bytes, bwd_bytes, device, quick):
    try_bench(table, case + " fwd", impl, fn, device, quick, bytes_moved=fwd_bytes)
    try:
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.randn_like(o) for o in outs]
        try_bench(
            table, case + " bwd", impl, lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True),
            device, quick, bytes_moved=bwd_bytes,
        )
    except Exception as exc:  # noqa: BLE001
        table.add(case + " bwd", impl, None, note=f"{type(exc).__name__}: {str(exc)[:60]}")


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"rms_norm / layer_norm ({environment()})", measure_peaks(device, quick))
    ours = ours_available(device)
    if ours:
        from megatron_vlm.kernels.triton.layer_norm import layer_norm as ours_ln
        from megatron_vlm.kernels.triton.rms_norm import rms_norm as ours_rms
    lk = liger(device)
    eps = 1e-6
    compiled_rms = compile_fn(eager_rms_norm, quick)
    compiled_add = compile_fn(eager_add_rms_norm, quick)
    compiled_ln = compile_fn(F.layer_norm, quick)
    rms_cases = [("Qwen2.5-VL-3B LM 16k x 2048", 16384, 2048), ("Qwen2.5-VL-7B LM 16k x 3584", 16384, 3584),
                 ("Nemotron-3-Nano 16k x 2688", 16384, 2688), ("Qwen2.5-VL ViT 64k x 1280", 65536, 1280)]
    if quick:
        rms_cases = [("tiny 64 x 80", 64, 80)]
    for name, n, h in rms_cases:
        x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        r = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
        nbytes = x.numel() * x.element_size()
        rows = [("eager", lambda: eager_rms_norm(x, w, eps)), ("torch.compile", lambda: compiled_rms(x, w, eps)),
                ("F.rms_norm", lambda: F.rms_norm(x, (h,), w, eps))]
        if ours:
            rows.append(("ours triton", lambda: ours_rms(x, w, eps)))
        weights = {}
        if lk is not None:
            liger_norm = lk.LigerRMSNorm(h, eps=eps).to(device=device, dtype=dtype)
            with torch.no_grad():
                liger_norm.weight.copy_(w)
            rows.append(("liger", lambda: liger_norm(x)))
            weights["liger"] = liger_norm.weight  # its module's own weight (w is not in its graph)
        for impl, fn in rows:
            if not wanted(name + " rms", impl):
                continue
            fwd_bwd_rows(table, name + " rms", impl, fn, (x, weights.get(impl, w)), 2 * nbytes, 3 * nbytes, device, quick)
        rows = [("eager", lambda: eager_add_rms_norm(x, r, w, eps)), ("torch.compile", lambda: compiled_add(x, r, w, eps))]
        if ours:
            rows.append(("ours triton", lambda: ours_rms(x, w, eps, residual=r)))
        for impl, fn in rows:
            if not wanted(name + " add+rms", impl):
                continue
            fwd_bwd_rows(table, name + " add+rms", impl, fn, (x, r, w), 4 * nbytes, 4 * nbytes, device, quick)

    ln_cases = [("InternViT 32 tiles x 1025 x 1024", 32 * 1025, 1024)] if not quick else [("tiny LN 64 x 80", 64, 80)]
    for name, n, h in ln_cases:
        x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(h, device=device, dtype=dtype, requires_grad=True)
        nbytes = x.numel() * x.element_size()
        rows = [("F.layer_norm", lambda: F.layer_norm(x, (h,), w, b, eps)),
                ("torch.compile", lambda: compiled_ln(x, (h,), w, b, eps))]
        if ours:
            rows.append(("ours triton", lambda: ours_ln(x, w, b, eps)))
        for impl, fn in rows:
            if not wanted(name, impl):
                continue
            fwd_bwd_rows(table, name, impl, fn, (x, w, b), 2 * nbytes, 3 * nbytes, device, quick)
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
