"""Vocabulary-parallel token log-probs with masked ids (tp = 2, each rank holding half of the LM head rows and
masking its own share of the ids) against a plain masked log_softmax over the full logits: values, entropies
and the gradient of the hidden states (summed over the tp ranks)."""
from pathlib import Path

import pytest
import torch

from tests.integration.parallel.spawn import spawn

V, H, N = 40, 12, 19
MASKED = (3, 17, 22, 39)  # on both ranks' halves


def _plain(hidden, weight, labels, temperature):
    z = (hidden @ weight.T / temperature).index_fill(-1, torch.tensor(MASKED), float("-inf"))
    logq = torch.log_softmax(z, -1)
    ent = -(logq.exp() * logq.masked_fill(torch.isinf(logq), 0.0)).sum(-1)
    valid = labels != -100
    lp = logq.gather(-1, torch.where(valid, labels, 0)[:, None]).squeeze(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _ranks(tmp: Path, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatron_vlm.parallel.tensor_parallel import vocab_parallel_token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    weight[list(MASKED)] *= 4.0  # the masked ids hold real mass
    labels = torch.randint(0, V, (N,), generator=g)
    labels = torch.where(torch.isin(labels, torch.tensor(MASKED)), 5, labels)
    labels[[1, 7]] = -100
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    w = distribute_tensor(weight, mesh, [Shard(0)])
    h = hidden.clone().requires_grad_(True)
    logp, ent = vocab_parallel_token_logprobs(h, w, labels, temperature=0.7, return_entropy=True,
                                              masked_token_ids=MASKED, chunk_size=8)
    (logp.sum() + 0.5 * ent[labels != -100].sum()).backward()
    h_ref = hidden.clone().requires_grad_(True)
    ref, ref_ent = _plain(h_ref, weight, labels, 0.7)
    (ref.sum() + 0.5 * ref_ent.sum()).backward()
    torch.testing.assert_close(logp.double(), ref, rtol=1e-5, atol=1e-5)
    valid = labels != -100  # (this function leaves the entropy of ignored rows as computed; nothing reads it)
    torch.testing.assert_close(ent.double()[valid], ref_ent[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-5)
    full = torch.log_softmax(hidden @ weight.T / 0.7, -1).gather(-1, torch.where(labels == -100, 0, labels)[:, None])[:, 0]
    assert (full - ref).abs().max() > 0.1  # the masked ids' mass is not negligible here


@pytest.mark.heavy  # two spawned processes (~15 s idle); the tp = 2 GRPO family test covers the path in CI
def test_vocab_parallel_logprobs_mask_ids_on_every_rank(tmp_path):
    spawn(tmp_path, _ranks)
