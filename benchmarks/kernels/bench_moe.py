"""MoE expert compute: ours (Triton grouped_mm, moe_unpermute) vs the torch reference (a loop of
per-expert matmuls / index_select + weighted sum), a dense bmm of the same FLOPs, and
torch._grouped_mm when this torch build has it for the device; forward and backward. On CUDA in bf16 on
sm90+ also "ours torch_grouped_mm (auto)", the backend `auto` takes there (kernels/torch_fused/grouped_mm.py):
torch._grouped_mm plus our wrapper's group-count read on the host and offsets copy, against the bare op.

Shapes (8k tokens, uniform random top-k routing, bf16):
- Qwen3-VL-30B-A3B MoE: hidden 2048, 128 experts, top-8, expert intermediate 768, gated
  (gate_up_proj [E, 1536, 2048], down_proj [E, 2048, 768], "enk" layout as in transformers);
- Nemotron-3-Nano: hidden 2688, 128 experts, top-6, expert intermediate 1856, relu2 (up_proj
  [E, 1856, 2688], down_proj [E, 2688, 1856]) — from memory of the public config, check
  config.json before quoting.
FLOPs: grouped_mm forward = 2 * rows * K * N, backward (dX + dW) = 2 x forward. The dense bmm row
is the ideal a grouped kernel aims at: [E, rows/E, K] @ [E, K, N], perfectly balanced, no
schedule. moe_unpermute is memory-bound: GB/s counts reading the N*k rows and writing N rows.
"""
import torch
from common import Table, environment, measure_peaks, ours_available, parse_args, try_bench


def routed_counts(n_tokens: int, experts: int, topk: int, device: str, seed: int = 0) -> torch.Tensor:
    """tokens_per_expert of a uniform random top-k routing (each token picks k distinct experts)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(n_tokens, experts, generator=gen).topk(topk, dim=1).indices
    return torch.bincount(ids.reshape(-1), minlength=experts).to(device)


def torch_grouped_mm_fn(x, w_enk, counts):
    """torch._grouped_mm (CUDA, bf16, sm90+) when available, else None."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or x.device.type != "cuda":
        return None
    offs = torch.cumsum(counts, 0).to(torch.int32)
    w_ekn = w_enk.transpose(1, 2)
    return lambda: fn(x, w_ekn, offs=offs)


def bench_grouped_mm(table, name, rows, k, n, experts, counts, ref, ours, device, dtype, quick):
    x = torch.randn(rows, k, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(experts, n, k, device=device, dtype=dtype) / k**0.5).requires_grad_()
    per_expert = -(-rows // experts)
    xd = torch.randn(experts, per_expert, k, device=device, dtype=dtype, requires_grad=True)
    flops = 2.0 * rows * k * n
    impls = [
        ("torch reference", lambda: ref(x, w, tokens_per_expert=counts, weight_layout="enk"), (x, w)),
        ("dense bmm (ideal)", lambda: torch.bmm(xd, w.transpose(1, 2)), (xd, w)),
    ]
    tgm = torch_grouped_mm_fn(x, w, counts)
    if tgm is not None:
        impls.append(("torch._grouped_mm", tgm, (x, w)))
    if ours is not None:
        impls.append(("ours triton", lambda: ours(x, w, tokens_per_expert=counts, weight_layout="enk"), (x, w)))
    from megatron_vlm.kernels.torch_fused import grouped_mm as torch_fused

    if torch_fused.cuda_check(x.device.type, x.dtype) is None:  # what `auto` runs there: torch._grouped_mm + our wrapper
        impls.append(("ours torch_grouped_mm (auto)",
                      lambda: torch_fused.grouped_mm(x, w, tokens_per_expert=counts, weight_layout="enk"), (x, w)))
    for impl, fn, leaves in impls:
        try_bench(table, name + " fwd", impl, fn, device, quick, flops=flops)
        try:
            out = fn()
            grad = torch.randn_like(out)
            try_bench(table, name + " bwd", impl, lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True),
                      device, quick, flops=2 * flops)
        except Exception as exc:  # noqa: BLE001 - one failing row must not stop the others
            table.add(name + " bwd", impl, None, note=f"{type(exc).__name__}: {str(exc)[:60]}")


def bench_unpermute(table, name, n_tokens, hidden, topk, ref, ours, device, dtype, quick):
    permuted = torch.randn(n_tokens * topk, hidden, device=device, dtype=dtype, requires_grad=True)
    row_map = torch.randperm(n_tokens * topk, device=device).to(torch.int32)
    weights = torch.rand(n_tokens, topk, device=device, dtype=torch.float32, requires_grad=True)
    nbytes = (n_tokens * topk + n_tokens) * hidden * permuted.element_size()
    impls = [("torch reference", ref)] + ([("ours triton", ours)] if ours is not None else [])
    for impl, op in impls:
        fn = lambda op=op: op(permuted, row_map, weights)  # noqa: E731
        try_bench(table, name + " fwd", impl, fn, device, quick, bytes_moved=nbytes)
        try:
            out = fn()
            grad = torch.randn_like(out)
            # backward reads dOut and the permuted rows (for d topk_weights), writes d permuted
            try_bench(table, name + " bwd", impl, lambda: torch.autograd.grad(out, (permuted, weights), grad, retain_graph=True),
                      device, quick, bytes_moved=nbytes + n_tokens * topk * hidden * permuted.element_size())
        except Exception as exc:  # noqa: BLE001
            table.add(name + " bwd", impl, None, note=f"{type(exc).__name__}: {str(exc)[:60]}")


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    from megatron_vlm.kernels.reference import moe as ref

    ours = None
    if ours_available(device):
        from megatron_vlm.kernels.triton import moe as ours
    table = Table(f"moe ({environment()})", measure_peaks(device, quick))
    # (name, tokens, hidden, experts, topk, intermediate, gated)
    models = [("Qwen3-VL-30B-A3B", 8192, 2048, 128, 8, 768, True), ("Nemotron-3-Nano", 8192, 2688, 128, 6, 1856, False)]
    if quick:
        models = [("tiny", 24, 32, 4, 2, 24, True)]
    for model, n_tokens, hidden, experts, topk, inter, gated in models:
        counts = routed_counts(n_tokens, experts, topk, device)
        rows = n_tokens * topk
        up_n = 2 * inter if gated else inter
        bench_grouped_mm(table, f"{model} up {rows}x{hidden}->{up_n}", rows, hidden, up_n, experts, counts,
                         ref.grouped_mm, ours and ours.grouped_mm, device, dtype, quick)
        bench_grouped_mm(table, f"{model} down {rows}x{inter}->{hidden}", rows, inter, hidden, experts, counts,
                         ref.grouped_mm, ours and ours.grouped_mm, device, dtype, quick)
        bench_unpermute(table, f"{model} unpermute {n_tokens}x{topk}x{hidden}", n_tokens, hidden, topk,
                        ref.moe_unpermute, ours and ours.moe_unpermute, device, dtype, quick)
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
