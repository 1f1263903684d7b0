"""The one `forward` of every family (`VLMBase.forward`, models/common/vlm_base.py): an optional input the family
does not take is refused with an error naming it (it would otherwise be dropped silently), an input it ignores
leaves the logits as they are, and `takes_input` / `accepts_prefix_segments` say which it reads."""
import pytest
import torch

from megatron_vlm.models import build_model
from megatron_vlm.models.common.prefix_sharing import accepts_prefix_segments
from megatron_vlm.models.common.vlm_base import OPTIONAL_INPUTS
from megatron_vlm.testing.tiny_model import tiny_qwen2_5_vl_hf_config
from megatron_vlm.testing.tiny_nemotron_vl import tiny_nemotron_qwen3_vision_hf_config
from megatron_vlm.testing.tiny_processor_internvl import tiny_internvl_config_dict
from megatron_vlm.testing.tiny_processor_qwen3_vl import tiny_qwen3_vl_config_dict
from megatron_vlm.testing.tiny_text_model import tiny_qwen_text_hf_config

_IDS = {"vocab_size": 128, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": None, "image_token_id": 120,
        "video_token_id": 121, "vision_start_token_id": 122, "vision_end_token_id": 123}

# family -> (config, the optional inputs it reads, those it accepts and ignores)
FAMILIES = {
    "qwen2_5_vl": (lambda: tiny_qwen2_5_vl_hf_config(_IDS),
                   {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                    "mm_token_type_ids", "position_ids", "prefix_segments"}, set()),
    "qwen3_vl": (tiny_qwen3_vl_config_dict,
                 {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
                  "position_ids", "prefix_segments"}, {"second_per_grid_ts"}),
    "internvl": (tiny_internvl_config_dict, {"pixel_values", "position_ids", "prefix_segments"}, set()),
    "nemotron_vl": (lambda: tiny_nemotron_qwen3_vision_hf_config(_IDS),
                    {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "image_grid_hw"},
                    {"second_per_grid_ts", "mm_token_type_ids", "position_ids"}),
    "qwen3": (lambda: tiny_qwen_text_hf_config("qwen3", vocab_size=128), {"position_ids", "prefix_segments"},
              {"second_per_grid_ts", "mm_token_type_ids"}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inputs_taken_ignored_and_refused(family):
    make_config, takes, ignores = FAMILIES[family]
    torch.manual_seed(0)
    model = build_model(make_config()).eval()
    assert {name for name in OPTIONAL_INPUTS if model.takes_input(name)} == takes
    assert accepts_prefix_segments(model) == ("prefix_segments" in takes)
    ids = torch.randint(2, 60, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        for name in sorted(ignores):
            torch.testing.assert_close(model(ids, **{name: torch.zeros(1, 7, dtype=torch.long)}), plain, rtol=0, atol=0)
        for name in sorted(set(OPTIONAL_INPUTS) - takes - ignores):
            with pytest.raises(ValueError, match=name):
                model(ids, **{name: torch.zeros(1, 7, dtype=torch.long)})
