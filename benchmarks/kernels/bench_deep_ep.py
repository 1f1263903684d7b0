"""Expert-parallel dispatch / combine: DeepEP (`moe_ep_dispatch = "deep_ep"`) vs our all_to_all_single
(`"torch"`), forward + backward of one sharded MoE experts layer, bf16.

Run on one node with `torchrun --nproc-per-node <ep> benchmarks/kernels/bench_deep_ep.py` (ep in 2, 4, 8);
rank 0 prints the table (ratio to the torch row). Without CUDA, deep_ep or a multi-rank launch it
prints the skipped rows and exits 0 (so `--quick` stays a CPU smoke test).
Shape: Nemotron-3-Nano-30B-A3B-like layer (128 experts, top-6, hidden 2688, expert intermediate 1856),
4096 tokens per rank.
"""
import os

import torch
from common import Table, environment, measure_peaks, parse_args, try_bench


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    world = int(os.environ.get("WORLD_SIZE", "1"))
    table = Table(f"moe_ep_dispatch ({environment()}, ep={world})", measure_peaks(device, quick or device != "cuda"))
    try:
        import deep_ep  # noqa: F401
        have = True
    except ImportError:
        have = False
    if device != "cuda" or world < 2 or not have:
        for impl in ("torch", "deep_ep"):
            table.add("EP experts fwd+bwd", impl, None, note="skipped: needs torchrun on >= 2 CUDA devices and deep_ep")
        table.print()
        table.write_json(args.json)
        return
    import torch.distributed as dist

    import megatron_vlm.kernels as K
    from megatron_vlm.models.common.moe import GroupedExperts
    from megatron_vlm.parallel.expert_parallel import apply_ep

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    e, k, h, inter, n = 128, 6, 2688, 1856, 4096
    experts = GroupedExperts(e, h, inter, activation="relu2", gated=False)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    block = torch.nn.Module()
    block.experts = experts.cuda().to(torch.bfloat16)
    apply_ep([block], dist.group.WORLD)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    scores = torch.randn(n, e, device="cuda")
    w, ids = torch.softmax(scores, -1).topk(k, -1)
    for impl in ("torch", "deep_ep"):
        def step(impl=impl):
            with K.use_backends({"moe_ep_dispatch": impl}):
                out, _ = block.experts(x, ids, w)
            out.sum().backward()
        try_bench(table, f"EP experts fwd+bwd {n} tok/rank top-{k}", impl, step, device, quick,
                  bytes_moved=4 * n * k * h * 2)
    if rank == 0:
        table.print()
        table.write_json(args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
