"""Mamba2 mixer split by heads for tensor parallelism (`Mamba2Mixer.tp_shard`): each tp rank runs its
block of heads / groups from the whole weights and returns the out_proj partial sum, so the ranks'
outputs add up to the unsplit mixer's output, on packed input, padded input and step-by-step decoding
(with the local-heads decoding state); each rank's gradient is non-zero on its own rows only and the
ranks' gradients add up to the unsplit one. The reference is the unsplit mixer (itself checked against
transformers' NemotronHMamba2Mixer in test_mamba2_mixer.py)."""
import copy

import pytest
import torch

from megatron_vlm.models.common.mamba2 import Mamba2Mixer, Mamba2State


def _mixer(bias: bool) -> Mamba2Mixer:
    torch.manual_seed(0)
    m = Mamba2Mixer(32, num_heads=4, head_dim=8, state_size=6, n_groups=2, conv_kernel=4, chunk_size=4,
                    use_bias=bias)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        m.A_log.copy_(torch.rand(4).log())
    return m


def _split(full: Mamba2Mixer, tp: int) -> list[Mamba2Mixer]:
    parts = []
    for r in range(tp):
        part = copy.deepcopy(full)
        part.tp_shard(tp, r)
        parts.append(part)
    return parts


@pytest.mark.parametrize("bias", [False, True])
def test_heads_split_sums_to_whole_mixer(bias):
    full = _mixer(bias)
    parts = _split(full, 2)
    x = torch.randn(1, 13, 32)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    ref = full(x, cu_seqlens=cu)
    got = sum(p(x, cu_seqlens=cu) for p in parts)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    ref.pow(2).sum().backward()
    got.pow(2).sum().backward()
    for name, p in full.named_parameters():
        grads = [dict(q.named_parameters())[name].grad for q in parts]
        grads = [torch.zeros_like(p) if g is None else g for g in grads]  # out_proj.bias: rank 0 adds it
        torch.testing.assert_close(sum(grads), p.grad, rtol=1e-4, atol=1e-5, msg=name)
    # rank 0 does not touch rank 1's heads: its grad of rank 1's in_proj dt rows and A_log is zero
    assert parts[0].A_log.grad[2:].abs().max() == 0 and parts[0].A_log.grad[:2].abs().max() > 0
    # padded batch
    xb, mask = torch.randn(2, 7, 32), torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7]).bool()
    torch.testing.assert_close(sum(p(xb, attention_mask=mask) for p in parts), full(xb, attention_mask=mask),
                               rtol=1e-5, atol=1e-5)


def test_decoding_state_holds_local_heads():
    full = _mixer(False)
    parts = _split(full, 2)
    x = torch.randn(2, 6, 32)
    ref_state = Mamba2State.zeros(full, 2)
    states = [Mamba2State.zeros(p, 2) for p in parts]
    assert states[0].ssm_state.shape[1] == 2 and states[0].conv_state.shape[1] == full.conv_dim // 2
    with torch.no_grad():
        ref = [full(x[:, :4], state=ref_state)] + [full(x[:, t:t + 1], state=ref_state) for t in (4, 5)]
        got = [sum(p(x[:, :4], state=s) for p, s in zip(parts, states))]
        got += [sum(p(x[:, t:t + 1], state=s) for p, s in zip(parts, states)) for t in (4, 5)]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tp_that_does_not_divide_groups_is_refused():
    with pytest.raises(ValueError, match="n_groups=2"):
        _mixer(False).tp_shard(4, 0)


def test_lora_adapters_split_with_the_heads():
    """LoRA on in_proj / out_proj: the ranks' outputs and factor gradients add up to the unsplit adapted mixer's
    (B non-zero, so a wrongly split factor shows); with the adapters off, the base mixer's output."""
    from megatron_vlm.models.common.lora import apply_lora, lora_disabled

    full = _mixer(True)
    apply_lora(full, ["in_proj", "out_proj"], r=3, alpha=6)
    with torch.no_grad():
        for n, p in full.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.3)
    parts = _split(full, 2)
    x = torch.randn(1, 9, 32)
    ref = full(x)
    got = sum(p(x) for p in parts)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), lora_disabled(full):
        base = full(x)
    assert (base - ref).abs().max() > 1e-3  # the adapters matter
    ref.pow(2).sum().backward()
    got.pow(2).sum().backward()
    for name, p in full.named_parameters():
        if "lora_" in name:
            grads = [dict(q.named_parameters())[name].grad for q in parts]
            torch.testing.assert_close(sum(grads), p.grad, rtol=1e-4, atol=1e-5, msg=name)
