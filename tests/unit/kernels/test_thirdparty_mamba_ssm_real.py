"""The mamba-ssm adapter (`kernels/thirdparty/mamba_ssm.py`) against the real package's Triton kernels, run on
the CPU by Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).

test_thirdparty_mamba_ssm.py checks the adapter against stand-ins written here from mamba-ssm's documented
interfaces; this file runs the package's own `mamba_chunk_scan_combined` (forward and backward: chunk cumsum,
chunk state, state passing, chunk scan, their backward kernels) and `selective_state_update`, so an argument
the adapter translates wrongly (a layout, a per-head vs per-channel parameter, seq_idx, varlen states) shows
as a wrong number, against our reference (kernels/reference/ssd.py), never against our own reading.

The package is installed without its CUDA extension (scripts/setup_dev.sh: MAMBA_SKIP_CUDA_BUILD=TRUE) and its Mamba-2
modules are imported without its `__init__` (megatron_vlm/testing/mamba_ssm_triton.py says why). Three
things the interpreter cannot do are stood in for, none of which changes a computed value:
`torch.cuda.device(None)` for CPU tensors is a no-op context (a CUDA tensor's index is never None); the SM
count that `_chunk_state_bwd_db` reads (it only splits the dB reduction over programs) is an H100's 132;
each autotuned kernel keeps one config, its smallest blocks (the interpreter cannot time configs; any config computes
the same numbers, and the interpreter's time grows with the block: the first configs' 128 x 256 x 64 blocks, mostly
masked on these sizes, cost several times the smallest ones). bf16 is not tested here: the interpreter's `tl.dot` on bf16 operands returns garbage (a bare
bf16 `tl.dot` kernel does too); the GPU test (tests/gpu/test_gpu_thirdparty_mamba_ssm.py) covers it.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import types

import pytest
import torch

from megatron_vlm.kernels.reference import ssd as reference
from megatron_vlm.kernels.thirdparty import mamba_ssm as adapter
from megatron_vlm.testing import mamba_ssm_triton

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not mamba_ssm_triton.installed(),
    reason="mamba-ssm's Python part is not installed (scripts/setup_dev.sh installs it)" if not mamba_ssm_triton.installed()
    else "on CUDA the GPU test runs the compiled kernels")

_MODULES = ("ssd_bmm", "ssd_chunk_state", "ssd_state_passing", "ssd_chunk_scan", "ssd_combined", "selective_state_update")


def _block_elements(config) -> int:
    """The elements of one program's blocks under an autotune config (its BLOCK_SIZE_* keyword arguments)."""
    return math.prod(v for k, v in config.kwargs.items() if k.startswith("BLOCK_SIZE"))


@pytest.fixture(scope="module")
def real_kernels():
    import triton

    with mamba_ssm_triton.triton_only_package(), pytest.MonkeyPatch.context() as mp:
        device, properties = torch.cuda.device, torch.cuda.get_device_properties
        mp.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext() if index is None else device(index))
        mp.setattr(torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(multi_processor_count=132)
                   if d is not None and torch.device(d).type == "cpu" else properties(d))
        tuned = 0
        for name in _MODULES:
            module = importlib.import_module(f"mamba_ssm.ops.triton.{name}")
            for kernel in vars(module).values():
                if isinstance(kernel, triton.runtime.autotuner.Autotuner):
                    mp.setattr(kernel, "configs", [min(kernel.configs, key=_block_elements)])
                    tuned += 1
        assert tuned > 10, "mamba-ssm's autotuned kernels were not found: has the package moved them?"
        yield


def _inputs(batch, total, heads=4, headdim=8, groups=2, dstate=16, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt).requires_grad_(grad)

    x, dt = r(batch, total, heads, headdim), r(batch, total, heads, scale=0.5)
    A = (-torch.rand(heads, generator=g) - 0.1).requires_grad_(grad)
    B, C = r(batch, total, groups, dstate, scale=0.3), r(batch, total, groups, dstate, scale=0.3)
    extra = dict(D=r(heads, dt=torch.float32), z=r(batch, total, heads, headdim), dt_bias=r(heads, scale=0.3, dt=torch.float32))
    return (x, dt, A, B, C), extra


def _close(a, b, rtol=1e-4):
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * max(b.abs().max().item(), 1.0))


def test_batched_scan_states_limit_and_gradients(real_kernels):
    """Batch rows with initial states, final states and a dt clamp (a chunk split mid-sequence): outputs and
    the gradients of every input, the initial states' included, through both outputs."""
    args, extra = _inputs(2, 21, grad=True)
    init = (torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(1)) * 0.1).requires_grad_(True)
    kw = dict(chunk_size=8, initial_states=init, return_final_states=True, dt_limit=(0.05, 1.5), **extra)
    y, final = adapter.ssd_chunk_scan(*args, **kw)
    y_ref, final_ref = reference.ssd_chunk_scan(*args, **kw)
    _close(y, y_ref)
    _close(final, final_ref)
    assert final.dtype == torch.float32
    w, wf = torch.randn_like(y), torch.randn_like(final)
    leaves = [*args, *extra.values(), init]
    ours = torch.autograd.grad((y * w).sum() + (final * wf).sum(), leaves)
    ref = torch.autograd.grad((y_ref * w).sum() + (final_ref * wf).sum(), leaves)
    for a, b in zip(ours, ref):
        _close(a, b)


def test_packed_scan_gradients_and_per_sequence_states(real_kernels):
    """Packed sequences (cu_seqlens -> seq_idx; sequences end inside chunks and across chunk edges): outputs and
    gradients; then, without gradients (rollout prefill), one final state per sequence (varlen states)."""
    args, extra = _inputs(1, 40, grad=True)
    cu = torch.tensor([0, 9, 27, 40], dtype=torch.int32)
    y = adapter.ssd_chunk_scan(*args, chunk_size=16, cu_seqlens=cu, **extra)
    y_ref = reference.ssd_chunk_scan(*args, chunk_size=16, cu_seqlens=cu, **extra)
    _close(y, y_ref)
    w = torch.randn_like(y)
    leaves = [*args, *extra.values()]
    for a, b in zip(torch.autograd.grad((y * w).sum(), leaves), torch.autograd.grad((y_ref * w).sum(), leaves)):
        _close(a, b)
    with torch.no_grad():
        y, finals = adapter.ssd_chunk_scan(*args, chunk_size=16, cu_seqlens=cu, return_final_states=True, **extra)
        y_ref, finals_ref = reference.ssd_chunk_scan(*args, chunk_size=16, cu_seqlens=cu, return_final_states=True,
                                                     **extra)
    _close(y, y_ref)
    assert finals.shape == finals_ref.shape == (3, 4, 8, 16)
    _close(finals, finals_ref)


def test_fp16_scan(real_kernels):
    args, extra = _inputs(2, 19, dtype=torch.float16)
    with torch.no_grad():
        y = adapter.ssd_chunk_scan(*args, chunk_size=8, **extra)
        y_ref = reference.ssd_chunk_scan(*args, chunk_size=8, **extra)
    assert y.dtype == torch.float16
    _close(y.float(), y_ref.float(), rtol=2e-3)


@pytest.mark.parametrize("per_channel_d,dt_limit", [(False, (0.0, math.inf)), (True, (0.0, math.inf)),
                                                    (False, (0.6, math.inf)), (False, (0.0, 0.7))])
def test_decoding_steps_follow_the_scan(real_kernels, per_channel_d, dt_limit):
    """Token-by-token `selective_state_update` (per-head dt / A / dt_bias expanded per channel by the adapter)
    gives the scan's outputs and leaves its final state in place; with a dt clamp (Nemotron-H's is
    (time_step_min, inf)), which the adapter applies itself, the scan's clamped outputs."""
    (x, dt, A, B, C), extra = _inputs(3, 6)
    extra["dt_limit"] = dt_limit
    if per_channel_d:
        extra["D"] = extra["D"][:, None].repeat(1, 8) + torch.linspace(0, 0.5, 8)
    state = torch.zeros(3, 4, 8, 16)
    ys = [adapter.ssd_state_update(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=extra["D"], z=extra["z"][:, t],
                                   dt_bias=extra["dt_bias"], dt_limit=dt_limit) for t in range(6)]
    if per_channel_d:  # the scan takes D per head only: the reference's single step is the yardstick
        ref_state, ref = torch.zeros(3, 4, 8, 16), []
        for t in range(6):
            ref.append(reference.ssd_state_update(ref_state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=extra["D"],
                                                  z=extra["z"][:, t], dt_bias=extra["dt_bias"], dt_limit=dt_limit))
        y_ref, final_ref = torch.stack(ref, 1), ref_state
    else:
        y_ref, final_ref = reference.ssd_chunk_scan(x, dt, A, B, C, chunk_size=4, return_final_states=True, **extra)
    _close(torch.stack(ys, 1), y_ref)
    _close(state, final_ref)


def test_the_mixers_strided_views(real_kernels):
    """x, B, C as the Mamba2 mixer passes them: views of one conv output split along its last dim, so their time
    strides are the whole conv width; dt a view of the in_proj output. Forward and gradients."""
    g = torch.Generator().manual_seed(7)
    heads, headdim, groups, dstate, total = 4, 8, 2, 16, 23
    inner, gn = heads * headdim, groups * dstate
    xbc = torch.randn(2, total, inner + 2 * gn, generator=g).requires_grad_(True)
    proj = torch.randn(2, total, 3 + heads, generator=g).requires_grad_(True)
    xs, B, C = xbc.split([inner, gn, gn], -1)
    args = (xs.reshape(2, total, heads, headdim), proj[..., 3:], -torch.rand(heads, generator=g) - 0.1,
            (B * 0.3).reshape(2, total, groups, dstate), (C * 0.3).reshape(2, total, groups, dstate))
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    kw = dict(chunk_size=8, D=torch.randn(heads, generator=g), dt_bias=torch.randn(heads, generator=g) * 0.3)
    y = adapter.ssd_chunk_scan(*args, **kw)
    y_ref = reference.ssd_chunk_scan(*args, **kw)
    _close(y, y_ref)
    w = torch.randn_like(y)
    ours = torch.autograd.grad((y * w).sum(), [xbc, proj], retain_graph=True)  # the split views' graph is shared
    for a, b in zip(ours, torch.autograd.grad((y_ref * w).sum(), [xbc, proj])):
        _close(a, b)


def test_decoding_step_without_d_or_dt_bias(real_kernels):
    (x, dt, A, B, C), _ = _inputs(2, 1)
    state = torch.randn(2, 4, 8, 16) * 0.1
    ref_state = state.clone()
    y = adapter.ssd_state_update(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    _close(y, reference.ssd_state_update(ref_state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0]))
    _close(state, ref_state)


@pytest.fixture
def mamba_ssm_backend(real_kernels, monkeypatch):
    """The adapter as a backend the CPU may run (the registered one checks for CUDA), for this test only."""
    from megatron_vlm.kernels.registry import DEFAULT_REGISTRY, Backend

    for op in ("ssd_chunk_scan", "ssd_state_update"):
        monkeypatch.setitem(DEFAULT_REGISTRY.backends[op], "mamba_ssm_interpreted",
                            Backend("mamba_ssm_interpreted", f"megatron_vlm.kernels.thirdparty.mamba_ssm:{op}"))
    DEFAULT_REGISTRY.clear_cache()
    yield {"ssd_chunk_scan": "mamba_ssm_interpreted", "ssd_state_update": "mamba_ssm_interpreted"}
    DEFAULT_REGISTRY.clear_cache()


def test_a_nemotron_h_mixer_on_the_real_kernels(mamba_ssm_backend):
    """Our Mamba2 mixer (Nemotron-H's; dt clamped below at time_step_min) with its SSD ops on mamba-ssm's kernels
    through the registry, against the same mixer on the torch references: a left-padded batch, a packed batch and
    its parameter gradients, and decoding (a prefill, then one token per step) with its states."""
    from megatron_vlm import kernels
    from megatron_vlm.models.common.mamba2 import Mamba2Mixer, Mamba2State

    torch.manual_seed(0)
    mixer = Mamba2Mixer(32, num_heads=4, head_dim=8, state_size=16, n_groups=2, chunk_size=8, time_step_min=0.05)
    with torch.no_grad():
        mixer.dt_bias.uniform_(-2.0, 0.5)  # softplus(dt + dt_bias) falls under time_step_min for some tokens
    torch_ops = {"ssd_chunk_scan": "torch", "ssd_state_update": "torch"}
    x = torch.randn(2, 13, 32)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :4] = False

    def run(ops):
        with kernels.use_backends(ops):
            batched = mixer(x, attention_mask=mask)
            packed = mixer(x.reshape(1, 26, 32), cu_seqlens=torch.tensor([0, 9, 26], dtype=torch.int32))
            grads = torch.autograd.grad(packed.square().sum(), [mixer.in_proj.weight, mixer.A_log, mixer.dt_bias, mixer.D])
            state = Mamba2State.zeros(mixer, 2)
            with torch.no_grad():
                steps = [mixer(x[:, :5], state=state)] + [mixer(x[:, t:t + 1], state=state) for t in range(5, 8)]
            return batched, packed, grads, torch.cat(steps, 1), state

    calls = []
    with pytest.MonkeyPatch.context() as mp:  # count the package's calls: nothing may fall back to the reference
        for module, name in (("ssd_combined", "mamba_chunk_scan_combined"), ("selective_state_update", "selective_state_update")):
            mod = importlib.import_module(f"mamba_ssm.ops.triton.{module}")
            fn = getattr(mod, name)
            mp.setattr(mod, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
        adapter._logged.clear()
        ours = run(mamba_ssm_backend)
    assert calls == ["mamba_chunk_scan_combined"] * 3 + ["selective_state_update"] * 3 and not adapter._logged
    ref = run(torch_ops)
    for a, b in zip([*ours[:2], *ours[2], ours[3], ours[4].conv_state, ours[4].ssm_state],
                    [*ref[:2], *ref[2], ref[3], ref[4].conv_state, ref[4].ssm_state]):
        _close(a, b)
