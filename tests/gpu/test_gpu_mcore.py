"""`parallel.backend = "mcore"` on a CUDA device: megatron-core layers against the native decoder.

What the issue asks to verify on a GPU (the CPU suite checks the same in fp32 on the CPU,
tests/unit/mcore): the megatron-core decoder's log-probs equal the native backend's (fp32 tight, bf16 within
bf16 tolerance), and one optimizer step moves both to the same weights. Families: dense (Qwen2.5-VL), MoE
(Qwen3-VL-MoE: megatron-core's router and token dispatcher on CUDA) and the Nemotron-H hybrid (Mamba2 +
attention + MoE). Run by the GPU suite's `gpu`-marked tests; skipped without CUDA.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("megatron.core")

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa  # noqa: E402
from megatron_vlm.models.mcore.layer import native_state_dict, use_mcore_layers  # noqa: E402
from megatron_vlm.rl.batching import TrainSample, pack_samples  # noqa: E402
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset  # noqa: E402
from megatron_vlm.rl.prompts.encoder import PromptEncoder  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'init'}",
                                rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def _batch(kind, folder, vocab, tmp_path):
    proc = load_processor(str(folder))
    vqa = write_synthetic_vqa(tmp_path / "vqa", 2, 3, seed=0)["eval"]
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=5, max_tokens=4096)
    prompts = [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]
    g = torch.Generator().manual_seed(2)
    samples = [TrainSample(p, torch.randint(0, vocab, (int(n),), generator=g), torch.zeros(int(n)), 0.0)
               for p in prompts for n in torch.randint(1, 6, (2,), generator=g)]
    batch = pack_samples(samples, share_prompts=not kind.startswith("tiny_nemotron"))
    weights = torch.randn(batch["num_response_tokens"], generator=g)
    return {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in batch.items() if k != "num_response_tokens"}, weights.cuda()


def _logp(model, batch, weights, step: bool):
    """Token log-probs of the batch; with `step`, one AdamW step on sum(weights * log-probs) first."""
    if step:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        (TokenLogprobModel(model).train()(batch) * weights).sum().backward()
        opt.step()
    with torch.no_grad():
        return TokenLogprobModel(model).eval()(batch).float()


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl_moe", "tiny_nemotron_vl"])
def test_mcore_decoder_on_gpu_equals_native(kind, process_group, tmp_path):
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    native = load_hf_model(str(folder), dtype=torch.float32)
    mc = copy.deepcopy(native)
    use_mcore_layers(mc)
    native, mc = native.cuda(), mc.cuda()
    batch, weights = _batch(kind, folder, native.lm_head.weight.shape[0], tmp_path)

    # fp32: the same log-probs (cuBLAS may order sums differently in the two layouts: 1e-4)
    torch.testing.assert_close(_logp(mc, batch, weights, False), _logp(native, batch, weights, False), atol=1e-4, rtol=0)
    # one optimizer step on each (fp32): the same weights and log-probs after it
    lp_n = _logp(native, batch, weights, True)
    lp_m = _logp(mc, batch, weights, True)
    torch.testing.assert_close(lp_m, lp_n, atol=1e-3, rtol=0)
    back, ref = native_state_dict(mc.state_dict(), mc), native.state_dict()
    assert back.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(back[key], ref[key], atol=1e-4, rtol=1e-4, msg=key)
    # both in bf16 (in place: the megatron-core model holds process groups, which do not deep-copy)
    lp_n16 = _logp(native.bfloat16(), batch, weights, False)
    lp_m16 = _logp(mc.bfloat16(), batch, weights, False)
    assert (lp_m16 - lp_n16).abs().max().item() <= 0.05 * max(1.0, lp_n16.abs().max().item())
