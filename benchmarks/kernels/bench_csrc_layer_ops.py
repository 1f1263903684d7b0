"""Fused CPU layer ops of megatron_vlm._C (the `csrc` backend) vs the torch references and torch's own ops, one process.

Ops: rms_norm (plain and with the fused residual add), swiglu, apply_rotary, packed-varlen attention and
linear_token_logprobs (forward + backward at the training shape), and rms_norm / swiglu / apply_rotary /
decode_attention at the decode shape (forward). Shapes: those of the GRPO
step of benchmarks/trl_grpo.py (tiny Qwen2, hidden 256, MLP 768, 4 / 2 heads of 64): 2,206 packed tokens in
the update, 64 rows x 1 token per decoding step, 48 cached keys. Baselines: the torch reference each op
replaces (`kernels/reference/`, the CPU backend before this one) and, where torch has one, the fused torch op a
user would call instead (F.rms_norm; F.silu(gate) * up); for attention the sdpa backend (torch's flash SDPA on a padded batch), which
`auto` took on the CPU before.

Method: interleaved rounds (bench_csrc.interleaved: A, B, A, B, ... after a warm-up) so drifting load hits both;
wall min / median per call and the ratios of the medians, of the mins and of the process CPU time. Each pair is
checked close (fp32 rounding) before timing. One torch thread unless --threads.
`--quick`: tiny shapes and few rounds (a smoke test that the script runs; not a measurement).
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_csrc import interleaved, row  # noqa: E402

from megatron_vlm import _ext  # noqa: E402


def fwd_bwd(fn, inputs):
    """Forward + backward of fn() with a fixed cotangent (what a training step runs per call)."""
    def run():
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs])
    return run


def check_close(a, b, what):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    for x, y in zip(a, b):
        err = (x.double() - y.double()).abs().max().item()
        if err > 1e-5 * max(y.abs().max().item(), 1.0):
            raise SystemExit(f"{what}: csrc and the reference differ by {err}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if _ext.load() is None:
        print(f"skipped: megatron_vlm._C is not available ({_ext.unavailable_reason()})")
        return 0
    torch.set_num_threads(args.threads)
    ops = importlib.import_module("megatron_vlm.kernels.csrc.layer_ops")
    ref_norms = importlib.import_module("megatron_vlm.kernels.reference.norms")
    ref_swiglu = importlib.import_module("megatron_vlm.kernels.reference.swiglu")
    ref_rotary = importlib.import_module("megatron_vlm.kernels.reference.rotary")
    ref_decode = importlib.import_module("megatron_vlm.kernels.reference.decode_attention")
    ref_logprobs = importlib.import_module("megatron_vlm.kernels.reference.token_logprobs")
    sdpa = importlib.import_module("megatron_vlm.kernels.sdpa.attention")
    csrc_attention = importlib.import_module("megatron_vlm.kernels.csrc.attention")
    csrc_logprobs = importlib.import_module("megatron_vlm.kernels.csrc.token_logprobs")
    rounds = 3 if args.quick else args.rounds
    tokens, hidden, ffn, heads, kv_heads, dim, batch, keys = 2206, 256, 768, 4, 2, 64, 64, 48
    if args.quick:
        tokens, hidden, ffn, batch, keys = 40, 32, 64, 4, 6
    g = torch.Generator().manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    print(f"torch {torch.__version__}, {args.threads} thread(s); ratios: csrc faster when > 1")
    x, r, w = randn(tokens, hidden, grad=True), randn(tokens, hidden, grad=True), randn(hidden, grad=True)
    gate, up = randn(tokens, ffn, grad=True), randn(tokens, ffn, grad=True)
    xr, cos, sin = randn(tokens, heads, dim, grad=True), randn(tokens, dim), randn(tokens, dim)
    # the GRPO update's pack: 8 prompts of 15 tokens, 64 completions of 31 tokens after their prompt's 15 keys
    lens_q, lens_k = [15] * 8 + [31] * 64, [15] * 8 + [46] * 64
    if args.quick:
        lens_q, lens_k = [5, 7], [5, 9]

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    qa, ka, va = randn(sum(lens_q), heads, dim, grad=True), randn(sum(lens_k), kv_heads, dim, grad=True), randn(
        sum(lens_k), kv_heads, dim, grad=True)
    vocab = 1024 if not args.quick else 64
    hl, wl = randn(2048 if not args.quick else 40, hidden, grad=True), randn(vocab, hidden, grad=True)
    labels = torch.randint(0, vocab, (hl.shape[0],), generator=g)
    training = [
        (f"attention varlen fwd+bwd {len(lens_q)} samples ({sum(lens_q)} q)",
         lambda: csrc_attention.attention(qa, ka, va, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
         {"sdpa": lambda: sdpa.attention(qa, ka, va, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)}, (qa, ka, va)),
        (f"token logprobs+entropy fwd+bwd [{hl.shape[0]}, V={vocab}]",
         lambda: csrc_logprobs.linear_token_logprobs(hl, wl, labels, return_entropy=True, chunk_size=512),
         {"reference": lambda: ref_logprobs.linear_token_logprobs(hl, wl, labels, return_entropy=True, chunk_size=512)},
         (hl, wl)),
        (f"rms_norm fwd+bwd [{tokens}, {hidden}]", lambda: ops.rms_norm(x, w, 1e-6),
         {"reference": lambda: ref_norms.rms_norm(x, w, 1e-6), "F.rms_norm": lambda: F.rms_norm(x, (hidden,), w, 1e-6)},
         (x, w)),
        (f"rms_norm + residual fwd+bwd [{tokens}, {hidden}]", lambda: ops.rms_norm(x, w, 1e-6, residual=r),
         {"reference": lambda: ref_norms.rms_norm(x, w, 1e-6, residual=r)}, (x, r, w)),
        (f"swiglu fwd+bwd [{tokens}, {ffn}]", lambda: ops.swiglu(gate, up),
         {"reference": lambda: ref_swiglu.swiglu(gate, up), "F.silu * up": lambda: F.silu(gate) * up}, (gate, up)),
        (f"apply_rotary fwd+bwd [{tokens}, {heads}, {dim}]", lambda: ops.apply_rotary(xr, cos, sin),
         {"reference": lambda: ref_rotary.apply_rotary(xr, cos, sin)}, (xr,)),
    ]
    for name, ours, baselines, inputs in training:
        for label, base in baselines.items():
            check_close(ours(), base(), name)
            ta, tb, cpu = interleaved(fwd_bwd(ours, inputs), fwd_bwd(base, inputs), rounds)
            row(name[:58], ta, tb, cpu, "csrc", label[:10])
    with torch.no_grad():
        xd, rd, gd, ud = randn(batch, 1, hidden), randn(batch, 1, hidden), randn(batch, 1, ffn), randn(batch, 1, ffn)
        qk, cd, sd = randn(batch, 1, heads + kv_heads, dim), randn(batch, 1, dim), randn(batch, 1, dim)
        q = randn(batch, heads, dim)
        kc, vc = randn(batch + 1, keys + 5, kv_heads, dim), randn(batch + 1, keys + 5, kv_heads, dim)
        seqlens = torch.full((batch,), keys)
        decode = [
            (f"decode rms_norm + residual [{batch}, 1, {hidden}]", lambda: ops.rms_norm(xd, w, 1e-6, residual=rd),
             {"reference": lambda: ref_norms.rms_norm(xd, w, 1e-6, residual=rd)}),
            (f"decode swiglu [{batch}, 1, {ffn}]", lambda: ops.swiglu(gd, ud),
             {"reference": lambda: ref_swiglu.swiglu(gd, ud), "F.silu * up": lambda: F.silu(gd) * ud}),
            (f"decode apply_rotary [{batch}, 1, {heads + kv_heads}, {dim}]", lambda: ops.apply_rotary(qk, cd, sd),
             {"reference": lambda: ref_rotary.apply_rotary(qk, cd, sd)}),
            (f"decode_attention B={batch} {heads}/{kv_heads} heads {keys} keys",
             lambda: ops.decode_attention(q, kc, vc, seqlens, max_seqlen_k=keys),
             {"reference": lambda: ref_decode.decode_attention(q, kc, vc, seqlens, max_seqlen_k=keys)}),
        ]
        for name, ours, baselines in decode:
            for label, base in baselines.items():
                check_close(ours(), base(), name)
                calls = 20

                def many(fn=ours):
                    for _ in range(calls):
                        fn()

                def many_base(fn=base):
                    for _ in range(calls):
                        fn()
                ta, tb, cpu = interleaved(many, many_base, rounds)
                row(f"{name} (x{calls})"[:58], ta, tb, cpu, "csrc", label[:10])
    return 0


if __name__ == "__main__":
    sys.exit(main())
