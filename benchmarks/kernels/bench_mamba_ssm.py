"""mamba-ssm backends (`kernels/thirdparty/mamba_ssm.py`) vs our torch reference: the chunked SSD scan
(Nemotron-H training / prefill; forward, and backward with the graph retained) and the decoding step.

Why a script of its own: `auto` takes mamba-ssm (priority 20) on CUDA whenever it is installed, without a
measurement yet; these rows confirm that choice (or not) on a GPU. Shapes of the Nemotron-3-Nano Mamba2
layers (64 heads of 64, 8 groups, state 128, chunk 128): a packed 16k-token batch of 8 sequences (seq_idx
path) and one 8k sequence with initial / final states; decoding 256 sequences one token each. bf16
activations, fp32 A / D / dt_bias. mamba-ssm rows are 'n/a' with the reason when it or CUDA is missing.
"""
import importlib.util

import torch
from bench_attention import bench_pair
from common import Table, environment, measure_peaks, parse_args, try_bench

from megatron_vlm.kernels.reference import ssd as reference


def scan_inputs(batch, total, heads, headdim, groups, dstate, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dt).requires_grad_()

    x, dt = r(batch, total, heads, headdim), r(batch, total, heads, scale=0.5)
    A = (-torch.rand(heads, device=device, generator=g) - 0.1).requires_grad_()
    B, C = r(batch, total, groups, dstate, scale=0.3), r(batch, total, groups, dstate, scale=0.3)
    extra = dict(D=r(heads, dt=torch.float32), z=r(batch, total, heads, headdim), dt_bias=r(heads, scale=0.3, dt=torch.float32))
    return (x, dt, A, B, C), extra


def scan_flops(total, heads, headdim, dstate, chunk):
    """Matmul FLOPs of the chunked form: C.B^T scores and their product with x inside chunks, chunk states
    and their read-out (4 products of P x N or L x N per token and head)."""
    return total * heads * (2 * chunk * dstate + 2 * chunk * headdim + 4 * headdim * dstate)


def main():
    args = parse_args(__doc__.splitlines()[0])
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    table = Table(f"mamba-ssm backends ({environment()})", measure_peaks(device, quick))
    note = None
    if importlib.util.find_spec("mamba_ssm") is None:
        note = "mamba-ssm not installed"
    elif device != "cuda":
        note = "needs CUDA"
    impls = [("torch reference", reference)]
    if note is None:
        from megatron_vlm.kernels.thirdparty import mamba_ssm

        impls.append(("mamba_ssm", mamba_ssm))
    heads, headdim, groups, dstate, chunk = 64, 64, 8, 128, 128
    scan_cases = [("packed 8 x 2k (Nemotron-3-Nano Mamba2)", [2048] * 8, False),
                  ("one 8k sequence + states", [8192], True)]
    if quick:
        heads, headdim, groups, dstate, chunk = 4, 8, 2, 16, 16
        scan_cases = [("tiny packed 3 seqs", [5, 17, 42], False), ("tiny one sequence + states", [40], True)]
    for name, lengths, states in scan_cases:
        total = sum(lengths)
        args_, extra = scan_inputs(1, total, heads, headdim, groups, dstate, dtype, device)
        kw = dict(chunk_size=chunk, **extra)
        if len(lengths) > 1:
            kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        if states:
            kw["initial_states"] = torch.randn(1, heads, headdim, dstate, device=device) * 0.1
        inputs = (*args_, *extra.values())
        flops = scan_flops(total, heads, headdim, dstate, chunk)
        for impl, mod in impls:
            bench_pair(table, name, impl, lambda mod=mod: mod.ssd_chunk_scan(*args_, **kw), inputs, flops, device, quick)
        if note:
            table.add(name + " fwd", "mamba_ssm", None, note=note)

    batch = 8 if quick else 256
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, heads, headdim, device=device, generator=g).to(dtype)
    dt = torch.randn(batch, heads, device=device, generator=g).to(dtype)
    A = -torch.rand(heads, device=device, generator=g) - 0.1
    B, C = (torch.randn(batch, groups, dstate, device=device, generator=g).to(dtype) for _ in range(2))
    D, dt_bias = torch.randn(heads, device=device, generator=g), torch.randn(heads, device=device, generator=g)
    state = torch.zeros(batch, heads, headdim, dstate, device=device, dtype=dtype)
    state_bytes = 2 * state.numel() * state.element_size()  # read and write the cached state
    case = f"decode step, {batch} sequences"
    for impl, mod in impls:
        try_bench(table, case, impl, lambda mod=mod: mod.ssd_state_update(state, x, dt, A, B, C, D=D, dt_bias=dt_bias),
                  device, quick, bytes_moved=state_bytes)
    if note:
        table.add(case, "mamba_ssm", None, note=note)
    table.print()
    table.write_json(args.json)


if __name__ == "__main__":
    main()
