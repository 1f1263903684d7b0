"""HF <-> megatron-core conversion of the dense language decoders, checked against both libraries' own
modules: a tiny random transformers Qwen2 / Qwen3 causal LM is converted and loaded with strict=True
into megatron-core's GPTModel (local layer spec, built on the CPU), whose logits must equal
transformers' in fp32, and the round trip back to HF must be bit-exact.

megatron-core's local layers hard-code CUDA in places that do not touch the math: the rotary cache's
device (`torch.cuda.current_device()`), the default causal mask (built on "cuda"; we pass the mask), the
CUDA RNG tracker forked around attention dropout (dropout is 0 here), and the MoE router's gating linear
reads a Transformer Engine symbol that 0.16.1 leaves undefined without TE (set to None: its plain
torch path). The fixture maps those to the CPU for the test only."""
from __future__ import annotations

import contextlib

import pytest
import torch

mcore = pytest.importorskip("megatron.core")  # installed by the dev extra (setup.py)

from megatron_vlm.models.mcore import hf_to_mcore, mcore_to_hf  # noqa: E402
from megatron_vlm.models.mcore.config import build_gpt_model, transformer_config_kwargs  # noqa: E402


@pytest.fixture(scope="module")
def mcore_cpu(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    own = not dist.is_initialized()
    if own:
        init = tmp_path_factory.mktemp("mcore") / "init"
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    mp.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
    yield
    mp.undo()
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def _tiny(kind: str, tie: bool):
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tie)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind.startswith("qwen3_moe"):  # "qwen3_moe_raw": top-k weights not renormalised
        cfg = transformers.Qwen3MoeConfig(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          norm_topk_prob=kind == "qwen3_moe", **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(head_dim=24, **common)  # head_dim != hidden / heads, as in Qwen3
        model = transformers.Qwen3ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # norms too: random, so a swapped norm key changes the logits
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return cfg, model.eval()


@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("qwen3", False), ("qwen2", True), ("qwen3_moe", False),
                                      ("qwen3_moe_raw", False)])
def test_converted_weights_give_transformers_logits_and_round_trip_exactly(mcore_cpu, kind, tie):
    cfg, hf_model = _tiny(kind, tie)
    hf_sd = {k: v for k, v in hf_model.state_dict().items() if not (tie and k == "lm_head.weight")}
    heads = dict(num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads)
    mc_sd = hf_to_mcore(hf_sd, **heads)

    mc_model = build_gpt_model(cfg).eval()
    expected = {k for k in mc_model.state_dict() if not k.endswith("._extra_state")}
    assert set(mc_sd) == expected
    missing, unexpected = mc_model.load_state_dict(mc_sd, strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing)

    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        ours = mc_model(ids, pos, attention_mask=mask).float()
        ref = hf_model(input_ids=ids).logits.float()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)

    back = mcore_to_hf(mc_model.state_dict(), **heads)
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k


def test_qkv_rows_are_grouped_per_kv_head():
    # 4 query heads, 2 KV heads, head_dim 1: megatron-core orders rows [q0 q1 k0 v0 | q2 q3 k1 v1]
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.self_attn.o_proj.weight": torch.zeros(1, 4),
          "model.layers.0.mlp.gate_proj.weight": torch.ones(2, 1), "model.layers.0.mlp.up_proj.weight": 2 * torch.ones(2, 1),
          "model.layers.0.mlp.down_proj.weight": torch.zeros(1, 2), "model.layers.0.input_layernorm.weight": torch.ones(1),
          "model.layers.0.post_attention_layernorm.weight": torch.ones(1)}
    mc = hf_to_mcore(hf, num_attention_heads=4, num_key_value_heads=2)
    assert mc["decoder.layers.0.self_attention.linear_qkv.weight"].flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert mc["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() == [1, 1, 2, 2]
    fused = hf_to_mcore(hf, num_attention_heads=4, num_key_value_heads=2, te_fused_norms=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in fused
    assert mcore_to_hf(fused, num_attention_heads=4, num_key_value_heads=2, te_fused_norms=True).keys() == hf.keys()


def test_unknown_keys_and_families_are_errors():
    with pytest.raises(KeyError, match="block_sparse_moe"):  # Mixtral-style per-expert keys
        hf_to_mcore({"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(1)}, num_attention_heads=1,
                    num_key_value_heads=1)
    with pytest.raises(KeyError, match="mixer"):
        mcore_to_hf({"decoder.layers.0.mixer.in_proj.weight": torch.zeros(1)}, num_attention_heads=1, num_key_value_heads=1)

    class Cfg:
        model_type = "nemotron_h"
    with pytest.raises(ValueError, match="nemotron_h"):
        transformer_config_kwargs(Cfg())
