"""Compiled extension megatron_vlm._C (csrc/) vs the implementations it replaces, in one process.

CPU (always): M-RoPE position ids of a packed batch (Qwen2.5-VL rule with second_per_grid_ts, and
Qwen3-VL's per-frame rule) and the first-fit packing planner, C++ vs the Python code
(megatron_vlm._ext.python_only()); MoE routing (top-k gating, permutation) C++ vs the torch
reference. CUDA (when a device is present): MoE routing at 8k tokens x 128 experts, CUDA kernels
vs the torch reference. Target: >= 10x on the host ops, >= 3x for CUDA routing.

Method: the two implementations run in interleaved rounds (A, B, A, B, ...) after a warm-up, so
that drifting load on a shared machine hits both alike; the table gives min and median wall time per call
and the ratios of the medians, of the mins and of the process CPU time. Every pair is checked equal before timing.
`--quick`: tiny shapes and few rounds (a smoke test that the script runs; not a measurement).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_vlm import _ext  # noqa: E402
from megatron_vlm.data.packing import first_fit_pack  # noqa: E402
from megatron_vlm.kernels.csrc import moe as csrc_moe  # noqa: E402
from megatron_vlm.kernels.reference.moe import moe_permute as ref_permute  # noqa: E402
from megatron_vlm.kernels.reference.moe_routing import moe_topk_gating as ref_gating  # noqa: E402
from megatron_vlm.models.common.mrope_index import get_mrope_position_ids  # noqa: E402

IMAGE, VIDEO, VSTART, VEND = 151655, 151656, 151652, 151653


def interleaved(fn_a, fn_b, rounds: int, sync=lambda: None):
    """Per-call wall seconds of fn_a and fn_b, timed alternately, and their total process CPU seconds."""
    fn_a(), fn_b()
    ta, tb, cpu = [], [], [0.0, 0.0]
    for _ in range(rounds):
        for slot, (fn, out) in enumerate(((fn_a, ta), (fn_b, tb))):
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            out.append(time.perf_counter() - start)
            cpu[slot] += time.process_time() - start_cpu
    return ta, tb, cpu


def row(name, ta, tb, cpu, label_a, label_b):
    """Wall min / median per call; speed-up of the medians, of the mins, and of the process CPU time
    (on a shared machine the CPU-time ratio is the least disturbed by other processes)."""
    ma, mb = statistics.median(ta), statistics.median(tb)
    print(f"{name:<58} {label_a:>6} min {min(ta) * 1e3:9.3f} ms med {ma * 1e3:9.3f} ms | {label_b:>6} "
          f"min {min(tb) * 1e3:9.3f} ms med {mb * 1e3:9.3f} ms | x{mb / ma:.1f} median, x{min(tb) / min(ta):.1f} min, "
          f"x{cpu[1] / max(cpu[0], 1e-9):.1f} cpu-time")


def python_only(fn):
    def run():
        with _ext.python_only():
            return fn()
    return run


def packed_batch(rng, samples: int, qwen3: bool, merge: int = 2):
    """A packed row of real-shaped Qwen-VL samples: chat text, 1-4 images of up to 28x28 merged
    patches, some videos of 2-8 temporal patches (Qwen3-VL: timestamp text before every frame)."""
    ids, cu, images, videos, secs = [], [0], [], [], []
    for _ in range(samples):
        for _turn in range(int(rng.integers(1, 4))):
            ids += rng.integers(0, 150_000, int(rng.integers(20, 300))).tolist()
            for _img in range(int(rng.integers(0, 3))):
                h, w = (int(rng.integers(4, 29)) * merge for _ in range(2))
                images.append([1, h, w])
                ids += [VSTART] + [IMAGE] * (h * w // merge**2) + [VEND]
            if rng.random() < 0.3:
                t, h, w = int(rng.integers(2, 9)), int(rng.integers(4, 17)) * merge, int(rng.integers(4, 17)) * merge
                videos.append([t, h, w])
                secs.append(float(rng.choice([0.5, 1.0, 2.0])))
                if qwen3:
                    for _f in range(t):
                        ids += rng.integers(0, 150_000, 4).tolist() + [VSTART] + [VIDEO] * (h * w // merge**2) + [VEND]
                else:
                    ids += [VSTART] + [VIDEO] * (t * h * w // merge**2) + [VEND]
        cu.append(len(ids))
    grid = lambda rows: torch.tensor(rows, dtype=torch.long).reshape(-1, 3) if rows else None  # noqa: E731
    return torch.tensor(ids).unsqueeze(0), torch.tensor(cu, dtype=torch.int32), grid(images), grid(videos), secs


def bench_positions(rng, samples, rounds, qwen3):
    ids, cu, img, vid, secs = packed_batch(rng, samples, qwen3)
    kw = dict(input_ids=ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2, cu_seqlens=cu,
              image_grid_thw=img)
    if qwen3:
        from megatron_vlm.models.qwen3_vl.model import split_video_grids
        kw.update(tokens_per_second=1.0, video_grid_thw=split_video_grids(vid))
    else:
        kw.update(tokens_per_second=2.0, video_grid_thw=vid, second_per_grid_ts=torch.tensor(secs) if secs else None)
    fast = lambda: get_mrope_position_ids(**kw)  # noqa: E731
    slow = python_only(fast)
    a, b = fast(), slow()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    name = f"position ids {'Qwen3-VL' if qwen3 else 'Qwen2.5-VL'} ({samples} samples, {ids.shape[1]} tok)"
    row(name, *interleaved(fast, slow, rounds), "C++", "Python")


def bench_packing(rng, n, rounds):
    lengths = np.concatenate([rng.integers(80, 1200, n - n // 8), rng.integers(2000, 16_000, n // 8)])
    order = rng.permutation(lengths.size)
    fast = lambda: first_fit_pack(lengths, order, 16_384, 64)  # noqa: E731
    slow = python_only(fast)
    assert fast() == slow()
    row(f"first-fit packing ({n} samples, 16k budget)", *interleaved(fast, slow, rounds), "C++", "Python")


def bench_routing(device, n, e, k, rounds):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, e, generator=g).to(device)
    bias = (torch.randn(e, generator=g) * 0.05).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    label = "CUDA" if device == "cuda" else "C++"
    for name, kw in (("softmax", dict(score_func="softmax")),
                     ("sigmoid+bias, 8 groups keep 4", dict(score_func="sigmoid", bias=bias, n_group=8, topk_group=4))):
        fast = lambda: csrc_moe.moe_topk_gating(logits, k, **kw)  # noqa: E731
        slow = lambda: ref_gating(logits, k, **kw)  # noqa: E731
        assert torch.equal(fast()[2], slow()[2])
        row(f"top-{k} gating {name} ({n}x{e}, {device})", *interleaved(fast, slow, rounds, sync), label, "torch")
    ids = ref_gating(logits, k)[2]
    hidden = torch.randn(n, 16, device=device)  # narrow rows: time the index work, not the copy
    fast = lambda: csrc_moe.moe_permute(hidden, ids, num_experts=e)  # noqa: E731
    slow = lambda: ref_permute(hidden, ids, num_experts=e)  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(fast(), slow()))
    row(f"moe_permute indices+counts ({n}x top-{k} of {e}, {device})", *interleaved(fast, slow, rounds, sync),
        label, "torch")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds (smoke test)")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    if not _ext.available():
        print(f"megatron_vlm._C is not available ({_ext.unavailable_reason()}); nothing to compare")
        return
    rounds = args.rounds or (3 if args.quick else 30)
    rng = np.random.default_rng(0)
    torch.set_num_threads(torch.get_num_threads())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, CUDA in _C: {bool(_ext.load().with_cuda)}")
    bench_positions(rng, 4 if args.quick else 32, rounds, qwen3=False)
    bench_positions(rng, 4 if args.quick else 32, rounds, qwen3=True)
    bench_packing(rng, 2_000 if args.quick else 100_000, max(2, rounds // 3))
    bench_routing("cpu", 256 if args.quick else 8192, 128, 8, rounds)
    if torch.cuda.is_available() and not args.quick:
        if _ext.load().with_cuda:
            bench_routing("cuda", 8192, 128, 8, 100)
        else:
            print("CUDA routing: skipped, megatron_vlm._C was built without its CUDA sources")
    else:
        print("CUDA routing: skipped (no CUDA device)" if not args.quick else "CUDA routing: skipped (--quick)")


if __name__ == "__main__":
    main()
