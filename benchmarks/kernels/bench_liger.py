"""Liger-Kernel backends vs ours, through the registry's adapters (what `[kernels] <op> = "liger"` runs):
linear_token_logprobs, rms_norm (with and without the fused residual) and swiglu, forward + backward.

Why: the Liger backends are registered forced-only until a measurement shows they beat our Triton
kernels; these rows (ratio to the torch reference, the first row of each case) decide `auto`.
Skipped rows without CUDA or without liger_kernel (the script still runs with --quick on CPU: the
reference and, under TRITON_INTERPRET=1, our Triton rows).
Shapes: Qwen2.5-VL-7B LM head (hidden 3584, vocab 152064, 4k tokens), its RMSNorm (8k x 3584) and
MLP intermediate (8k x 18944).
"""
import torch
from common import Table, environment, liger, measure_peaks, ours_available, parse_args, try_bench


def _fwd_bwd(fn, inputs):
    def run():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out.float().sum(), inputs)
    return run


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"liger backends ({environment()})", measure_peaks(device, quick))
    from megatron_vlm.kernels.reference.norms import rms_norm as ref_rms_norm
    from megatron_vlm.kernels.reference.swiglu import swiglu as ref_swiglu
    from megatron_vlm.kernels.reference.token_logprobs import linear_token_logprobs as ref_logprobs
    from megatron_vlm.kernels.thirdparty import liger as lg

    impls = {"linear_token_logprobs": [("torch reference", ref_logprobs)], "rms_norm": [("torch reference", ref_rms_norm)],
             "swiglu": [("torch reference", ref_swiglu)]}
    if ours_available(device):
        from megatron_vlm.kernels.triton.rms_norm import rms_norm as t_rms_norm
        from megatron_vlm.kernels.triton.swiglu import swiglu as t_swiglu
        from megatron_vlm.kernels.triton.token_logprobs import linear_token_logprobs as t_logprobs

        for op, fn in (("linear_token_logprobs", t_logprobs), ("rms_norm", t_rms_norm), ("swiglu", t_swiglu)):
            impls[op].append(("ours triton", fn))
    for op in impls:
        if liger() is not None and device == "cuda":
            impls[op].append(("liger", getattr(lg, op)))
        else:
            table.add(op, "liger", None, note="skipped: needs CUDA and liger_kernel")
    n, h, v, inter = (4096, 3584, 152064, 18944) if not quick else (33, 64, 1000, 80)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g, requires_grad=True)
    weight = (0.02 * torch.randn(v, h, device=device, dtype=dtype, generator=g)).requires_grad_(True)
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    x = torch.randn(2 * n, h, device=device, dtype=dtype, generator=g, requires_grad=True)
    res = torch.randn_like(x)
    w = torch.ones(h, device=device, dtype=dtype, requires_grad=True)
    gate = torch.randn(2 * n, inter, device=device, dtype=dtype, generator=g, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    for impl, fn in impls["linear_token_logprobs"]:
        try_bench(table, f"logprobs {n} x {h} -> {v} fwd+bwd", impl,
                  _fwd_bwd(lambda fn=fn: fn(hidden, weight, labels), (hidden, weight)), device, quick,
                  flops=3 * 2 * n * h * v)
    for impl, fn in impls["rms_norm"]:
        nbytes = x.numel() * x.element_size()
        try_bench(table, f"rms_norm {2 * n} x {h} fwd+bwd", impl, _fwd_bwd(lambda fn=fn: fn(x, w, 1e-6), (x, w)),
                  device, quick, bytes_moved=5 * nbytes)
        try_bench(table, f"rms_norm+residual {2 * n} x {h} fwd", impl, lambda fn=fn: fn(x, w, 1e-6, residual=res),
                  device, quick, bytes_moved=4 * nbytes)
    for impl, fn in impls["swiglu"]:
        nbytes = gate.numel() * gate.element_size()
        try_bench(table, f"swiglu {2 * n} x {inter} fwd+bwd", impl, _fwd_bwd(lambda fn=fn: fn(gate, up), (gate, up)),
                  device, quick, bytes_moved=8 * nbytes)
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
