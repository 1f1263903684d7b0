"""Nemotron-H language model vs transformers' NemotronHForCausalLM (fp32, tiny random config with
Mamba2, MoE, attention and MLP layers): logits, padding, packing, decoding, HF load and export."""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import NemotronHConfig, NemotronHForCausalLM

from megatron_vlm.checkpoint.hf import load_hf_model, save_hf_model
from megatron_vlm.models import build_model
from megatron_vlm.models.common.moe import moe_layers

TOL = dict(rtol=1e-4, atol=1e-4)
TEXT_CFG = dict(
    vocab_size=96, hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40,
    mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, moe_shared_expert_intermediate_size=16,
    n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, layer_norm_epsilon=1e-5,
    pad_token_id=0, tie_word_embeddings=False,
)


def randomise_(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = NemotronHForCausalLM(NemotronHConfig(**TEXT_CFG)).eval()
    randomise_(hf)
    path = tmp_path_factory.mktemp("nemotron_h")
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def ours(hf_folder):
    return load_hf_model(hf_folder[0]).eval()


def test_layer_pattern_and_checkpoint_layout(hf_folder, ours):
    kinds = [layer.block_type for layer in ours.language_model.layers]
    assert kinds == TEXT_CFG["layers_block_type"]
    from safetensors import safe_open
    with safe_open(str(hf_folder[0] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in keys  # the released per-expert layout was read
    assert len(moe_layers(ours)) == 2


def test_logits_match_transformers(hf_folder, ours):
    _, hf = hf_folder
    ids = torch.randint(1, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = ours(ids)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL)


def test_left_padded_batch_matches_transformers(hf_folder, ours):
    _, hf = hf_folder
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        out = ours(ids, attention_mask=mask)
        alone = ours(ids[:1, 4:])
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], **TOL)
    torch.testing.assert_close(out[0, 4:], alone[0], rtol=1e-5, atol=1e-5)


def test_packed_equals_separate(ours):
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 96, (1, n), generator=g) for n in (5, 9, 2)]
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(torch.cat(seqs, 1), cu_seqlens=cu)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(packed[:, cu[i] : cu[i + 1]], ours(s), rtol=1e-5, atol=1e-5)



def test_packed_with_an_empty_segment_equals_without_it(ours):
    """A zero-length segment (repeated cu_seqlens bound, as the attention families accept) is no sample: the
    Mamba2 conv and scan give it no output and the pack the logits it has without it (it used to crash in conv1d)."""
    ids = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        plain = ours(ids, cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))
        for cu in ([0, 0, 4, 9], [0, 4, 4, 9], [0, 4, 9, 9]):
            torch.testing.assert_close(ours(ids, cu_seqlens=torch.tensor(cu, dtype=torch.int32)), plain, rtol=0, atol=0)

def test_step_decoding_equals_full_forward(ours):
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = ours(ids)
        cache = ours.new_cache(batch_size=2, max_len=16)
        outs = [ours(ids[:, :7], kv_cache=cache)]
        for t in range(7, 12):
            outs.append(ours(ids[:, t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.seq_len == 12


def test_chunks_of_several_tokens_after_a_cached_state_equal_full_forward(ours):
    """Several-token forwards continuing a cache (an appended turn): the chunked scan starts from the cached SSM
    state and the conv from the cached inputs, chunks of 1, 2, 5 and 7 tokens crossing the scan's 4-token chunks."""
    ids = torch.randint(1, 96, (2, 18), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = ours(ids)
        cache = ours.new_cache(batch_size=2, max_len=18)
        outs, lo = [], 0
        for hi in (3, 4, 6, 11, 18):
            outs.append(ours(ids[:, lo:hi], kv_cache=cache))
            lo = hi
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_left_padded_prefill_then_decode_and_group_expand(ours):
    """Prompt of sample 0 left-padded by 3; decoding continues each sample as if run alone; a cache
    expanded for a GRPO group (each prompt x2) decodes the same."""
    g = torch.Generator().manual_seed(5)
    p0, p1 = torch.randint(1, 96, (1, 4), generator=g), torch.randint(1, 96, (1, 7), generator=g)
    nxt = torch.randint(1, 96, (2, 3), generator=g)
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), p0], 1), p1])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        cache = ours.new_cache(batch_size=2, max_len=12)
        first = ours(ids, attention_mask=mask, kv_cache=cache)
        group = cache.repeat_interleave(2)
        steps = [ours(nxt[:, t : t + 1], kv_cache=cache) for t in range(3)]
        group_steps = [ours(nxt[:, t : t + 1].repeat_interleave(2, 0), kv_cache=group) for t in range(3)]
        ref0 = ours(torch.cat([p0, nxt[:1]], 1))
        ref1 = ours(torch.cat([p1, nxt[1:]], 1))
    torch.testing.assert_close(first[0, 3:], ref0[0, :4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1)[0], ref0[0, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1)[1], ref1[0, 7:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(group_steps, 1)[::2], torch.cat(steps, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(group_steps, 1)[1::2], torch.cat(steps, 1), rtol=1e-6, atol=1e-6)


def test_padding_after_real_tokens_in_a_cached_forward_is_refused(ours):
    """The Mamba2 layers zero a padded token's input, but it still shifts their conv window and decays their SSM
    state, so a pad after a sequence's first real token (right padding, or a left-padded chunk appended to a cache
    that holds tokens) would give that sequence wrong logits from then on, silently. Measured against the same
    tokens without padding (row 1 of the chunk differed by ~2 in the logits); refused, naming the input."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(1, 96, (1, 10), generator=g), torch.randint(1, 96, (1, 8), generator=g)
    with torch.no_grad():
        cache = ours.new_cache(batch_size=2, max_len=16)
        ours(torch.cat([a[:, :7], b[:, :7]]), kv_cache=cache)
        chunk = torch.cat([a[:, 7:10], torch.cat([torch.zeros(1, 2, dtype=torch.long), b[:, 7:8]], 1)])
        mask = torch.ones_like(chunk)
        mask[1, :2] = 0
        with pytest.raises(ValueError, match="attention_mask: padding after a real token"):
            ours(chunk, attention_mask=mask, kv_cache=cache)
        assert cache.seq_len == 7  # the refused chunk left the cache as it was: the rows go on without it
        step = ours(torch.cat([a[:, 7:8], b[:, 7:8]]), kv_cache=cache)
        torch.testing.assert_close(step[0, 0], ours(a[:, :8])[0, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step[1, 0], ours(b)[0, -1], rtol=1e-5, atol=1e-5)
        right = torch.ones(2, 5, dtype=torch.long)
        right[0, 3:] = 0  # a right-padded prompt into an empty cache
        with pytest.raises(ValueError, match="attention_mask: padding after a real token"):
            ours(torch.cat([a[:, :5], b[:, :5]]), attention_mask=right, kv_cache=ours.new_cache(batch_size=2, max_len=8))
        whole = torch.ones(2, 8, dtype=torch.long)  # a mask over cached + new tokens without padding is fine
        cache = ours.new_cache(batch_size=2, max_len=8)
        ours(torch.cat([a[:, :7], b[:, :7]]), kv_cache=cache)
        last = ours(torch.cat([a[:, 7:8], b[:, 7:8]]), attention_mask=whole, kv_cache=cache)
    torch.testing.assert_close(last, step, rtol=1e-6, atol=1e-6)


def test_in_memory_layout_loads_too(hf_folder, tmp_path):
    """A raw transformers state_dict (model.*, stacked experts) saved as safetensors loads the same."""
    src, hf = hf_folder
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    model = load_hf_model(tmp_path).eval()
    ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, **TOL)


def test_export_round_trip_through_transformers(ours, tmp_path):
    out = save_hf_model(ours, tmp_path / "export", max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file()  # sharded
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_h"
    reloaded = NemotronHForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, ours(ids), **TOL)
    torch.testing.assert_close(
        reloaded.model.layers[1].mixer.gate.e_score_correction_bias,
        ours.language_model.layers[1].mixer.gate.e_score_correction_bias,
    )


def test_build_model_random_init_and_backward():
    cfg = dict(NemotronHConfig(**TEXT_CFG).to_dict())
    model = build_model(cfg).train()
    ids = torch.randint(1, 96, (2, 6))
    logits = model(ids)
    assert torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" not in n)
    # MoE layers counted the routed tokens of this training forward
    assert [int(m.expert_load.sum()) for m in moe_layers(model)] == [2 * 6 * 2] * 2


def test_legacy_config_names():
    from megatron_vlm.models.nemotron_vl.args import NemotronVLArgs

    args = NemotronVLArgs.from_hf_config({
        "model_type": "nemotron_h", "hybrid_override_pattern": "M-*E", "mamba_n_groups": 2, "mamba_chunk_size": 64,
        "mamba_num_heads": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    })
    assert args.text.layers_block_type == ["linear_attention", "mlp", "full_attention", "moe"]
    assert (args.text.n_groups, args.text.chunk_size) == (2, 64)
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        NemotronVLArgs.from_hf_config({"model_type": "nemotron_h", "hybrid_override_pattern": "MX"})


def test_attribute_map_names_are_read_as_transformers_reads_them():
    """NemotronHConfig's attribute_map spells n_routed_experts `num_local_experts` (and layers_block_type
    `layer_types`): a config.json written with those names builds the experts transformers builds."""
    from megatron_vlm.models.nemotron_vl.args import NemotronVLArgs

    cfg = {"model_type": "nemotron_h", "layer_types": ["moe", "mlp"], "num_local_experts": 32, "num_experts_per_tok": 4}
    hf = NemotronHConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    args = NemotronVLArgs.from_hf_config(cfg)
    assert args.text.layers_block_type == hf.layers_block_type == ["moe", "mlp"]
    assert args.text.n_routed_experts == hf.n_routed_experts == 32


def test_parallelize_with_activation_checkpointing_keeps_results(hf_folder):
    from megatron_vlm.models.nemotron_vl.parallelize import parallelize_nemotron_vl

    path, _ = hf_folder
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(8))
    grads = []
    for ac in (False, True):
        model = load_hf_model(path).train()
        parallelize_nemotron_vl(model, None, None, mesh=None, activation_checkpointing=ac)
        model(ids).float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=lambda m: f"{name}: {m}")

    class Dims:
        ep = 2
    with pytest.raises(NotImplementedError, match="parallel.ep=2"):
        parallelize_nemotron_vl(load_hf_model(path), Dims(), None)


def test_adapter_defaults_for_checkpoints_without_layer_scale():
    from megatron_vlm.models.nemotron_vl.state_dict_adapter import NemotronVLStateDictAdapter

    value = NemotronVLStateDictAdapter.default_for("vision_model.encoder.layer.3.layer_scale2.lambda1", (4,))
    torch.testing.assert_close(value, torch.ones(4))
    assert NemotronVLStateDictAdapter.default_for("language_model.norm_f.weight", (4,)) is None
