"""`[lora]` with `parallel.backend = "mcore"` (models/mcore/layer.py): the megatron-core layers add the native
adapters' updates to the slices of their fused projections, so a model whose native layers got LoRA
(training/lora.py `setup_lora`, the native backend's verified path) and were then swapped for megatron-core
layers must give the native LoRA model's log-probs and adapter gradients (random non-zero B, dropout on), the
same greedy decoding through the KV slot cache, the same parameter names / trainable set, the same PEFT adapter
file and merged export, and the base model with the adapters switched off (GRPO's reference). Layers the megatron-core backend does not adapt are refused."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

pytest.importorskip("megatron.core")  # installed by the dev extra

from megatron_vlm.checkpoint.hf import load_hf_model  # noqa: E402
from megatron_vlm.config.sections import LoRAConfig  # noqa: E402
from megatron_vlm.data.processor import load_processor  # noqa: E402
from megatron_vlm.data.synthetic_vqa import write_synthetic_vqa  # noqa: E402
from megatron_vlm.inference.engine import RolloutPrompt, SamplingParams  # noqa: E402
from megatron_vlm.inference.policy_engine import EngineOptions, PolicyRolloutEngine  # noqa: E402
from megatron_vlm.models.common.lora import lora_disabled, lora_modules, merged_state_dict  # noqa: E402
from megatron_vlm.models.mcore.layer import McoreBackendError, McoreDecoderLayer, native_state_dict, use_mcore_layers  # noqa: E402
from megatron_vlm.rl.batching import TrainSample, pack_samples  # noqa: E402
from megatron_vlm.rl.prompts.dataset import load_prompt_dataset  # noqa: E402
from megatron_vlm.rl.prompts.encoder import PromptEncoder  # noqa: E402
from megatron_vlm.testing.synthesize import synthesize_model_folder  # noqa: E402
from megatron_vlm.training.lm_loss import TokenLogprobModel  # noqa: E402
from megatron_vlm.training.lora import scaling_of, setup_lora, write_adapter  # noqa: E402


@pytest.fixture(autouse=True)
def _reference_layer_ops():
    """megatron-core's layers run their own norms and activation (torch ops), so the native layers they are compared
    with run the torch references of rms_norm / swiglu / rotary here too: both sides then round the same ops the same
    way. (On CPU `auto` takes the fused C++ kernels, which differ from the references by fp32 rounding; the adapter
    gradients below amplify that past this test's tolerance — both stay ~5e-5 of the largest gradient from a float64
    run. The kernels are tested against float64 in tests/unit/csrc/test_csrc_layer_ops.py.)"""
    from megatron_vlm import kernels

    with kernels.use_backends({op: "torch" for op in ("rms_norm", "swiglu", "apply_rotary", "decode_attention")}):
        yield


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    return write_synthetic_vqa(tmp_path_factory.mktemp("vqa"), 2, 3, seed=0)["eval"]


def _lora_models(kind, tmp_path, cfg):
    """(native LoRA model with random non-zero factors, its megatron-core twin, model folder)."""
    folder = synthesize_model_folder(kind, tmp_path / kind, seed=0)
    native = load_hf_model(str(folder), dtype=torch.float32)
    setup_lora(native, cfg, native.hf_config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in lora_modules(native).values():  # B = 0 would hide a misplaced update
            m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) * 0.3)
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.3)
    mc = copy.deepcopy(native)
    use_mcore_layers(mc)
    assert all(isinstance(layer, McoreDecoderLayer) for layer in mc.language_model.layers)
    return native, mc, folder


def _prompts(kind, folder, vocab, vqa):
    if kind == "tiny_qwen3":
        g = torch.Generator().manual_seed(1)
        return [RolloutPrompt(torch.randint(0, vocab, (n,), generator=g)) for n in (7, 12, 4)]
    encoder = PromptEncoder(load_processor(str(folder)), max_frames=4, fps=2.0, max_new_tokens=5, max_tokens=4096)
    return [encoder.encode(s) for s in load_prompt_dataset(vqa, schema="messages").samples]


def _batch(kind, folder, vocab, vqa):
    prompts = _prompts(kind, folder, vocab, vqa)
    g = torch.Generator().manual_seed(2)
    samples = [TrainSample(p, torch.randint(0, vocab, (int(n),), generator=g), torch.zeros(int(n)), 0.0)
               for p in prompts for n in torch.randint(1, 6, (2,), generator=g)]
    batch = pack_samples(samples, share_prompts=True)
    return {k: v for k, v in batch.items() if k != "num_response_tokens"}, torch.randn(batch["num_response_tokens"], generator=g)


def _logp_lora_grads(model, batch, weights, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the adapters' dropout masks
    logp = TokenLogprobModel(model).train()(batch)
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind,targets,dropout,rslora", [
    ("tiny_qwen2_5_vl", [], 0.0, False),  # the default targets: q k v o gate up down
    ("tiny_qwen3_vl", [], 0.1, True),  # QK-norm after the q / k updates; dropout masks in the native order
    ("tiny_internvl", ["q_proj", "v_proj", "down_proj"], 0.0, False),
    ("tiny_qwen3", [r".*\.layers\.1\..*(k_proj|up_proj)"], 0.1, False),  # a regex: layer 0 not adapted at all
    ("tiny_qwen3_vl_moe", [], 0.0, False),  # MoE layers: attention adapters, routed experts frozen; a dense layer's MLP
])
def test_mcore_lora_equals_native_lora(kind, targets, dropout, rslora, mcore_state, vqa, tmp_path):
    cfg = LoRAConfig(r=4, alpha=8, dropout=dropout, use_rslora=rslora, target_modules=targets)
    native, mc, folder = _lora_models(kind, tmp_path, cfg)
    ours = {n: p for n, p in mc.named_parameters()}
    ref = dict(native.named_parameters())
    # the adapters keep the native names (checkpoint keys, PEFT names); only they train
    lora_n = {n for n in ref if ".lora_" in n}
    assert lora_n and {n for n in ours if ".lora_" in n} == lora_n
    assert {n for n, p in ours.items() if p.requires_grad} == {n for n, p in ref.items() if p.requires_grad} == lora_n
    assert any(".mcore." in n for n in ours)

    # log-probs and adapter gradients on a packed batch (images, shared prompts), dropout masks included
    batch, weights = _batch(kind, folder, native.lm_head.weight.shape[0], vqa)
    lp_n, g_n = _logp_lora_grads(native, batch, weights)
    lp_m, g_m = _logp_lora_grads(mc, batch, weights)
    torch.testing.assert_close(lp_m, lp_n, atol=1e-5, rtol=0)
    assert g_m.keys() == g_n.keys() == lora_n
    for name in g_n:
        scale = float(g_n[name].abs().max())
        assert scale > 0, name
        # fp32 sums over the batch in another order (one thread or several, mcore's fused layout): an element's
        # error follows the magnitude of the terms summed, not its own value, so the bound scales with the tensor
        # (gradients up to ~45 here; seen: 6e-5 apart on one thread); a wrong gradient is off by O(its scale)
        torch.testing.assert_close(g_m[name], g_n[name], atol=1e-5 + 4e-6 * scale, rtol=1e-4, msg=name)

    # GRPO's reference: the adapters off = the base model; and they do change the output
    with torch.no_grad(), lora_disabled(mc), lora_disabled(native):
        base_m, base_n = TokenLogprobModel(mc).eval()(batch), TokenLogprobModel(native).eval()(batch)
    torch.testing.assert_close(base_m, base_n, atol=1e-5, rtol=0)
    assert (base_m - lp_m).abs().max() > 1e-3

    # decoding through the KV slot cache (GRPO's rollout with rl.rollout.weights = "shared"): the same greedy tokens
    prompts = _prompts(kind, folder, native.lm_head.weight.shape[0], vqa)
    params = SamplingParams(max_new_tokens=4, n=1, temperature=0.0)
    tok = load_processor(str(folder)).tokenizer
    out_n = PolicyRolloutEngine(native.eval(), tok, EngineOptions(eos_token_ids=[-1])).generate(prompts, params)
    out_m = PolicyRolloutEngine(mc.eval(), tok, EngineOptions(eos_token_ids=[-1])).generate(prompts, params)
    assert [s.token_ids.tolist() for s in out_m.samples] == [s.token_ids.tolist() for s in out_n.samples]
    torch.testing.assert_close(torch.cat([s.logprobs for s in out_m.samples]),
                               torch.cat([s.logprobs for s in out_n.samples]), atol=1e-5, rtol=0)

    # state dict under native names (checkpoint export), the PEFT adapter files and the merged export
    back, want = native_state_dict(mc.state_dict(), mc), native.state_dict()
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)
    hf = native.hf_config
    a_m = write_adapter(tmp_path / "adapter_m", back, hf, cfg)
    a_n = write_adapter(tmp_path / "adapter_n", want, hf, cfg)
    from safetensors.torch import load_file

    t_m, t_n = load_file(a_m / "adapter_model.safetensors"), load_file(a_n / "adapter_model.safetensors")
    assert t_m.keys() == t_n.keys() and len(t_n) == len(lora_n)
    assert all(torch.equal(t_m[k], t_n[k]) for k in t_n)
    assert json.loads((a_m / "adapter_config.json").read_text()) == json.loads((a_n / "adapter_config.json").read_text())
    m_m, m_n = merged_state_dict(back, scaling_of(cfg)), merged_state_dict(want, scaling_of(cfg))
    assert m_m.keys() == m_n.keys() and all(torch.equal(m_m[k], m_n[k]) for k in m_n)
    assert not any(".lora_" in k for k in m_m)


def test_mcore_lora_init_from_merge_and_continue(mcore_state, tmp_path):
    """init_from (continue / merge) runs on the native layers before the swap: the megatron-core model equals the
    native one in both modes (merge: the earlier adapter folded into the converted base weights)."""
    cfg = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])
    native, _, folder = _lora_models("tiny_qwen3", tmp_path, cfg)
    adapter = write_adapter(tmp_path / "stage1", native.state_dict(), native.hf_config, cfg)
    vocab = native.lm_head.weight.shape[0]
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    for mode in ("continue", "merge"):
        stage2 = dataclasses.replace(cfg, init_from=str(adapter), init_from_mode=mode)
        n2 = load_hf_model(str(folder), dtype=torch.float32)
        setup_lora(n2, stage2, n2.hf_config)
        m2 = copy.deepcopy(n2)
        use_mcore_layers(m2)
        with torch.no_grad():
            torch.testing.assert_close(m2(ids), n2(ids), atol=1e-5, rtol=0)
            torch.testing.assert_close(m2(ids), native(ids), atol=1e-5, rtol=0)  # stage 1's model either way
            with lora_disabled(m2), lora_disabled(n2):
                torch.testing.assert_close(m2(ids), n2(ids), atol=1e-5, rtol=0)


def test_frozen_base_stays_frozen(mcore_state, tmp_path):
    """A LoRA run whose adapters are elsewhere (here: none in the decoder) freezes every base weight: the
    megatron-core layers built from frozen native layers (Nemotron-H's Mamba / attention / MLP / MoE blocks) are
    frozen too, and a layer that trains stays trainable."""
    native = load_hf_model(str(synthesize_model_folder("tiny_nemotron_vl", tmp_path / "nemo", seed=0)), dtype=torch.float32)
    native.requires_grad_(False)
    native.language_model.layers[0].requires_grad_(True)
    use_mcore_layers(native)
    layers = native.language_model.layers
    assert all(p.requires_grad for p in layers[0].parameters())
    assert not any(p.requires_grad for layer in layers[1:] for p in layer.parameters())


def test_unadapted_layers_are_refused(mcore_state, tmp_path):
    """Nemotron-H blocks are not adapted under mcore. (Native target selection finds no PEFT names in their language
    layers either; the adapter is applied directly here, as an adapter file naming such a layer would.)"""
    from megatron_vlm.models.common.lora import apply_lora

    native = load_hf_model(str(synthesize_model_folder("tiny_nemotron_vl", tmp_path / "nemo", seed=0)), dtype=torch.float32)
    layer = next(i for i, b in enumerate(native.language_model.layers) if b.block_type == "full_attention")
    apply_lora(native, [f"language_model.layers.{layer}.mixer.q_proj"], r=2, alpha=4)
    with pytest.raises(McoreBackendError, match=rf"lora\.target_modules: adapts language_model\.layers\.{layer}\.mixer\.q_proj"
                                                r".*parallel\.backend = 'mcore'"):
        use_mcore_layers(native)


def test_every_parallel_layout_is_accepted():
    """Config validation accepts the megatron-core adapters with data, context, expert, pipeline and tensor
    parallelism (each run against native LoRA in tests/integration/parallel/test_mcore_lora_parallel.py)."""
    from megatron_vlm.config import load_config
    from megatron_vlm.config.mode_keys import check_keys_for_mode

    sets = ['parallel.backend="mcore"', "lora.r=4", "train.train_layers=[]", "data.synthetic_eval_size=0", "data.eval_path=\"\""]
    for ok in ("dp_shard", "cp", "ep", "pp", "tp"):
        micro = ["train.micro_batches_per_step=2"] if ok == "pp" else []  # 1F1B: a micro-batch per stage at least
        check_keys_for_mode(load_config("launch/configs/demo_sft.toml", [*sets, f"parallel.{ok}=2", *micro]))
