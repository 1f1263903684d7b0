"""Response-token log-probs from hidden states against full logits + log_softmax (pure torch), on a
packed batch of sequences with prompt and response tokens; gradients and bad layouts."""
import pytest
import torch

from megatron_vlm.data.batch import shifted_labels
from megatron_vlm.rl.logprobs import response_token_logprobs


def _reference(hidden, weight, ids, mask, cu, temperature):
    logits = hidden @ weight.T / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    p = logp_all.exp()
    out = torch.zeros(ids.shape[0], dtype=hidden.dtype)
    ent = torch.zeros(ids.shape[0], dtype=hidden.dtype)
    for s in range(len(cu) - 1):
        for t in range(cu[s] + 1, cu[s + 1]):
            if mask[t]:
                out[t] = logp_all[t - 1, ids[t]]
                ent[t] = -(p[t - 1] * logp_all[t - 1]).sum()
    return out, ent


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lens, prompt = [7, 5, 9], [3, 2, 4]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    n, h, v = cu[-1], 16, 37
    ids = torch.randint(0, v, (n,), generator=g)
    mask = torch.zeros(n, dtype=torch.bool)
    for s, p in enumerate(prompt):
        mask[cu[s] + p:cu[s + 1]] = True
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.3
    return hidden, weight, ids, mask, cu


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_logits(temperature):
    hidden, weight, ids, mask, cu = _batch()
    h = hidden.clone().requires_grad_(True)
    logp, ent = response_token_logprobs(h, weight, ids, mask, cu_seqlens=torch.tensor(cu), temperature=temperature, return_entropy=True)
    ref_h = hidden.clone().requires_grad_(True)
    ref, ref_ent = _reference(ref_h, weight, ids, mask, cu, temperature)
    torch.testing.assert_close(logp.to(ref.dtype), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.to(ref.dtype), ref_ent, rtol=1e-5, atol=1e-5)
    (logp * torch.arange(len(logp))).sum().backward()
    (ref * torch.arange(len(ref))).sum().backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-4, atol=1e-5)
    assert (logp[~mask] == 0).all()


def test_shifted_labels_stop_at_sequence_boundaries():
    ids = torch.tensor([10, 11, 12, 20, 21, 22])
    mask = torch.tensor([False, True, True, False, True, True])
    assert shifted_labels(ids, mask, torch.tensor([0, 3, 6])).tolist() == [11, 12, -100, 21, 22, -100]
    # without cu_seqlens the stream is one sequence
    assert shifted_labels(ids, mask).tolist() == [11, 12, -100, 21, 22, -100]


def test_bad_layouts():
    ids = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="first token"):
        shifted_labels(ids, torch.tensor([False, True, True, True]), torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        shifted_labels(ids, torch.tensor([False, True, False, False]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="bool"):
        shifted_labels(ids, torch.tensor([0, 1, 0, 0]))
    with pytest.raises(ValueError, match="hidden"):
        response_token_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), ids, torch.zeros(4, dtype=torch.bool))
