"""Token log-probs without gradients (reference / old-policy log-probs in GRPO): Liger-Kernel's fused linear
cross-entropy (`kernels/thirdparty/liger.py`) vs ours (Triton, chunked) and the chunked torch reference.

Why a row of its own: the Liger backend is registered forceable-only until this measurement says it beats
ours on a GPU (then `auto` may take it for no-gradient calls). Shapes as bench_linear_token_logprobs.py
(N = 16384 tokens, Qwen2.5-VL-3B / 7B and Nemotron-3-Nano heads), bf16, forward only under no_grad.
Rows are skipped (with the reason) when liger-kernel or CUDA is missing.
"""
import importlib.util
import os

import torch
from common import Table, environment, measure_peaks, ours_available, parse_args, try_bench

from megatron_vlm.kernels.reference.token_logprobs import linear_token_logprobs as reference_logprobs


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"linear_token_logprobs, no gradients ({environment()})", measure_peaks(device, quick))
    impls = [("torch chunked reference", reference_logprobs)]
    if ours_available(device):
        from megatron_vlm.kernels.triton.token_logprobs import linear_token_logprobs as ours

        impls.append(("ours triton", ours))
    liger_note = None
    if importlib.util.find_spec("liger_kernel") is None:
        liger_note = "liger-kernel not installed"
    elif device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        liger_note = "needs CUDA (or TRITON_INTERPRET=1 on the CPU: Triton's interpreter)"
    else:
        from megatron_vlm.kernels.thirdparty.liger import linear_token_logprobs as liger

        impls.append(("liger fused linear CE", liger))
    cases = [("N16k H2048 V151936 (Qwen2.5-VL-3B)", 16384, 2048, 151936),
             ("N16k H3584 V152064 (Qwen2.5-VL-7B)", 16384, 3584, 152064),
             ("N16k H2688 V131072 (Nemotron-3-Nano)", 16384, 2688, 131072)]
    if quick:
        cases = [("tiny N64 H32 V1000", 64, 32, 1000)]
    for name, n, h, v in cases:
        g = torch.Generator(device=device).manual_seed(0)
        hidden = (torch.randn(n, h, device=device, generator=g) * 0.5).to(dtype)
        weight = (torch.randn(v, h, device=device, generator=g) * h**-0.5).to(dtype)
        labels = torch.randint(0, v, (n,), device=device, generator=g)
        for impl, fn in impls:
            def step(fn=fn):
                with torch.no_grad():
                    return fn(hidden, weight, labels)

            try_bench(table, name + " fwd", impl, step, device, quick, flops=2 * n * h * v)
        if liger_note:
            table.add(name + " fwd", "liger fused linear CE", None, note=liger_note)
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
