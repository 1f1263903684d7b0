"""`TokenLogprobModel` on the CPU runs the fused log-prob in ~2 MB row chunks (training/lm_loss.py): the
log-probs, entropies and gradients equal one unchunked block of the same kernel and the plain
log_softmax of full logits."""
import torch

from megatron_vlm import kernels
from megatron_vlm.training.lm_loss import CPU_MIN_ROWS, cpu_chunk_rows


def test_cpu_chunk_rows():
    h = torch.zeros(3, 8)
    assert cpu_chunk_rows(h, 1024) == 512  # 512 x 1024 fp32 = 2 MiB
    assert cpu_chunk_rows(h, 151936) == CPU_MIN_ROWS  # large vocabularies: matmuls of at least 256 rows
    assert cpu_chunk_rows(torch.zeros(3, 8, device="meta"), 1024) is None  # not the CPU: the kernel's default


def _run(hidden, weight, labels, chunk):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = kernels.linear_token_logprobs(h, w, labels, temperature=0.7, return_entropy=True, chunk_size=chunk)
    gl, ge = torch.linspace(-1, 1, logp.numel()), torch.linspace(0.5, -0.5, ent.numel())
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def test_chunked_equals_one_block_and_full_logits():
    g = torch.Generator().manual_seed(0)
    n, dim, vocab = 1300, 32, 1024  # not a multiple of the 512-row chunk
    hidden, weight = torch.randn(n, dim, generator=g), torch.randn(vocab, dim, generator=g) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    chunk = cpu_chunk_rows(hidden, vocab)
    assert chunk < n
    got, one = _run(hidden, weight, labels, chunk), _run(hidden, weight, labels, n)
    for a, b in zip(got, one):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # and the plain formula on full logits
    h, w = hidden.clone().double().requires_grad_(), weight.clone().double().requires_grad_()
    logits = (h @ w.t()) / 0.7
    logsm = torch.log_softmax(logits, -1)
    valid = labels != -100
    ref_logp = torch.where(valid, logsm.gather(1, labels.clamp_min(0)[:, None]).squeeze(1), 0.0)
    ref_ent = torch.where(valid, -(logsm.exp() * logsm).sum(-1), 0.0)
    torch.testing.assert_close(got[0].double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1].double(), ref_ent, atol=1e-5, rtol=0)
