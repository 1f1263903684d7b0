"""Mamba2 mixer: parity with transformers' NemotronHMamba2Mixer, decoding state, packing, padding."""
import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from megatron_vlm.models.common.mamba2 import Mamba2Mixer, Mamba2State

CFG = dict(hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2, conv_kernel=4,
           chunk_size=4, use_conv_bias=True, layer_norm_epsilon=1e-5, layers_block_type=["linear_attention"])


def build_pair(seed=0):
    torch.manual_seed(seed)
    hf = NemotronHMamba2Mixer(NemotronHConfig(**CFG), layer_idx=0).eval()
    with torch.no_grad():  # randomise everything, norms and per-head params included
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.rand(4).log())
        hf.dt_bias.copy_(torch.randn(4) * 0.5)
    ours = Mamba2Mixer(32, num_heads=4, head_dim=8, state_size=6, n_groups=2, conv_kernel=4, chunk_size=4,
                       norm_eps=1e-5, time_step_min=NemotronHConfig(**CFG).time_step_min)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours.eval()


@pytest.mark.parametrize("T", [1, 5, 11])
def test_mixer_matches_transformers(T):
    hf, ours = build_pair(T)
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-4, atol=1e-4)


def test_mixer_left_padding_matches_transformers_and_unpadded():
    hf, ours = build_pair(1)
    x = torch.randn(2, 9, 32)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        out = ours(x, attention_mask=mask)
        torch.testing.assert_close(out, hf(x, attention_mask=mask), rtol=1e-4, atol=1e-4)
        # the real tokens of the padded row equal the row run alone
        torch.testing.assert_close(out[0, 3:], ours(x[:1, 3:])[0], rtol=1e-5, atol=1e-5)


def test_mixer_step_decoding_equals_forward():
    _, ours = build_pair(2)
    x = torch.randn(3, 10, 32)
    with torch.no_grad():
        full = ours(x)
        state = Mamba2State.zeros(ours, 3)
        prefill = ours(x[:, :6], state=state)
        steps = [ours(x[:, t : t + 1], state=state) for t in range(6, 10)]
    torch.testing.assert_close(torch.cat([prefill, *steps], 1), full, rtol=1e-5, atol=1e-5)
    # state after one token-at-a-time pass from scratch also matches
    with torch.no_grad():
        state2 = Mamba2State.zeros(ours, 3)
        outs = [ours(x[:, t : t + 1], state=state2) for t in range(10)]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state2.ssm_state, state.ssm_state, rtol=1e-5, atol=1e-5)


def test_mixer_packed_equals_separate_and_grads_flow():
    _, ours = build_pair(3)
    lens = [3, 7, 1]
    xs = [torch.randn(1, n, 32) for n in lens]
    cu = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    packed = torch.cat(xs, 1).requires_grad_(True)
    out = ours(packed, cu_seqlens=cu)
    for i, x in enumerate(xs):
        torch.testing.assert_close(out[:, cu[i] : cu[i + 1]], ours(x), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert packed.grad is not None and torch.isfinite(packed.grad).all()
    assert all(p.grad is not None for p in ours.parameters())


def test_state_repeat_interleave():
    _, ours = build_pair(4)
    state = Mamba2State.zeros(ours, 2)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ours(x, state=state)
        big = state.repeat_interleave(3)
        nxt = torch.randn(2, 1, 32).repeat_interleave(3, 0)
        out_big = ours(nxt, state=big)
        out = ours(nxt[::3], state=state)
    torch.testing.assert_close(out_big[::3], out)
    torch.testing.assert_close(out_big[1::3], out)
