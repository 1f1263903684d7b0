"""`VLMBase.new_cache` on every family: the cache it returns (a `KVCache`, or Nemotron-VL's hybrid
KV + Mamba cache) drives a prefill + token-by-token decode whose logits equal the full forward's,
with left padding (padding must stay invisible to later steps)."""
import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.models.common.kv_cache import KVCache
from megatron_vlm.models.common.vlm_base import VLMBase
from megatron_vlm.models.nemotron_vl.cache import HybridCache
from megatron_vlm.testing.tiny_model import tiny_qwen2_5_vl_hf_config
from megatron_vlm.testing.tiny_nemotron_vl import tiny_nemotron_qwen3_vision_hf_config
from megatron_vlm.testing.tiny_processor_internvl import tiny_internvl_config_dict
from megatron_vlm.testing.tiny_processor_qwen3_vl import tiny_qwen3_vl_config_dict

_IDS = {"vocab_size": 128, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": None, "image_token_id": 120,
        "video_token_id": 121, "vision_start_token_id": 122, "vision_end_token_id": 123}

CONFIGS = {
    "qwen2_5_vl": lambda: tiny_qwen2_5_vl_hf_config(_IDS),
    "qwen3_vl": lambda: tiny_qwen3_vl_config_dict(),
    "qwen3_vl_moe": lambda: tiny_qwen3_vl_config_dict(moe=True),
    "internvl": lambda: tiny_internvl_config_dict(),
    "nemotron_vl": lambda: tiny_nemotron_qwen3_vision_hf_config(_IDS),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_decode_with_new_cache_equals_full_forward(family):
    torch.manual_seed(0)
    model = build_model(CONFIGS[family]()).eval()
    assert isinstance(model, VLMBase)
    ids = torch.randint(2, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of the second row
    ids = ids.masked_fill(mask == 0, 0)
    prompt = 6
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        cache = model.new_cache(2, ids.shape[1])
        expected_type = HybridCache if family == "nemotron_vl" else KVCache
        assert type(cache) is expected_type and cache.seq_len == 0 and cache.max_len == ids.shape[1]
        steps = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], kv_cache=cache)]
        for t in range(prompt, ids.shape[1]):  # the mask may cover past + new tokens
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], kv_cache=cache))
    decoded = torch.cat(steps, dim=1)
    real = mask.bool()
    torch.testing.assert_close(decoded[real], full[real], rtol=1e-4, atol=1e-4)
    assert cache.seq_len == ids.shape[1]


def test_new_cache_dtype_and_device_arguments():
    model = build_model(tiny_qwen3_vl_config_dict())
    cache = model.new_cache(3, 5, dtype=torch.bfloat16, device="cpu")
    assert cache.keys[0].dtype == torch.bfloat16 and cache.batch == 3 and cache.max_len == 5
    assert cache.keys[0].shape[2] == model.args.text.num_key_value_heads
