"""megatron-core decoder layers (`parallel.backend = "mcore"`) on the `torch_varlen` attention backend (torch's
varlen_attn, `auto` on CUDA; its op given a CPU kernel by tests/unit/kernels/test_torch_varlen_models.py): a packed
batch's log-probs and gradients equal the reference backend's."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.inference.engine import RolloutPrompt  # noqa: E402
from megatron_vlm.kernels import use_backends  # noqa: E402
from megatron_vlm.models.mcore.layer import McoreDecoderLayer, use_mcore_layers  # noqa: E402
from megatron_vlm.rl.batching import TrainSample, pack_samples  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402
from tests.unit.kernels.test_torch_varlen_models import cpu_varlen  # noqa: E402,F401  (the fixture)


def _logp_grads(model, batch, weights):
    model.zero_grad(set_to_none=True)
    logp = TokenLogprobModel(model).train()({k: v for k, v in batch.items() if k != "num_response_tokens"})
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_mcore_layers_on_torch_varlen(mcore_state, cpu_varlen, tmp_path):  # noqa: F811
    model = load_hf_model(str(synthesize_model_folder("tiny_qwen3", tmp_path / "q", seed=0)), dtype=torch.float32)
    use_mcore_layers(model)
    assert all(isinstance(layer, McoreDecoderLayer) for layer in model.language_model.layers)
    vocab = model.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(1)
    prompts = [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (7, 12, 4)]
    samples = [TrainSample(p, torch.randint(0, vocab, (int(n),), generator=g), torch.zeros(int(n)), 0.0)
               for p in prompts for n in torch.randint(1, 6, (2,), generator=g)]
    batch = pack_samples(samples)
    weights = torch.randn(batch["num_response_tokens"], generator=g)
    with use_backends({"attention": "torch"}):
        ref = _logp_grads(model, batch, weights)
    with use_backends({"attention": "torch_varlen"}):
        got = _logp_grads(model, batch, weights)
    assert cpu_varlen["fwd"] == len(model.language_model.layers) and cpu_varlen["bwd"] == cpu_varlen["fwd"]
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], atol=1e-5, rtol=1e-4, msg=name)
