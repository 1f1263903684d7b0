"""CPU decode attention: our `megatron_vlm::decode_attention` vs vLLM's `_C::cpu_attention_with_kv_cache`, one process.

Why: decode attention is where the rollout rows b / e lost most to vLLM's CPU build (benchmarks/RESULTS.md,
issue 39); this compares the two kernels alone at the rows' decode shapes. Run in the vLLM environment
(`PYTHONPATH=$PWD $(bash .ci/vllm_env.sh | tail -1) benchmarks/kernels/bench_cpu_decode_attention_vllm.py`).

Both read the same keys and values, each in its own cache layout (ours: slots [B, length, Hkv, D]; vLLM's:
blocks of 128 positions per kv head, its CPU default, ISA "vec", written by its `cpu_attn_reshape_and_cache`); the outputs are checked equal to
fp32 rounding first. Caches of 8 layers are cycled so each call reads its keys from memory, as in a decode
step of an 8-layer model. One torch thread; calls interleaved (ours, vLLM, ours, ...); per call the process
CPU time (other jobs' load does not count); min and median reported, and the ratio of the medians.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {  # name: (sequences, query heads, kv heads, head dim, cached keys[, shared prompt keys, samples per prompt])
    "row_b": (32, 12, 2, 64, 575),    # ~110M Qwen2, mid-decode of 4 x 512 + 128
    "row_e": (32, 12, 2, 64, 1000),   # the same model late in a 512-token decode
    "row_d": (64, 8, 2, 32, 100),     # the tiny MoE row
    "d128": (32, 8, 1, 128, 575),
    # the rows as a rollout has them: 4 prompts of 512 keys x G 8 samples. Both kernels get the sharing in their own
    # way: vLLM's block tables point the 8 samples at one copy of the prompt's blocks (its prefix cache), ours the
    # shared_prefix hint over per-slot copies (the engine's slot cache)
    "row_b_shared": (32, 12, 2, 64, 575, 512, 8),
    "row_e_shared": (32, 12, 2, 64, 1000, 512, 8),
}
LAYERS, BLOCK = 8, 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {','.join(SHAPES)} (default: all)")
    ap.add_argument("--rounds", type=int, default=None, help="passes over the 8 layers' caches (default 6)")
    ap.add_argument("--quick", action="store_true", help="smoke test: the smallest shape, one round (as every kernel "
                                                         "benchmark takes it: launch/slurm/bench_kernels.sbatch --quick)")
    args = ap.parse_args()
    shapes = (args.shapes or ("row_d" if args.quick else ",".join(SHAPES))).split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {','.join(SHAPES)}")
    rounds = args.rounds or (1 if args.quick else 6)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    torch.set_num_threads(1)
    try:
        import vllm._custom_ops as vops
    except ImportError as err:
        print(f"skipped: vLLM is not installed here ({err}); run it in the vLLM environment")
        return 0
    from megatron_vlm import _ext
    from megatron_vlm.kernels.csrc import layer_ops

    if _ext.load() is None:
        print(f"skipped: megatron_vlm._C is not available ({_ext.unavailable_reason()})")
        return 0
    print(f"torch {torch.__version__}, one thread, load {os.getloadavg()[0]:.1f}")
    for name in shapes:
        b, hq, hkv, d, n, shared, group = (SHAPES[name] + (0, 1))[:7]
        roots = torch.arange(b) // group * group
        g = torch.Generator().manual_seed(0)
        nb = -(-n // BLOCK)
        q = torch.randn(b, hq, d, generator=g)
        ours, theirs = [], []
        for _ in range(LAYERS):
            k, v = torch.randn(b, nb * BLOCK, hkv, d, generator=g), torch.randn(b, nb * BLOCK, hkv, d, generator=g)
            k[:, :shared], v[:, :shared] = k[roots, :shared], v[roots, :shared]  # each sample's copy of its prompt
            ours.append((k, v))
            kv = torch.zeros(b * nb, hkv, 2 * BLOCK, d)  # vLLM's CPU cache, written by its own op (its layout)
            kc, vc = kv.chunk(2, dim=2)
            vops.cpu_attn_reshape_and_cache(k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), kc, vc,
                                            torch.arange(b * nb * BLOCK), "vec")
            theirs.append((kc, vc))
        lens = torch.full((b,), n, dtype=torch.int32)
        qsl = torch.arange(b + 1, dtype=torch.int32)
        table = torch.arange(b * nb, dtype=torch.int32).reshape(b, nb)
        table[:, :shared // BLOCK] = table[roots, :shared // BLOCK].clone()  # one copy of each prompt's blocks
        hint = (roots, torch.full((b,), shared)) if shared else None
        meta = vops.cpu_attn_get_scheduler_metadata(
            num_reqs=b, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=lens, dtype=torch.float32,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False)
        out = torch.empty_like(q)

        def run_vllm(layer):
            kc, vc = theirs[layer]
            vops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=lens, scale=d ** -0.5,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                scheduler_metadata=meta, s_aux=None)
            return out

        def run_ours(layer):
            kc, vc = ours[layer]
            return layer_ops.decode_attention(q, kc, vc, lens, max_seqlen_k=n, shared_prefix=hint)

        err = (run_ours(0).double() - run_vllm(0).double()).abs().max().item()
        if err > 1e-5:
            raise SystemExit(f"{name}: ours and vLLM differ by {err}")
        times: dict[str, list[float]] = {"ours": [], "vllm": []}
        for r in range(rounds):
            for layer in range(LAYERS):
                for key in (("ours", "vllm") if (r + layer) % 2 == 0 else ("vllm", "ours")):
                    fn = run_ours if key == "ours" else run_vllm
                    t0 = time.process_time()
                    fn(layer)
                    times[key].append(time.process_time() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        flop = 4 * b * hq * n * d
        print(f"{name:6s} B={b} {hq}/{hkv} heads d={d} keys={n}: ours min {1e3 * min(times['ours']):.2f} / median "
              f"{1e3 * med['ours']:.2f} ms ({flop / med['ours'] / 1e9:.1f} GFLOP/s), vLLM min {1e3 * min(times['vllm']):.2f} / "
              f"median {1e3 * med['vllm']:.2f} ms; vLLM / ours time = {med['vllm'] / med['ours']:.2f}x "
              f"(max |diff| {err:.1e}; load {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
