"""Fused LM head + token log-probs (GRPO): ours (Triton, chunked) and the chunked torch reference
vs the naive path (full [N, V] logits from a bf16 lm_head, fp32 log_softmax, gather), forward +
backward time and peak extra memory (CUDA allocator) of one call with gradients.

Shape of the target: N = 16384 tokens, H = 2048 (Qwen2.5-VL-3B), V = 151936; also H = 3584
(Qwen2.5-VL-7B / InternVL3-8B, V = 152064) and Nemotron-3-Nano (H = 2688, V = 131072).
Target (issue 4): peak extra memory <= 25% of the naive path, time <= 1.2x the naive path.
"""
import torch
from common import Table, environment, measure_peaks, ours_available, parse_args, peak_extra_memory_mb, try_bench

from megatron_vlm.kernels.reference.token_logprobs import linear_token_logprobs as reference_logprobs


def naive_logprobs(hidden, weight, labels):
    logits = hidden @ weight.t()
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.where(labels != -100, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"linear_token_logprobs ({environment()})", measure_peaks(device, quick))
    ours = None
    if ours_available(device):
        from megatron_vlm.kernels.triton.token_logprobs import linear_token_logprobs as ours
    cases = [("N16k H2048 V151936 (Qwen2.5-VL-3B)", 16384, 2048, 151936),
             ("N16k H3584 V152064 (Qwen2.5-VL-7B)", 16384, 3584, 152064),
             ("N16k H2688 V131072 (Nemotron-3-Nano)", 16384, 2688, 131072)]
    if quick:
        cases = [("tiny N64 H32 V1000", 64, 32, 1000)]
    for name, n, h, v in cases:
        g = torch.Generator(device=device).manual_seed(0)
        hidden = (torch.randn(n, h, device=device, generator=g) * 0.5).to(dtype).requires_grad_()
        weight = (torch.randn(v, h, device=device, generator=g) * h**-0.5).to(dtype).requires_grad_()
        labels = torch.randint(0, v, (n,), device=device, generator=g)
        labels[::7] = -100
        flops = 2 * n * h * v * 3  # logits, d_hidden, d_weight (ours recomputes logits: +1/3, not counted)
        rows = [("naive (full logits)", lambda: naive_logprobs(hidden, weight, labels)),
                ("torch chunked reference", lambda: reference_logprobs(hidden, weight, labels))]
        if ours is not None:
            rows.append(("ours triton", lambda: ours(hidden, weight, labels)))
        for impl, fn in rows:
            def step(fn=fn):
                return torch.autograd.grad(fn().sum(), (hidden, weight))

            try:
                mem = peak_extra_memory_mb(step, device)
            except Exception as exc:  # noqa: BLE001
                table.add(name + " fwd+bwd", impl, None, note=f"{type(exc).__name__}: {str(exc)[:60]}")
                continue
            try_bench(table, name + " fwd+bwd", impl, step, device, quick, flops=flops,
                      note="" if mem is None else f"peak extra {mem:.0f} MiB")
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
