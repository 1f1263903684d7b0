"""Text-only Qwen2 / Qwen3 / Qwen3-MoE (models/qwen_text) against transformers' `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM` (fp32, tiny random configs, norms and biases randomised so a
mis-mapped norm or bias shows): padded logits, packed == each sample alone, KV-cache decoding == the
full forward, and that the decoder is the VLM families' (shared, not copied)."""
import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.models.common.moe import MoE
from megatron_vlm.models.qwen2_5_vl.model import Qwen2_5_VLTextModel
from megatron_vlm.models.qwen3_vl.model import Qwen3VLTextModel
from megatron_vlm.models.qwen_text.state_dict_adapter import QwenTextStateDictAdapter
from megatron_vlm.testing.tiny_text_model import tiny_qwen_text_hf_config
from tests.fixtures.parity import assert_logits_close, load_converted

VOCAB = 96
TYPES = ("qwen2", "qwen3", "qwen3_moe")


def hf_reference(model_type: str, *, seed: int = 0, tie: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_qwen_text_hf_config(model_type, vocab_size=VOCAB, hidden=64, layers=2, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return hf, cfg


@pytest.fixture(scope="module", params=TYPES)
def models(request):
    hf, cfg = hf_reference(request.param, seed=TYPES.index(request.param))
    ours = build_model(cfg)
    return hf, load_converted(ours, QwenTextStateDictAdapter(ours.args), hf.state_dict())


def _ids(g, *lengths):
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def test_decoder_is_the_vlm_decoder(models):
    _, ours = models
    want = Qwen2_5_VLTextModel if ours.args.model_type == "qwen2" else Qwen3VLTextModel
    assert type(ours.language_model) is want
    assert ours.args.text.mrope_section is None
    kinds = [type(layer.mlp).__name__ for layer in ours.language_model.layers]
    assert kinds == (["MoE", "SwiGLUMLP"] if ours.args.model_type == "qwen3_moe" else ["SwiGLUMLP"] * 2)
    if ours.args.model_type == "qwen3_moe":
        assert not ours.language_model.layers[0].mlp.gate.norm_topk_prob  # config.json's norm_topk_prob = false
        assert isinstance(ours.language_model.layers[0].mlp, MoE)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_each_sample(models, side):
    hf, ours = models
    seqs = _ids(torch.Generator().manual_seed(1), 7, 12, 3)
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(t - len(s), t)
        ids[i, sl], mask[i, sl] = s, 1
    with torch.no_grad():
        out = ours(ids, mask)
        for i, s in enumerate(seqs):
            sl = slice(0, len(s)) if side == "right" else slice(t - len(s), t)
            assert_logits_close(hf(s[None]).logits, out[i:i + 1, sl])
        if side == "right":  # transformers' own padded batch agrees at the real tokens
            assert_logits_close(hf(input_ids=ids, attention_mask=mask).logits, out, mask)


def test_packed_equals_each_sample_alone(models):
    hf, ours = models
    seqs = _ids(torch.Generator().manual_seed(2), 5, 9, 4)
    cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    with torch.no_grad():
        out = ours(torch.cat(seqs)[None], cu_seqlens=cu)
        for s, lo, hi in zip(seqs, cu[:-1].tolist(), cu[1:].tolist()):
            assert_logits_close(hf(s[None]).logits, out[:, lo:hi])


def test_kv_cache_decoding_equals_full_forward(models):
    """Left-padded prefill, then one token at a time: every step's logits equal the full forward's."""
    _, ours = models
    g = torch.Generator().manual_seed(3)
    prompts, cont = _ids(g, 6, 3), torch.randint(0, VOCAB, (2, 4), generator=g)
    t = 6
    ids = torch.zeros(2, t, dtype=torch.long)
    mask = torch.zeros(2, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):], mask[i, t - len(p):] = p, 1
    full_ids, full_mask = torch.cat([ids, cont], 1), torch.cat([mask, torch.ones_like(cont)], 1)
    with torch.no_grad():
        full = ours(full_ids, full_mask)
        cache = ours.new_cache(2, t + cont.shape[1])
        steps = [ours(ids, mask, kv_cache=cache)[:, -1:]]
        for j in range(cont.shape[1] - 1):
            steps.append(ours(cont[:, j:j + 1], kv_cache=cache))
    assert_logits_close(full[:, t - 1:-1], torch.cat(steps, 1))


def test_vision_inputs_are_rejected(models):
    _, ours = models
    with pytest.raises(ValueError, match="text-only"):
        ours(torch.zeros(1, 4, dtype=torch.long), pixel_values=torch.zeros(4, 8))
