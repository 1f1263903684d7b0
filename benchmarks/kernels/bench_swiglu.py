"""SwiGLU silu(gate) * up: ours (Triton) vs torch eager, torch.compile and Liger-Kernel's
SiLUMul when installed; forward (read gate, up; write out) and backward (read dy, gate, up;
write dgate, dup).

Shapes: 8k tokens of the MLP intermediate of Qwen2.5-VL-3B (11008), Qwen2.5-VL-7B / InternVL3-8B
(18944), the Qwen2.5-VL ViT MLP (3420, 32k patches) and a Nemotron-3-Nano MoE expert batch
(1856 per expert, 64k routed token copies).
Target (issue 4): >= 85% of the copy bandwidth on tensors >= 64 MB and >= 2x torch eager.
`--no-compile` leaves out the torch.compile rows (the GPU lease does); `--cases REGEX` selects cases (common.py).
"""
import torch
import torch.nn.functional as F
from common import Table, compile_fn, environment, liger, measure_peaks, ours_available, parse_args, try_bench, wanted


def eager_swiglu(gate, up):
    return F.silu(gate) * up


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"swiglu ({environment()})", measure_peaks(device, quick))
    ours = None
    if ours_available(device):
        from megatron_vlm.kernels.triton.swiglu import swiglu as ours
    lk = liger(device)
    compiled = compile_fn(eager_swiglu, quick)
    cases = [("Qwen2.5-VL-3B MLP 8k x 11008", 8192, 11008), ("Qwen2.5-VL-7B MLP 8k x 18944", 8192, 18944),
             ("Qwen2.5-VL ViT MLP 32k x 3420", 32768, 3420), ("Nemotron-3-Nano experts 64k x 1856", 65536, 1856)]
    if quick:
        cases = [("tiny 33 x 80", 33, 80)]
    for name, n, h in cases:
        g = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        u = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        nbytes = g.numel() * g.element_size()
        rows = [("eager", lambda: eager_swiglu(g, u)), ("torch.compile", lambda: compiled(g, u))]
        if ours is not None:
            rows.append(("ours triton", lambda: ours(g, u)))
        if lk is not None and device == "cuda":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            rows.append(("liger", lambda: LigerSiLUMulFunction.apply(g, u)))
        for impl, fn in rows:
            if not wanted(name, impl):
                continue
            try_bench(table, name + " fwd", impl, fn, device, quick, bytes_moved=3 * nbytes)
            try:
                out = fn()
                grad = torch.randn_like(out)
                try_bench(table, name + " bwd", impl, lambda: torch.autograd.grad(out, (g, u), grad, retain_graph=True),
                          device, quick, bytes_moved=5 * nbytes)
            except Exception as exc:  # noqa: BLE001
                table.add(name + " bwd", impl, None, note=f"{type(exc).__name__}: {str(exc)[:60]}")
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
