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


def _rounding_bounds(hidden, weight, labels, temperature=0.7):
    """How far two float32 evaluations of the same formulas may differ by rounding alone, per element of
    (log-probs, entropies, hidden grad, weight grad).

    Why not a fixed atol: the chunked and the one-block runs multiply matrices of other shapes, and the CPU BLAS
    picks its blocking (and the vector width of the capability torch dispatches to) by shape, so the order of
    the float32 sums differs: 2.1e-6 on a gradient element here. Bounds (eps = float32 eps; a K-term sum in any
    order: eps * sqrt(K) * sum of |terms|, the random-walk form of the recursive-sum bound, Higham, "Accuracy
    and Stability of Numerical Algorithms", 3.1 / 4.2): logits x = h w^T / T over `dim` terms; log-prob and
    entropy a few ulps of |x| and |logsumexp| plus a V-term sum; h.grad = dZ w and w.grad = dZ^T h over V and n
    terms, dZ the gradient of the test's loss with respect to the logits (float64)."""
    eps = torch.finfo(torch.float32).eps
    n, dim = hidden.shape
    vocab = weight.shape[0]
    h, w = hidden.double(), weight.double()
    logits = ((h @ w.t()) / temperature).requires_grad_()
    x_err = eps * dim ** 0.5 * (h.abs() @ w.abs().t()) / temperature  # rounding of the logits themselves
    logsm = torch.log_softmax(logits, -1)
    valid = labels != -100
    logp = torch.where(valid, logsm.gather(1, labels.clamp_min(0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(logsm.exp() * logsm).sum(-1), 0.0)
    gl, ge = torch.linspace(-1, 1, n, dtype=torch.float64), torch.linspace(0.5, -0.5, n, dtype=torch.float64)
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    dz = logits.grad.abs()
    lse = torch.logsumexp(logits.detach(), -1).abs()
    row_x = logits.detach().abs().amax(-1)
    per_row = eps * (4 * row_x + 4 * lse + vocab ** 0.5) + 2 * x_err.amax(-1)
    tol_logp = torch.where(valid, per_row, 0.0) + 1e-12
    tol_ent = torch.where(valid, per_row * (1 + row_x), 0.0) + 1e-12  # -sum p log p: the log-probs' error, weighted
    tol_h = 4 * eps * (vocab ** 0.5 * (dz @ w.abs()) / temperature + (dz * x_err).sum(-1, keepdim=True)) + 1e-12
    tol_w = 4 * eps * (n ** 0.5 * (dz.t() @ h.abs()) / temperature) + 1e-12
    return tol_logp, tol_ent, tol_h, tol_w


def test_chunked_equals_one_block_and_full_logits():
    g = torch.Generator().manual_seed(0)
    n, dim, vocab = 1300, 32, 1024  # not a multiple of the 512-row chunk
    hidden, weight = torch.randn(n, dim, generator=g), torch.randn(vocab, dim, generator=g) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    chunk = cpu_chunk_rows(hidden, vocab)
    assert chunk < n
    got, one = _run(hidden, weight, labels, chunk), _run(hidden, weight, labels, n)
    for a, b, tol in zip(got, one, _rounding_bounds(hidden, weight, labels)):
        assert bool(((a.double() - b.double()).abs() <= tol).all()), ((a.double() - b.double()).abs() / tol).max().item()
    # and the plain formula on full logits
    h, w = hidden.clone().double().requires_grad_(), weight.clone().double().requires_grad_()
    logits = (h @ w.t()) / 0.7
    logsm = torch.log_softmax(logits, -1)
    valid = labels != -100
    ref_logp = torch.where(valid, logsm.gather(1, labels.clamp_min(0)[:, None]).squeeze(1), 0.0)
    ref_ent = torch.where(valid, -(logsm.exp() * logsm).sum(-1), 0.0)
    torch.testing.assert_close(got[0].double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1].double(), ref_ent, atol=1e-5, rtol=0)
