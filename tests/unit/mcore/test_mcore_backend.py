"""`parallel.backend = "mcore"` (models/mcore/layer.py): each dense family's language-decoder layers swapped
for megatron-core 0.16.1 TransformerLayers (local spec, on the CPU) give the native model's log-probs and
gradients on a packed batch with images and shared prompts, its logits on a left-padded batch, the same
greedy rollout through the KV slot cache and the paged one (`rl.rollout.kv_block_size`), and the native state dict back for the HF export. MoE and
Nemotron-H decoders: test_mcore_moe_hybrid.py."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core")  # installed by the dev extra

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa  # noqa: E402
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.models.mcore.layer import (  # noqa: E402
    McoreDecoderLayer,
    native_state_dict,
    use_mcore_layers,
)
from megatron_vlm.rl.batching import TrainSample, pack_samples  # noqa: E402
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset  # noqa: E402
from megatron_vlm.rl.prompts.encoder import PromptEncoder  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return write_synthetic_vqa(tmp_path_factory.mktemp("vqa"), 2, 3, seed=0)["eval"]


def _prompts(kind, folder, vocab, vqa):
    proc = load_processor(str(folder))
    if kind == "tiny_qwen3":
        g = torch.Generator().manual_seed(1)
        return [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (7, 12, 4)], proc
    encoder = PromptEncoder(proc, max_frames=4, fps=2.0, max_new_tokens=5, max_tokens=4096)
    return [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples], proc



def _logp_grads(model, batch, weights):
    model.zero_grad(set_to_none=True)
    logp = TokenLogprobModel(model).train()({k: v for k, v in batch.items() if k != "num_response_tokens"})
    (logp * weights).sum().backward()
    grads = {}
    for i, layer in enumerate(model.language_model.layers):  # per native name, mcore layers mapped back
        own = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
        if isinstance(layer, McoreDecoderLayer):
            own = layer.native_state({n.removeprefix("mcore."): g for n, g in own.items()})
        grads.update({f"layer{i}.{n}": g for n, g in own.items()})
    rest = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and ".layers." not in n}
    return logp.detach(), {**grads, **rest}


@pytest.mark.parametrize("kind", ["tiny_qwen2_5_vl", "tiny_qwen3_vl", "tiny_internvl", "tiny_qwen3"])
def test_mcore_layers_equal_the_native_decoder(kind, mcore_state, vqa, tmp_path):
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    native = load_hf_model(str(folder), dtype=torch.float32)
    mc = copy.deepcopy(native)
    use_mcore_layers(mc)
    assert all(isinstance(layer, McoreDecoderLayer) for layer in mc.language_model.layers)
    assert type(mc.language_model.layers[0].mcore).__name__ == "TransformerLayer"
    vocab = native.lm_head.weight.shape[0]

    # export: the native names and tensors back, bit-exactly
    back = native_state_dict(mc.state_dict(), mc)
    ref = native.state_dict()
    assert back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)

    # training forward: packed samples with shared prompts (and images), log-probs and gradients
    prompts, proc = _prompts(kind, folder, vocab, vqa)
    g = torch.Generator().manual_seed(2)
    samples = [TrainSample(p, torch.randint(0, vocab, (int(n),), generator=g), torch.zeros(int(n)), 0.0)
               for p in prompts for n in torch.randint(1, 6, (2,), generator=g)]
    batch = pack_samples(samples, share_prompts=True)
    weights = torch.randn(batch["num_response_tokens"], generator=g)
    lp_n, g_n = _logp_grads(native, batch, weights)
    lp_m, g_m = _logp_grads(mc, batch, weights)
    torch.testing.assert_close(lp_m, lp_n, atol=1e-5, rtol=0)
    assert g_m.keys() == g_n.keys()
    for name in g_n:
        torch.testing.assert_close(g_m[name], g_n[name], atol=1e-5, rtol=1e-4, msg=name)

    # decoding: greedy completions through the engine's KV slot cache, and a left-padded batch's logits
    params = SamplingParams(max_new_tokens=4, n=1, temperature=0.0)
    tok = proc.tokenizer
    out_n = PolicyRolloutEngine(native.eval(), tok, EngineOptions(eos_token_ids=[-1])).generate(prompts, params)
    out_m = PolicyRolloutEngine(mc.eval(), tok, EngineOptions(eos_token_ids=[-1])).generate(prompts, params)
    out_p = PolicyRolloutEngine(mc.eval(), tok, EngineOptions(eos_token_ids=[-1],
                                                              kv_block_size=4)).generate(prompts, params)  # paged
    for out in (out_m, out_p):
        assert [s.token_ids.tolist() for s in out.samples] == [s.token_ids.tolist() for s in out_n.samples]
        torch.testing.assert_close(torch.cat([s.logprobs for s in out.samples]),
                                   torch.cat([s.logprobs for s in out_n.samples]), atol=1e-5, rtol=0)
    if kind == "tiny_qwen3":
        ids = torch.randint(0, vocab, (2, 6), generator=g)
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        with torch.no_grad():
            torch.testing.assert_close(mc(ids, attention_mask=mask)[mask.bool()],
                                       native(ids, attention_mask=mask)[mask.bool()], atol=1e-5, rtol=0)


def test_config_refusals():
    from megatron_vlm.config.sections import ParallelConfig

    ParallelConfig(backend="mcore", pp=2).validate()  # pipeline parallelism: tests/integration/parallel/test_mcore_pp.py
    with pytest.raises(ValueError, match=r"pp: pipeline parallelism \(pp = 2\).*ep = 2 must be 1"):  # as native
        ParallelConfig(backend="mcore", pp=2, ep=2).validate()  # tp / cp: test_mcore_tp_shard.py
    ParallelConfig(backend="mcore", dp_shard=2).validate()  # data parallelism is fine


def test_a_transformer_engine_that_does_not_import_gives_the_local_spec_and_says_why(tmp_path, monkeypatch, caplog):
    """TE installed (found on the path) but built for another torch: its `pytorch` module fails to load. The
    layers are built from megatron-core's local spec, and the warning names the import error (once)."""
    import logging
    import sys

    # megatron-core's layer specs imported first, with the real environment: imported under the stand-in below
    # they would take it for Transformer Engine and stay cached that way, and every megatron-core layer built later
    # in this process would fail ("isinstance() arg 2 must be a type") when this test ran first on a worker
    from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401

    from megatron_vlm.models.mcore import layer as mcore_layer

    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch.py").write_text("raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN2at4_ops')")
    for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(mcore_layer, "_TE_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger=mcore_layer.__name__):
        for _ in range(2):
            spec, te_fused = mcore_layer._layer_spec(qk_layernorm=False)
            assert te_fused is False
            assert "TENorm" not in repr(spec) and "TELayerNorm" not in repr(spec)
    warnings = [r.getMessage() for r in caplog.records if "Transformer Engine" in r.getMessage()]
    assert len(warnings) == 1 and "undefined symbol" in warnings[0] and "local layer spec" in warnings[0]
